"""The Request Monitor: admit or fast-reject a request before it is queued anywhere.

Pure arithmetic over a snapshot (what is in flight, how many instances serve
the workflow), so it is decided at once and unit-tested without services.

Model: each instance serves about one predicted GPU-second per second (the
cost model's unit), so work already accepted for a workflow drains in
``inflight_cost / instances`` seconds; a new request can start roughly then.
The cost model's coefficients are priors for the reference GPU (see the
workflow specs); on other hardware the prediction is proportionally off, which
the deployment corrects by refitting the coefficients, not here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Load:
    """What the Proxy knows about one workflow when a request arrives."""

    inflight: int  # accepted, unfinished requests
    inflight_cost: float  # their predicted GPU-seconds
    instances: int  # published instances across the workflow's stages
    entry_instances: int  # published instances of the first stage
    capacity_rps: float | None = None  # requests/s the Node Manager measured the workflow sustains


@dataclass(frozen=True)
class Decision:
    admit: bool
    reason: str = ""
    retry_after: int = 0  # whole seconds, for the Retry-After header
    predicted_wait_s: float = 0.0


class RequestMonitor:
    """Admission control with a bounded queue and a predicted start time.

    Contract: ``decide`` never blocks and never queues; a rejection carries a
    positive ``retry_after``.
    """

    def __init__(self, max_queue: int, dispatch_s: float = 0.01) -> None:
        """``dispatch_s``: time from intake to the first stage starting on an idle instance
        (ring hand-off plus decode and store checks); no request starts sooner."""
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        self.max_queue = max_queue
        self.dispatch_s = dispatch_s

    def predicted_wait(self, load: Load) -> float:
        """Seconds until a new request can start: the accepted work ahead of it, drained at the
        measured capacity when the Node Manager publishes one, else at one GPU-second per
        instance per second (the cost model's prior)."""
        if load.capacity_rps:
            return self.dispatch_s + load.inflight / load.capacity_rps
        return self.dispatch_s + load.inflight_cost / max(1, load.instances)

    def decide(self, load: Load, cost: float, now: float, deadline: float | None) -> Decision:
        wait = self.predicted_wait(load)
        retry = max(1, math.ceil(wait))
        if load.entry_instances == 0:
            return Decision(False, "no instance serves this workflow yet", retry, wait)
        if load.inflight >= self.max_queue:
            return Decision(False, f"queue full ({load.inflight} requests in flight)", retry, wait)
        if deadline is not None and now + wait >= deadline:
            return Decision(False, f"cannot start within the deadline (predicted wait {wait:.1f}s)", retry, wait)
        return Decision(True, predicted_wait_s=wait)
