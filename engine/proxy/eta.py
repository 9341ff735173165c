"""The ETA of a queued or running job: a p50 and a p90 from measured stage times, the job's place in line
and the pools' rate, calibrated on this deployment's own recent jobs.

Pure: inputs in, estimate out; no clock of its own (callers pass ``now``, the Proxy's ``time.monotonic``),
no I/O. The Proxy (engine.proxy.state) keeps one :class:`Book` of the jobs it accepted and one
:class:`History` per workflow and priority, and computes an estimate on each status read from values it
already caches (the pricer's stage fits, the drain meter's rate, the Node Manager's capacity): nothing is
added to the submit path's store round trips.

The model (:func:`raw`): a job finishes after its own remaining stage work (the stages it has not run,
and what is left of the one it runs, from ``progress``), and, on a busy engine, not before the jobs served
ahead of it have drained: ``(ahead + 1) / rate`` (Little's law on a saturated pipeline, as the Request
Monitor predicts a new request's finish). Who is ahead (:meth:`Book.ahead`) follows the stages' serving
order (engine.dispatch.order): every unfinished job of a higher priority, and those of the same priority
accepted earlier, and lower ones accepted earlier that waited past the aging bound.

Calibration: the raw model ignores hop costs, the cores the stages share, batching. Each finished job
records ``actual / raw`` (the raw model at its submit) under its regime (:func:`regime`: how many jobs were
ahead of it, in powers of two). The two regimes err differently: on an idle engine (nobody ahead) the raw
model is the stage work alone and the ratio carries the service's whole noise and the hop costs; in a long
line the ``(ahead + 1) / rate`` term dominates, the noise of many jobs averages out and the ratio sits
tight, near or below 1 (the job in service is partly done). One distribution for both told the jobs of a
quiet engine the tight p90 a saturated run had left (coverage 55-68% at 0.5x load in ``bench e2e``) and
those of a busy one the wide p90 of the quiet run (92-98% at 1x). So the p50 is the raw model times the
median of the last :data:`RECENT` ratios of the job's own regime, the p90 times their conformal 90th
percentile (the ``ceil((n + 1) * 0.9)``-th smallest: covers a new job of that regime with probability at
least 90% where its ratios are exchangeable). They are not quite: a line's jobs are late together, and the
ratios of those still in it are not known yet; so each regime's quantile level adapts as in adaptive
conformal inference (Gibbs and Candes, 2021): up :data:`ADAPT` times 0.9 after a job it missed, down
:data:`ADAPT` times 0.1 after one it covered. A regime with fewer than :data:`MIN_REGIME` ratios borrows the adjacent regimes' (the nearest
first, up to :data:`RECENT`), its p90 never below :data:`PRIOR_P90` times their median (a safe margin
while it fills); with nothing finished at all, :data:`PRIOR_P50`, :data:`PRIOR_P90`.
The gate (as AI Horde gates its forecast): among the last :data:`WINDOW` finished jobs, at least
:data:`MIN_JOBS`, the share that finished within max(1 s, 50%) of the p50 they were told at submit is at
least :data:`WITHIN_GOAL` and the share within the p90 they were told lies in :data:`COVERAGE_GOAL`.
Until then every estimate says ``provisional: true``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.dispatch import order

WINDOW = 200  # finished jobs a History keeps (the gate's window)
RECENT = 40  # ratios each regime's calibration keeps (a small window: load changes are followed within it)
MIN_REGIME = 10  # a regime's own ratios needed before it stops borrowing its neighbours'
P90_LEVEL = 0.9  # the coverage a regime's p90 aims at (its quantile of the ratios starts there)
ADAPT = 0.01  # how far one miss (up) or hit (down) moves a regime's quantile level
LEVEL_BOUNDS = (0.8, 0.99)
MIN_JOBS = 20  # finished jobs the gate needs before it can pass
WITHIN_GOAL = 0.80  # share within max(1 s, 50%) of their p50
COVERAGE_GOAL = (0.85, 0.95)  # share within their p90
PRIOR_P50 = 1.0  # actual / raw before anything finished here
PRIOR_P90 = 1.5


@dataclass(frozen=True)
class Estimate:
    """What a job's status says about when it will be done (seconds from now)."""

    eta_s: float
    eta_p90_s: float
    provisional: bool
    ahead: int  # jobs served before it
    rate_rps: float | None  # the rate the line drains at, when known

    def as_dict(self) -> dict[str, object]:
        return {"eta_s": round(self.eta_s, 3), "eta_p90_s": round(self.eta_p90_s, 3),
                "provisional": self.provisional, "queue_ahead": self.ahead}

    def header(self) -> str:
        """The ``OnePiece-ETA`` response header (:func:`header`)."""
        return header(self.eta_s, self.eta_p90_s, self.provisional)


HEADER = "OnePiece-ETA"


def header(eta_s: float, eta_p90_s: float, provisional: bool) -> str:
    """The value of the :data:`HEADER` response header: ``p50=1.234; p90=2.345; provisional=1``."""
    return f"p50={eta_s:.3f}; p90={eta_p90_s:.3f}; provisional={int(provisional)}"


def stage_seconds(fits: Mapping[tuple[str, str], Any], spec: Any, params: Mapping[str, Any],
                  base_latency_s: float = 0.0) -> list[float]:
    """A request's seconds at each stage of its route: the stage's measured fit
    (engine.workflow.pricing.Fit) where it has one, else its prior; with no fit at all and the Node
    Manager's measured unloaded latency ``base_latency_s``, the priors scaled to sum to it (priors are
    GPU-seconds on the reference device, not this one's)."""
    dims, prior = spec.dims(params), spec.estimate_cost(params)
    out, measured = [], False
    for stage in spec.route():
        fit, model = fits.get((spec.name, stage)), spec.costs.get(stage)
        if fit is not None and model is not None:
            out.append(float(fit.predict(model.units(dims), model.steps(dims), model.growth)))
            measured = True
        else:
            out.append(float(prior.get(stage, 0.0)))
    total = sum(out)
    if not measured and base_latency_s > 0 and total > 0:
        out = [s * base_latency_s / total for s in out]
    return out


def remaining_work(stage_s: Sequence[float], stage_index: int | None, progress: float) -> float:
    """Seconds of the job's own stage work still to run. ``stage_s``: its seconds at each stage of its
    route; ``stage_index``: the stage it runs now (None: queued, nothing run); ``progress``: 0-100 over the
    whole job (what workers publish), read as the share done of the stage it runs."""
    if stage_index is None:
        return float(sum(stage_s))
    i = max(0, min(len(stage_s) - 1, stage_index))
    before = sum(stage_s[:i])
    total = sum(stage_s) or 1.0
    # progress is the job's, over every stage: what of stage i is done is the part past the stages before it
    done_here = max(0.0, min(stage_s[i], progress / 100.0 * total - before))
    return float(stage_s[i] - done_here + sum(stage_s[i + 1:]))


def raw(own_remaining_s: float, ahead: int, rate_rps: float | None, bottleneck_s: float) -> float:
    """The uncalibrated seconds to finish: its own work, or the line ahead drained at ``rate_rps`` (else at
    one job per ``bottleneck_s``, the slowest stage's time), whichever is longer."""
    per_job = 1.0 / rate_rps if rate_rps else bottleneck_s
    return max(own_remaining_s, (ahead + 1) * per_job) if ahead else own_remaining_s


def _quantile(values: Sequence[float], q: float) -> float:
    """The conformal ``q`` quantile: the ``ceil((n + 1) q)``-th smallest (the largest when that is past n)."""
    s = sorted(values)
    return s[max(0, min(len(s), math.ceil((len(s) + 1) * q)) - 1)]


REGIMES = 6  # 0: nobody ahead; r >= 1: 2**(r-1) <= ahead < 2**r; the last: that many or more


def regime(ahead: int) -> int:
    """The calibration's regime of a job with ``ahead`` jobs served before it: 0 when none (an idle
    engine: the raw model is the stage work), else ``1 + floor(log2(ahead))``, at most ``REGIMES - 1``."""
    return 0 if ahead <= 0 else min(REGIMES - 1, int(ahead).bit_length())


@dataclass
class History:
    """This deployment's recent finished jobs: ``(raw at submit, p50 told, p90 told, actual)`` (the gate's
    window), and each regime's last :data:`RECENT` ``actual / raw`` ratios (the calibration)."""

    window: int = WINDOW
    jobs: deque[tuple[float, float, float, float]] = field(default_factory=deque)
    ratios: list[deque[float]] = field(default_factory=lambda: [deque(maxlen=RECENT) for _ in range(REGIMES)])
    levels: list[float] = field(default_factory=lambda: [P90_LEVEL] * REGIMES)  # each regime's p90 quantile
    # the gate over the window, computed once per finished job (not once per estimate: a status poll asks)
    _gate: dict[str, float | int | bool] | None = field(default=None, repr=False)

    def record(self, raw_s: float, p50_s: float, p90_s: float, actual_s: float, ahead: int = 0) -> None:
        """A finished job: the raw model, p50 and p90 at its submit, its seconds, who was ahead of it then."""
        self.jobs.append((raw_s, p50_s, p90_s, actual_s))
        while len(self.jobs) > self.window:
            self.jobs.popleft()
        self._gate = None
        if raw_s > 0:
            r = regime(ahead)
            self.ratios[r].append(actual_s / raw_s)
            # adaptive conformal: a miss raises the regime's level, a hit lowers it, so that its coverage
            # holds at P90_LEVEL where the ratios drift (a growing line) or come in correlated runs
            level = self.levels[r] + ADAPT * ((actual_s > p90_s) - (1 - P90_LEVEL))
            self.levels[r] = min(LEVEL_BOUNDS[1], max(LEVEL_BOUNDS[0], level))

    def factors(self, ahead: int = 0) -> tuple[float, float]:
        """(p50, p90) multipliers of the raw model for a job with ``ahead`` jobs before it: quantiles of its
        regime's recent ``actual / raw``, borrowing the nearest regimes' while it has too few."""
        r = regime(ahead)
        own = list(self.ratios[r])
        if len(own) >= MIN_REGIME:
            return _quantile(own, 0.5), max(_quantile(own, self.levels[r]), _quantile(own, 0.5))
        pool = own
        for d in range(1, REGIMES):
            for near in (r - d, r + d):
                if 0 <= near < REGIMES and len(pool) < RECENT:
                    pool = pool + list(self.ratios[near])[-(RECENT - len(pool)):]
        if len(pool) < 5:
            return PRIOR_P50, PRIOR_P90
        f50 = _quantile(pool, 0.5)
        return f50, max(_quantile(pool, self.levels[r]), PRIOR_P90 * f50)

    def gate(self) -> dict[str, float | int | bool]:
        """The calibration over the window: ``within_p50_share``, ``p90_coverage``, ``jobs``, ``passed``."""
        if self._gate is None:
            self._gate = calibration((p50, p90, a) for _, p50, p90, a in self.jobs)
        return dict(self._gate)

    def estimate(self, raw_s: float, ahead: int, rate_rps: float | None) -> Estimate:
        f50, f90 = self.factors(ahead)
        return Estimate(raw_s * f50, raw_s * f90, not self.gate()["passed"], ahead, rate_rps)


def within(p50_s: float, actual_s: float) -> bool:
    """Whether a job finished within max(1 s, 50%) of the p50 it was told."""
    return abs(actual_s - p50_s) <= max(1.0, 0.5 * p50_s)


def calibration(jobs: Iterable[tuple[float, float, float]]) -> dict[str, float | int | bool]:
    """The gate's figures over ``(p50 told, p90 told, actual)`` triples (what ``bench e2e`` reports too)."""
    rows = list(jobs)
    n = len(rows)
    share = sum(within(p50, a) for p50, _, a in rows) / n if n else 0.0
    coverage = sum(a <= p90 for _, p90, a in rows) / n if n else 0.0
    passed = n >= MIN_JOBS and share >= WITHIN_GOAL and COVERAGE_GOAL[0] <= coverage <= COVERAGE_GOAL[1]
    return {"jobs": n, "within_p50_share": share, "p90_coverage": coverage, "passed": passed}


@dataclass
class Entry:
    """One accepted, unfinished job as the Proxy saw it at submit."""

    uid: str
    workflow: str
    priority: int
    seq: int
    accepted: float  # monotonic
    stage_s: tuple[float, ...]  # its seconds at each stage of its route
    raw_s: float = 0.0  # the raw model at submit
    ahead: int = 0  # jobs served before it at submit (its calibration regime)
    p50_s: float = 0.0  # what it was told at submit
    p90_s: float = 0.0
    cancelling: bool = False  # its cancel was asked: nobody waits for it (the stage drops it on reaching it)


class Book:
    """The jobs this Proxy accepted and has not seen end, in acceptance order (bounded by admission)."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self._seq = 0

    def add(self, uid: str, workflow: str, priority: int, now: float, stage_s: Sequence[float]) -> Entry:
        self._seq += 1
        entry = Entry(uid, workflow, int(priority), self._seq, now, tuple(stage_s))
        self.entries[uid] = entry
        return entry

    def end(self, uid: str) -> Entry | None:
        return self.entries.pop(uid, None)

    def cancelling(self, uid: str) -> None:
        """Its cancel was asked: it stays in the book (its own status keeps its estimate, and a job that ends
        completed anyway still calibrates) but no longer counts ahead of anyone or in the load."""
        if (e := self.entries.get(uid)) is not None:
            e.cancelling = True

    def keep(self, uids: set[str], before: float) -> int:
        """Drop entries accepted before ``before`` that are not in ``uids`` (the store's in-flight set, read
        after ``before``: their end was missed); how many."""
        gone = [u for u, e in self.entries.items() if u not in uids and e.accepted < before]
        for u in gone:
            del self.entries[u]
        return len(gone)

    def counts(self, workflow: str) -> dict[int, int]:
        """Unfinished jobs of ``workflow`` per priority level."""
        out = dict.fromkeys(order.NAMES, 0)
        # a snapshot: admission calls this off the event loop while the loop books and ends entries
        for e in list(self.entries.values()):
            if e.workflow == workflow and not e.cancelling:
                out[e.priority] = out.get(e.priority, 0) + 1
        return out

    def ahead(self, job: Entry, now: float, aging_s: float | None = None) -> int:
        """Unfinished jobs of ``job``'s workflow the stages serve before it (engine.dispatch.order's rule:
        higher effective priority first, then acceptance order; ages counted from acceptance)."""
        mine = order.effective(job.priority, now - job.accepted, aging_s)
        n = 0
        for e in list(self.entries.values()):
            if e.workflow != job.workflow or e.seq == job.seq or e.cancelling:
                continue
            theirs = order.effective(e.priority, now - e.accepted, aging_s)
            if theirs > mine or (e.seq < job.seq and theirs == mine):
                n += 1
        return n
