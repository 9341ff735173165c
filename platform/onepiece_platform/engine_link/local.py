"""EngineClient in-process: the Proxy's own intake (engine.proxy.intake), state in the real job store.

Nothing consumes what it accepts: the caller plays the workers by writing
events and results through :class:`engine.store.JobStore` (tests, demos
without GPUs). The same :class:`engine.proxy.intake.Intake` as the Proxy's, so
the same admission order (:meth:`engine.proxy.intake.Intake.admit`, on the
calling thread's :class:`engine.proxy.intake.InProcessPorts`), so the same
answers for invalid requests (400/413 with the field, 409 for a taken UID).
By default no capacity model (never 503) and no injection; given an intake with
a Request Monitor and the load figures, it refuses as the Proxy does (503 with
Retry-After).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.proxy.intake import InProcessPorts, Intake, Overloaded
from engine.proxy.monitor import Load
from engine.proxy.parsing import BadRequest
from engine.store import JobStore
from engine.workflow.options import DEFAULT as DEFAULT_OPTIONS
from engine.workflow.options import Options
from onepiece_platform.engine_link.client import (
    Accepted,
    EngineClient,
    EngineRejected,
    EngineStatus,
    api_params,
)
from onepiece_platform.engine_link.objects import job_store

INTAKE = Intake()  # the Proxy's default image limits; no admission policy


class LocalEngineClient(EngineClient):
    def __init__(self, intake: Intake | None = None, load: Callable[[str], Load | None] | None = None) -> None:
        """``intake``: the rules (default: the Proxy's image limits, no admission policy); ``load(workflow)``:
        the figures its Request Monitor decides on (None: admitted)."""
        self.intake = intake or INTAKE
        self.load = load

    def store(self) -> JobStore:
        # built per call from the current Redis client (and object store), so settings overrides in tests apply
        return job_store()

    def submit(self, workflow: str, params: dict[str, Any], inputs: dict[str, bytes],
               options: Options = DEFAULT_OPTIONS, uid: str | None = None) -> Accepted:
        intake = self.intake
        try:
            ticket = intake.ticket(intake.submission(workflow, api_params(params, options), inputs,
                                                     options.deadline_s, options.priority, uid=uid))
            admitted = intake.admit_sync(ticket, InProcessPorts(self.store(), self.load))
        except BadRequest as exc:
            raise EngineRejected(exc.status, str(exc), exc.field) from None
        except Overloaded as exc:
            raise EngineRejected(503, str(exc), "", exc.decision.retry_after) from None
        return Accepted(ticket.uid, ticket.cost, admitted.decision.predicted_wait_s)

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
