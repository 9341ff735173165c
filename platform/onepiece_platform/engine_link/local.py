"""EngineClient in-process: the Proxy's own intake (engine.proxy.intake), state in the real job store.

Nothing consumes what it accepts: the caller plays the workers by writing
events and results through :class:`engine.store.JobStore` (tests, demos
without GPUs). The same :class:`engine.proxy.intake.Intake` as the Proxy's, so
the same answers for invalid requests (400/413 with the field, 409 for a taken
UID), but no capacity model (never 503) and no injection.
"""

from __future__ import annotations

from typing import Any

from engine.proxy.intake import BadRequest, Intake
from engine.store import JobStore
from onepiece_platform.engine_link.client import Accepted, EngineClient, EngineRejected, EngineStatus
from onepiece_platform.redis_conn import get_redis

INTAKE = Intake()  # the Proxy's default image limits; no admission policy


class LocalEngineClient(EngineClient):
    def store(self) -> JobStore:
        # built per call from the current Redis client, so settings overrides in tests apply
        return JobStore(get_redis())

    def submit(self, workflow: str, params: dict[str, Any], inputs: dict[str, bytes],
               deadline_s: float | None = None, uid: str | None = None, priority: str = "normal") -> Accepted:
        try:
            sub = INTAKE.submission(workflow, params, inputs, deadline_s, priority, uid=uid)
            ticket = INTAKE.submit(self.store(), sub)
        except BadRequest as exc:
            raise EngineRejected(exc.status, str(exc), exc.field) from None
        return Accepted(ticket.uid, ticket.cost)

    def status(self, uid: str) -> EngineStatus | None:
        st = self.store().status(uid)
        if st is None:
            return None
        return EngineStatus(uid, st.state, st.workflow, st.stage, st.progress, st.detail)

    def cancel(self, uid: str) -> bool:
        store = self.store()
        if store.status(uid) is None:
            return False
        store.request_cancel(uid)
        return True

    def result(self, uid: str) -> bytes | None:
        return self.store().result(uid)

    def drop_result(self, uid: str) -> bool:
        store = self.store()
        st = store.status(uid)
        return st is not None and st.terminal and store.drop_results([uid]) > 0
