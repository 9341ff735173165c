"""How fast the engine really finishes each workflow's jobs, measured from the store's counters.

The Node Manager's published capacity is Theorem 1 over measured stage times:
right for stages on their own devices, wrong where they share a host's cores
with each other or with a neighbour (a CPU host, a busy machine), and stale
for the seconds after a move. Admission that trusts it accepts work the
engine cannot finish in time. The truth is the rate at which jobs leave:
every terminal transition increments ``finished:<workflow>`` in the store
(:meth:`engine.store.JobStore.drain_sample`), and the Proxy samples it with
the in-flight count a few times a second.

A window's rate is a capacity only while the engine was saturated: with
fewer requests in flight than it has stage instances, some stage waited for
work and the rate measures the arrivals, not the engine. So the meter keeps,
per workflow, the finished count and the smallest in-flight count over a
sliding window, and reports the rate only when that minimum reached the
number of instances; a saturated measurement is remembered for ``keep_s``.

Pure (fed samples, given the clock), so it is unit-tested without services.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    t: float
    inflight: int
    finished: int


class DrainMeter:
    """Completions per second per workflow (see the module docstring).

    A measurement spans at least ``window_s`` and ``min_finished`` completions (long jobs, such as
    videos, finish a few a minute), and at most ``max_window_s``; every sample in it must have had at
    least the workflow's instance count in flight.
    """

    def __init__(self, window_s: float = 5.0, min_finished: int = 8, max_window_s: float = 120.0,
                 keep_s: float = 30.0) -> None:
        self.window_s, self.min_finished, self.max_window_s, self.keep_s = window_s, min_finished, max_window_s, keep_s
        self._samples: dict[str, deque[Sample]] = {}
        self._saturated: dict[str, tuple[float, float]] = {}  # workflow -> (rate, when measured)
        self.latest: dict[str, Sample] = {}

    def record(self, workflow: str, t: float, inflight: int, finished: int, instances: int) -> None:
        """One sample of the store's counters, with the number of instances serving the workflow now."""
        q = self._samples.setdefault(workflow, deque())
        if q and finished < q[-1].finished:  # the store was reset (Redis lost): start afresh
            q.clear()
            self._saturated.pop(workflow, None)
        last = Sample(t, inflight, finished)
        q.append(last)
        while len(q) > 2 and q[1].t <= t - self.max_window_s:
            q.popleft()
        self.latest[workflow] = last
        need, low = max(1, instances), inflight
        for s in reversed(q):
            low = min(low, s.inflight)
            if low < need:
                return  # the engine ran below saturation within the span: the rate would be the arrivals'
            span, done = t - s.t, finished - s.finished
            if span >= self.window_s and done >= self.min_finished:
                self._saturated[workflow] = (done / span, t)
                return

    def note_accepted(self, workflow: str) -> None:
        """This Proxy accepted a request: count it in the latest in-flight figure at once (the next
        sample brings every Proxy's), so a refusal decided from that figure never lags its own acceptances."""
        last = self.latest.get(workflow)
        if last is not None:
            self.latest[workflow] = Sample(last.t, last.inflight + 1, last.finished)

    def rate(self, workflow: str, now: float) -> float | None:
        """The last saturated completion rate, if measured within ``keep_s``; None otherwise."""
        kept = self._saturated.get(workflow)
        if kept is not None and now - kept[1] <= self.keep_s:
            return kept[0]
        return None
