"""EngineClient in-process: validation and cost from the workflow specs, state in the real job store.

Nothing consumes what it accepts: the caller plays the workers by writing
events and results through :class:`engine.store.JobStore` (tests, demos
without GPUs). Same answers as the Proxy for invalid requests (400 with the
field), no capacity model (never 503).
"""

from __future__ import annotations

import uuid
from typing import Any

from engine.store import JobStore
from engine.workflow import InvalidRequest, get_workflow, workflows
from onepiece_platform.engine_link.client import Accepted, EngineClient, EngineRejected, EngineStatus
from onepiece_platform.redis_conn import get_redis


class LocalEngineClient(EngineClient):
    def store(self) -> JobStore:
        # built per call from the current Redis client, so settings overrides in tests apply
        return JobStore(get_redis())

    def submit(self, workflow: str, params: dict[str, Any], inputs: dict[str, bytes],
               deadline_s: float | None = None, uid: str | None = None) -> Accepted:
        if workflow not in workflows():
            raise EngineRejected(400, f"unknown workflow {workflow!r}", "workflow")
        spec = get_workflow(workflow)
        try:
            resolved = spec.resolve_params(params)
        except InvalidRequest as exc:
            raise EngineRejected(400, str(exc), exc.field) from None
        for t in spec.request_inputs:
            if t.name not in inputs:
                raise EngineRejected(400, f"{workflow} needs an input {t.name!r}", t.name)
        store = self.store()
        if uid is not None and store.status(uid) is not None:
            raise EngineRejected(409, f"uid {uid} is already taken", "uid")
        uid = uid or uuid.uuid4().hex
        cost = spec.estimate_gpu_seconds(resolved)
        store.accept(uid, workflow, cost)
        return Accepted(uid, cost)

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
