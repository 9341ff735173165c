"""``/ws/jobs/<uid>``: one job's progress, to its owner only.

On connect the client gets the job's current state (from the ledger), then
every change the ledger publishes to the ``job.<uid>`` group. After a
reconnect it gets the current state again, so nothing missed while away
stays missed; REST (GET /api/v1/jobs/<uid>) remains the truth to resync from.
A UID that is not the user's is refused exactly like one that does not
exist (close code 4404), so a socket reveals nothing about other users' jobs.
Refusals accept the handshake and then close with the code: a close before
the accept becomes an HTTP 403 at the handshake, and browsers never see the
code (the WebSocket API reports 1006 for every failed handshake).
A job submitted with ``preview_every`` also gets its live previews, in step order, while it runs
(``{"type": "preview", "preview": {"id", "stage", "step", "total", "mime", "image": data URL}}``,
onepiece_platform.jobs.previews).
After each state of an unfinished job comes its ETA as the engine estimates it
(``{"type": "eta", "uid", "eta_s", "eta_p90_s", "provisional", "queue_ahead"}``;
nothing when the engine gives none).
"""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from engine.store.keys import TERMINAL
from onepiece_platform.jobs import previews
from onepiece_platform.jobs.push import group_name, job_payload

NOT_FOUND, UNAUTHENTICATED = 4404, 4401


@database_sync_to_async
def _own_job(user: Any, uid: str) -> dict[str, Any] | None:
    from onepiece_platform.jobs.models import Job

    job = Job.objects.filter(uid=uid, owner=user, hidden=False).first()
    return job_payload(job) if job else None


@sync_to_async(thread_sensitive=False)
def _eta(uid: str) -> dict[str, Any] | None:
    """The engine's ETA of an unfinished job (one status read of the Proxy), None where it gives none."""
    from onepiece_platform.engine_link.client import EngineError, get_engine

    try:
        st = get_engine().status(uid)
    except EngineError:  # the socket still carries the job's state; the ETA comes with the next one
        return None
    return st.eta if st is not None and st.state not in TERMINAL else None


async def refuse(consumer: AsyncJsonWebsocketConsumer, code: int) -> None:
    """Accept, then close with ``code``: the only way the code reaches a browser."""
    await consumer.accept()
    await consumer.close(code=code)


async def signed_in(consumer: AsyncJsonWebsocketConsumer) -> Any | None:
    """The connecting user; None once an anonymous one is refused (4401)."""
    user = consumer.scope.get("user")
    if user is None or not user.is_authenticated:
        await refuse(consumer, UNAUTHENTICATED)
        return None
    return user


class SignedInConsumer(AsyncJsonWebsocketConsumer):
    """A socket for signed-in users: an anonymous one is refused (4401); a signed-in one is let in by
    :meth:`admit`, or refused with the close code it returns."""

    async def connect(self) -> None:
        user = await signed_in(self)
        if user is None:
            return
        code = await self.admit(user)
        if code is not None:
            await refuse(self, code)

    async def admit(self, user: Any) -> int | None:
        """Accept and start serving ``user``, and return None; or return the close code that refuses them."""
        raise NotImplementedError


class JobConsumer(SignedInConsumer):
    async def admit(self, user: Any) -> int | None:
        uid = self.scope["url_route"]["kwargs"]["uid"]
        job = await _own_job(user, uid)
        if job is None:
            return NOT_FOUND
        self.group = group_name(uid)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        await self.send_json({"type": "job", "job": job})
        self.previews = await previews.tail(self, uid)  # its previews, in order, when the job asked for them
        await self.send_eta(job)
        return None

    async def job_update(self, event: dict[str, Any]) -> None:
        await self.send_json({"type": "job", "job": event["job"]})
        await self.send_eta(event["job"])

    async def send_eta(self, job: dict[str, Any]) -> None:
        if job.get("state") in TERMINAL or not job.get("uid"):
            return
        est = await _eta(job["uid"])
        if est:
            await self.send_json({"type": "eta", "uid": job["uid"], **est})

    async def disconnect(self, code: int) -> None:
        previews.stop(getattr(self, "previews", None))
        group = getattr(self, "group", None)
        if group is not None:
            await self.channel_layer.group_discard(group, self.channel_name)

    async def receive_json(self, content: Any, **kwargs: Any) -> None:
        """Clients send nothing; anything sent is ignored (the socket is one-way)."""
