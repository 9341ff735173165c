"""The Request Monitor: admit or fast-reject a request before it is queued anywhere.

Pure arithmetic over a snapshot (what is in flight, how many instances serve
the workflow), so it is decided at once and unit-tested without services.

Model: the accepted work drains at a rate, in order of preference: what the
engine was measured to finish while saturated (:mod:`engine.proxy.drain`: the
truth on a shared host, and right after instances moved), the capacity the
Node Manager computes from stage times (Theorem 1), or, before either exists,
one predicted GPU-second per instance per second (the cost model's prior for
the reference GPU). A new request starts after the ``inflight`` requests ahead
of it have drained (``predicted_wait``), and by Little's law on a saturated
pipeline it finishes ``(inflight + 1) / rate`` after it arrives, never sooner
than the pipeline's unloaded latency (``predicted_finish``). A request with a
deadline is refused unless that finish, with a safety ``margin``, falls before
it: admission never accepts what it cannot finish in time. Until a saturated
rate has been measured, such requests are admitted only while fewer than twice
the workflow's instances are in flight: enough to keep every instance busy (and
so to measure the rate), not enough to queue work on an unmeasured promise.

Two kinds of refusal. One that would fit later, when some of the accepted work
has drained (the queue bound, a deadline missed for the line ahead), says when
to come back: ``retry_after`` is the time the measured rate takes to drain the
requests that stand in the way (never more than the whole line's wait). One
that can never fit (its own stage work, priced from this deployment's
measurements, is over its deadline even on an idle engine) is ``final``: a
retry would be refused the same, so the Proxy answers it as a client error
(engine.proxy.intake), not as an overload to retry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def _secs(s: float) -> str:
    """Seconds as a refusal says them: whole from 10 s up, else to the hundredth."""
    return f"{s:.0f}s" if s >= 10 else f"{s:.2f}s"


@dataclass(frozen=True)
class Load:
    """What the Proxy knows about one workflow when a request arrives."""

    inflight: int  # accepted, unfinished requests
    inflight_cost: float  # their predicted GPU-seconds
    instances: int  # published instances across the workflow's stages
    entry_instances: int  # published instances of the first stage
    capacity_rps: float | None = None  # requests/s the Node Manager measured the workflow sustains
    drain_rps: float | None = None  # requests/s the engine was seen to finish while saturated (drain.py)
    base_latency_s: float = 0.0  # the pipeline's unloaded latency (sum of its measured stage times)


@dataclass(frozen=True)
class Decision:
    admit: bool
    reason: str = ""
    retry_after: int = 0  # whole seconds, for the Retry-After header
    predicted_wait_s: float = 0.0
    predicted_finish_s: float = 0.0
    final: bool = False  # refused whatever the load: its own work is over its deadline (not to be retried)


class RequestMonitor:
    """Admission control with a bounded queue and a predicted start time.

    Contract: ``decide`` never blocks and never queues; a rejection carries a
    positive ``retry_after``.
    """

    def __init__(self, max_queue: int, dispatch_s: float = 0.01, margin: float = 1.2) -> None:
        """``dispatch_s``: time from intake to the first stage starting on an idle instance
        (ring hand-off plus decode and store checks); no request starts sooner. ``margin``: the
        predicted finish is stretched by this factor before it is compared with a deadline (the
        rate is measured, and measurements vary)."""
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if margin < 1:
            raise ValueError(f"margin must be >= 1, got {margin}")
        self.max_queue = max_queue
        self.dispatch_s = dispatch_s
        self.margin = margin

    @staticmethod
    def rate(load: Load) -> float | None:
        """Requests/s the accepted work drains at: measured, else the Node Manager's, else None."""
        return load.drain_rps or load.capacity_rps or None

    def predicted_wait(self, load: Load) -> float:
        """Seconds until a new request can start: the accepted work ahead of it, drained at
        :meth:`rate`, else at one GPU-second per instance per second (the cost model's prior)."""
        rate = self.rate(load)
        if rate:
            return self.dispatch_s + load.inflight / rate
        return self.dispatch_s + load.inflight_cost / max(1, load.instances)

    def predicted_finish(self, load: Load, cost: float, own_s: float | None = None) -> float:
        """Seconds until a new request is done (see the module docstring). ``own_s``: the request's own
        seconds of stage work as priced from measured stage times (engine.workflow.pricing): a request
        far larger than the ones the rate was measured on takes at least its wait plus that."""
        rate = self.rate(load)
        own = own_s or 0.0
        if rate:
            return self.dispatch_s + max(load.base_latency_s, (load.inflight + 1) / rate, load.inflight / rate + own)
        return self.predicted_wait(load) + max(load.base_latency_s, own, cost / max(1, load.entry_instances))

    def retry_after(self, load: Load, wait: float, excess: float | None = None) -> int:
        """Whole seconds until a refused request would be admitted: the ``excess`` requests in flight beyond what
        it could be admitted with, drained at the measured rate; else (no rate, or no such number) the predicted
        wait of the whole line. At least 1."""
        rate = self.rate(load)
        if rate and excess is not None:
            return max(1, min(math.ceil(max(1.0, excess) / rate), max(1, math.ceil(wait))))
        return max(1, math.ceil(wait))

    def admissible(self, load: Load, deadline_s: float, own_s: float | None) -> float | None:
        """The most requests in flight with which a request of ``own_s`` seconds of work and ``deadline_s``
        seconds left would still be admitted (the start and finish rules, at the measured rate); None without
        a rate or when no number of them would do (the unloaded latency alone is over the deadline)."""
        rate = self.rate(load)
        if not rate:
            return None
        room = deadline_s / self.margin - self.dispatch_s
        if load.base_latency_s > room:
            return None
        most = min((deadline_s - self.dispatch_s) * rate - 1e-9, room * rate - 1, (room - (own_s or 0.0)) * rate)
        return math.floor(most) if most >= 0 else None

    def decide(self, load: Load, cost: float, now: float, deadline: float | None,
               own_s: float | None = None) -> Decision:
        wait = self.predicted_wait(load)
        retry = max(1, math.ceil(wait))
        if load.entry_instances == 0:
            return Decision(False, "no instance serves this workflow yet", retry, wait)
        if deadline is not None and own_s is not None and self.margin * own_s > deadline - now:
            # even on an idle engine it would not finish in time: refused at once, whatever the queue, for good
            return Decision(False, f"this request needs about {_secs(own_s)} of stage work here (priced from the "
                                   f"stage times measured on this deployment), over its {_secs(deadline - now)} "
                                   "deadline even on an idle engine: ask for fewer steps or a smaller size, or "
                                   "submit it without a deadline (the native API)",
                            retry, wait, own_s, final=True)
        if load.inflight >= self.max_queue:
            return Decision(False, f"queue full ({load.inflight} requests in flight)",
                            self.retry_after(load, wait, load.inflight - self.max_queue + 1), wait)
        finish = self.predicted_finish(load, cost, own_s)
        if deadline is not None and load.drain_rps is None and load.inflight >= 2 * max(1, load.instances):
            # Nothing measured yet of what the engine finishes while saturated (the Node Manager's figure
            # assumes devices of their own, and is high where stages share a host's cores): admit no deeper
            # queue than keeps every instance busy, which is exactly what measures it within seconds.
            return Decision(False, f"queue at {load.inflight} requests while the engine's rate is being measured",
                            retry, wait, finish)
        if deadline is not None and (now + wait >= deadline or now + self.margin * finish > deadline):
            most = self.admissible(load, deadline - now, own_s)
            retry = self.retry_after(load, wait, None if most is None else load.inflight - most)
            if now + wait >= deadline:
                return Decision(False, f"cannot start within the deadline (predicted wait {wait:.1f}s)", retry,
                                wait, finish)
            return Decision(False, f"cannot finish within the deadline (predicted {finish:.1f}s to finish, "
                                   f"{deadline - now:.1f}s left)", retry, wait, finish)
        return Decision(True, predicted_wait_s=wait, predicted_finish_s=finish)
