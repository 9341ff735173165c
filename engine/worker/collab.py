"""Collaboration mode: classifier-free-guidance parallelism between two instances of a denoise stage.

In Individual mode one instance computes both predictions of every guided
step, the conditional and the unconditional one. In Collaboration mode (a
workflow's mode, set by the Node Manager's ``set_mode`` action and read from
the route table) the instance that took the request, the *leader*, asks a
peer instance of the same stage, the *helper*, for the unconditional half of
each step while it computes the conditional half itself, so a step takes one
prediction's time instead of two.

Each collaborating instance has a second ring besides its inbox, its *collab
ring* (published in its route). Through it a helper receives

  ``begin``  the request's fixed inputs (negative embeddings, image embeddings)
  ``step``   one step's model input and timestep
  ``end``    the request is done (or abandoned)

and a leader receives its helper's ``reply`` (the unconditional prediction of
one step) or ``error`` (the helper lost the request, e.g. it restarted). One
thread per worker (:class:`CfgService`) consumes the collab ring: it serves
help requests and hands replies to the waiting leader.

Output stays bit-identical to Individual mode because the helper runs the
same code (:meth:`predict_uncond` of the same executor class, same weights,
dtype and device) on the same tensors, which cross the ring bit for bit; the
leader combines the two halves exactly as before. If the helper does not
answer in time (it died, or is stuck), the leader computes the missing halves
itself from that step on: the request is slower, never lost or different.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from engine.background import Background
from engine.coord.routes import Route, RouteTable
from engine.dispatch.deliver import Producers
from engine.transport.ring import RingConsumer
from engine.workflow import message as wm

log = logging.getLogger("onepiece.collab")

BEGIN, STEP, END, REPLY, ERROR = "begin", "step", "end", "reply", "error"


class CfgRemote:
    """The leader's handle on its helper for one request (``StageContext.cfg_parallel``).

    Used from the leader's main thread only. ``send_step`` returns False and
    ``wait_step`` None once the helper is given up on; the executor then computes
    the unconditional half itself.
    """

    def __init__(self, service: CfgService, helper: Route, header: wm.Header) -> None:
        self.service, self.helper, self.uid = service, helper, header.uid
        self.workflow, self.stage = header.workflow, header.stage
        self.failed = False
        self.steps_helped = 0
        self._last_local_s = 1.0

    def _send(self, op: str, tensors: dict[str, Any], step: int = -1) -> bool:
        if self.failed:
            return False
        from engine.stages.components import values_to_message

        td, _ = values_to_message(tensors)
        header = wm.Header(uid=self.uid, workflow=self.workflow, stage=self.stage, route=[],
                           params={"op": op, "step": step, "reply_to": self.service.address,
                                   "leader": self.service.instance})
        try:
            self.service.send(self.helper, wm.encode(header, td))
            return True
        except Exception as exc:  # the helper's ring is gone: go on alone
            self._give_up(f"cannot reach {self.helper.instance}: {exc}")
            return False

    def begin(self, tensors: dict[str, Any]) -> bool:
        self.service.expect(self.uid)
        return self._send(BEGIN, tensors)

    def send_step(self, step: int, tensors: dict[str, Any]) -> bool:
        return self._send(STEP, tensors, step)

    def local_time(self, seconds: float) -> None:
        """The leader's own half took ``seconds``: the helper's should take about as long."""
        self._last_local_s = seconds

    def wait_step(self, step: int) -> Any:
        """The helper's unconditional prediction of ``step`` (a torch tensor), or None to compute it here."""
        if self.failed:
            return None
        timeout = max(5.0, 20 * self._last_local_s)
        got = self.service.reply(self.uid, step, timeout)
        if isinstance(got, str):
            self._give_up(got)
            return None
        self.steps_helped += 1
        return got

    def end(self) -> None:
        if not self.failed:
            self._send(END, {})
        self.service.forget(self.uid)

    def _give_up(self, why: str) -> None:
        if not self.failed:
            log.warning("request %s: helper %s given up (%s); computing both halves here", self.uid,
                        self.helper.instance, why)
        self.failed = True


class CfgService:
    """One collaborating worker's side of Collaboration mode; see the module docstring."""

    def __init__(self, instance: str, address: str, consumer: RingConsumer, executor: Any,
                 send_timeout: float = 5.0, on_helped: Callable[[int], None] | None = None) -> None:
        self.instance, self.address = instance, address
        self.consumer, self.executor = consumer, executor
        self.on_helped = on_helped
        self._send_lock = threading.Lock()  # the leader (main thread) and the service thread both send
        self._producers = Producers(send_timeout)
        self._sessions: dict[tuple[str, str], dict[str, Any]] = {}  # (leader, uid) -> begin tensors
        self._replies: dict[tuple[str, int], Any] = {}
        self._waiting: set[str] = set()
        self._cond = threading.Condition()
        self._loop_thread = Background(f"onepiece-cfg-{instance}", self._loop)
        self._stop = self._loop_thread.stopping
        self._rr = itertools.count()
        self.helped_steps = 0

    # -- life cycle --------------------------------------------------------------------------------
    def start(self) -> CfgService:
        self._loop_thread.start()
        return self

    def stop(self) -> None:
        self._loop_thread.stop()
        with self._send_lock:
            self._producers.close()
        self.consumer.close()

    # -- leader side -------------------------------------------------------------------------------
    def remote_for(self, header: wm.Header, routes: RouteTable) -> CfgRemote | None:
        """A helper for this request, or None (no other collaborating instance is published)."""
        peers = [r for r in routes.candidates(header.workflow, header.stage) if r.collab and r.instance != self.instance]
        if not peers:
            return None
        return CfgRemote(self, peers[next(self._rr) % len(peers)], header)

    def send(self, route: Route, data: bytes) -> None:
        """Send to ``route``'s collab ring (keyed by that address alone: help and replies share it)."""
        target = Route(route.workflow, route.stage, route.instance, route.collab, route.node, 0)
        with self._send_lock:
            self._producers.get(target).send(data)

    def expect(self, uid: str) -> None:
        with self._cond:
            self._waiting.add(uid)

    def forget(self, uid: str) -> None:
        with self._cond:
            self._waiting.discard(uid)
            for k in [k for k in self._replies if k[0] == uid]:
                del self._replies[k]

    def reply(self, uid: str, step: int, timeout: float) -> Any:
        """The tensor for (uid, step), or a string saying why there is none."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                got = self._replies.pop((uid, step), None)
                if got is not None:
                    return got
                if (uid, -1) in self._replies:
                    return str(self._replies.pop((uid, -1)))
                left = deadline - time.monotonic()
                if left <= 0:
                    return f"no answer for step {step} within {timeout:.1f}s"
                self._cond.wait(left)

    # -- the collab ring ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                d = self.consumer.recv(timeout=0.1)
            except Exception:  # the ring was closed under us at shutdown
                if self._stop.is_set():
                    return
                log.exception("collab ring failed")
                time.sleep(0.1)
                continue
            if d is None:
                continue
            try:
                self._handle(d)
            except Exception:  # one bad message must not stop the service
                log.exception("collab message failed")
            finally:
                d.release()

    def _handle(self, d: Any) -> None:
        from engine.stages.components import to_torch

        msg = wm.decode(d.view)
        h, p = msg.header, msg.header.params
        op = p.get("op")
        if op in (REPLY, ERROR):
            with self._cond:
                if h.uid in self._waiting:
                    if op == REPLY:
                        self._replies[(h.uid, int(p["step"]))] = to_torch(msg.tensors["noise_uncond"]).clone()
                    else:
                        self._replies[(h.uid, -1)] = p.get("error", "helper error")
                    self._cond.notify_all()
            return
        key = (str(p.get("leader", "")), h.uid)
        reply_to = Route(h.workflow, h.stage, str(p.get("leader", "")), "", "", 0, str(p.get("reply_to", "")))
        if op == BEGIN:
            self._sessions[key] = {k: to_torch(t).clone() for k, t in msg.tensors.items()}
        elif op == END:
            self._sessions.pop(key, None)
        elif op == STEP:
            session = self._sessions.get(key)
            if session is None:  # e.g. this worker restarted mid-request: the leader goes on alone
                self._answer(reply_to, h, {"op": ERROR, "step": int(p["step"]), "error": "unknown request"}, {})
                return
            step_in = {k: to_torch(t) for k, t in msg.tensors.items()}
            out = self.executor.predict_uncond(session, step_in)
            self._answer(reply_to, h, {"op": REPLY, "step": int(p["step"])}, {"noise_uncond": out})
            self.helped_steps += 1
            if self.on_helped is not None:
                self.on_helped(1)

    def _answer(self, to: Route, h: wm.Header, params: dict[str, Any], tensors: dict[str, Any]) -> None:
        from engine.stages.components import values_to_message

        td, _ = values_to_message(tensors)
        header = wm.Header(uid=h.uid, workflow=h.workflow, stage=h.stage, route=[], params=params)
        try:
            self.send(to, wm.encode(header, td))
        except Exception as exc:  # the leader is gone; it will not wait for us
            log.warning("cannot answer %s for %s: %s", to.instance, h.uid, exc)
