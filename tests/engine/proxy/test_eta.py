"""The ETA estimator (engine.proxy.eta) without servers: the place in line, the raw model, the
calibration from history and the provisional gate; and the priority-aware admission's view of the load
(engine.proxy.intake.as_seen_by) against the Request Monitor."""

from __future__ import annotations

import random

from engine.dispatch import order
from engine.proxy import eta
from engine.proxy.intake import LOW_SHARE, as_seen_by
from engine.proxy.monitor import Load, RequestMonitor
from engine.workflow import get_workflow

LOW, NORMAL, HIGH = order.LEVELS["low"], order.LEVELS["normal"], order.LEVELS["high"]


def test_ahead_follows_the_stages_serving_order() -> None:
    book = eta.Book()
    low1 = book.add("a", "sd-t2i", LOW, 0.0, [1.0])
    normal = book.add("b", "sd-t2i", NORMAL, 1.0, [1.0])
    low2 = book.add("c", "sd-t2i", LOW, 2.0, [1.0])
    high = book.add("d", "sd-t2i", HIGH, 3.0, [1.0])
    book.add("e", "wan2.1-t2v", HIGH, 3.5, [1.0])  # another workflow's line is not this one's
    now = 4.0
    assert book.ahead(high, now) == 0  # served before every waiting lower one
    assert book.ahead(normal, now) == 1  # the high one
    assert book.ahead(low1, now) == 2  # high and normal passed it
    assert book.ahead(low2, now) == 3  # and the earlier low one
    # past the aging bound the first low job counts as high, accepted before everything: first in line
    late = low1.accepted + order.AGING_S + 0.1
    assert book.ahead(low1, late) == 0
    assert book.ahead(high, late) == 1
    assert book.counts("sd-t2i") == {LOW: 2, NORMAL: 1, HIGH: 1}
    book.end("a")
    assert book.ahead(low2, now) == 2


def test_keep_drops_only_missed_ends_read_after_their_acceptance() -> None:
    book = eta.Book()
    book.add("old", "sd-t2i", NORMAL, 0.0, [1.0])
    book.add("new", "sd-t2i", NORMAL, 5.0, [1.0])
    assert book.keep(set(), before=3.0) == 1  # "new" was accepted after the store was read: kept
    assert set(book.entries) == {"new"}


def test_remaining_work_reads_progress_within_the_running_stage() -> None:
    stages = [1.0, 2.0, 1.0]
    assert eta.remaining_work(stages, None, 0) == 4.0
    assert eta.remaining_work(stages, 1, 25) == 3.0  # stage 0 done (1 s), nothing of stage 1 yet
    assert eta.remaining_work(stages, 1, 50) == 2.0  # half of stage 1 done
    assert eta.remaining_work(stages, 2, 100) == 0.0


def test_raw_model_is_own_work_or_the_line_drained() -> None:
    assert eta.raw(2.0, 0, 1.0, 1.0) == 2.0
    assert eta.raw(2.0, 9, 2.0, 1.0) == 5.0  # ten jobs' turn at 2/s
    assert eta.raw(2.0, 9, None, 0.5) == 5.0  # no rate known: one job per slowest stage's time
    assert eta.raw(8.0, 1, 2.0, 1.0) == 8.0


def test_stage_seconds_scale_priors_to_the_measured_latency() -> None:
    spec = get_workflow("sd-t2i")
    params = spec.validate_request({"prompt": "x"}, {})
    out = eta.stage_seconds({}, spec, params, base_latency_s=2.0)
    assert len(out) == len(spec.route()) and abs(sum(out) - 2.0) < 1e-9


def test_calibration_from_history_and_the_gate() -> None:
    history = eta.History()
    first = history.estimate(2.0, 0, None)
    assert first.provisional and (first.eta_s, first.eta_p90_s) == (2.0 * eta.PRIOR_P50, 2.0 * eta.PRIOR_P90)
    rng = random.Random(1)
    # the engine takes 1.5x to 2.5x what the raw model says: the factors learn it, and the estimates they
    # give pass the gate once enough jobs finished
    for _ in range(eta.MIN_JOBS + 60):
        est = history.estimate(4.0, 0, None)
        history.record(4.0, est.eta_s, est.eta_p90_s, 4.0 * rng.uniform(1.5, 2.5))
    f50, f90 = history.factors()
    assert 1.8 < f50 < 2.2 and 2.2 < f90 < 2.5
    recent = eta.History()
    for r, p50, p90, a in list(history.jobs)[-60:]:
        recent.record(r, p50, p90, a)
    gate = recent.gate()
    assert gate["passed"], gate


def test_gate_fails_for_estimates_too_low_or_too_generous() -> None:
    low = eta.calibration([(1.0, 1.5, 5.0)] * 40)  # everything late
    assert not low["passed"] and low["within_p50_share"] == 0.0 and low["p90_coverage"] == 0.0
    generous = eta.calibration([(1.0, 100.0, 1.2)] * 40)  # within p50, but the p90 covers everything
    assert generous["within_p50_share"] == 1.0 and generous["p90_coverage"] == 1.0 and not generous["passed"]
    assert not eta.calibration([(1.0, 2.0, 1.0)] * (eta.MIN_JOBS - 1))["passed"]  # too few jobs


def test_estimate_header_and_fields() -> None:
    est = eta.Estimate(1.5, 3.25, True, 4, 2.0)
    assert est.header() == "p50=1.500; p90=3.250; provisional=1"
    assert est.as_dict() == {"eta_s": 1.5, "eta_p90_s": 3.25, "provisional": True, "queue_ahead": 4}


def test_low_is_refused_at_half_the_fill_that_admits_high() -> None:
    monitor = RequestMonitor(max_queue=64)
    load = Load(inflight=40, inflight_cost=40.0, instances=4, entry_instances=1)
    assert monitor.decide(as_seen_by(NORMAL, load), 1.0, 0.0, None).admit
    assert monitor.decide(as_seen_by(HIGH, load), 1.0, 0.0, None).admit
    refused = monitor.decide(as_seen_by(LOW, load), 1.0, 0.0, None)
    assert not refused.admit and "queue full" in refused.reason
    below = Load(inflight=int(64 * LOW_SHARE) - 1, inflight_cost=1.0, instances=4, entry_instances=1)
    assert monitor.decide(as_seen_by(LOW, below), 1.0, 0.0, None).admit


def test_high_with_a_deadline_is_admitted_where_low_fills_the_line() -> None:
    # 30 jobs in flight, 28 of them low, at 2 jobs/s: a normal request with a 10 s deadline would finish
    # after about 15.5 s and is refused; a high one is served before the low ones and is admitted
    monitor = RequestMonitor(max_queue=64)
    load = Load(inflight=30, inflight_cost=30.0, instances=4, entry_instances=1, drain_rps=2.0, base_latency_s=1.0)
    by_priority = {LOW: 28, NORMAL: 2, HIGH: 0}
    assert not monitor.decide(as_seen_by(NORMAL, load, by_priority), 1.0, 0.0, 10.0).admit
    assert monitor.decide(as_seen_by(HIGH, load, by_priority), 1.0, 0.0, 10.0).admit
    assert as_seen_by(HIGH, load, by_priority).inflight == 4  # never below the jobs being served


def _bench_replica(seed: int, stages: tuple[float, ...] = (0.02, 0.035, 0.015), sigma: float = 0.3,
                   hop_s: float = 0.004, seconds: float = 15.0) -> dict[str, list[tuple[int, float, float, float]]]:
    """``bench e2e``'s sequence on a simulated engine, told and judged through the Proxy's Book and History
    as engine.proxy.state does: 10 sequential jobs, a saturation run (16 in flight, closed loop), then Poisson
    arrivals at 0.5x and 1x the capacity. The engine: a FIFO server per stage, each job's time at a stage
    lognormal around its mean (what the estimator is told) plus a hop. Per phase: (ahead, p50, p90, actual)."""
    rng = random.Random(seed)
    capacity = 1.0 / (max(stages) + hop_s)
    book, history = eta.Book(), eta.History()
    free = [0.0] * len(stages)  # when each stage's server is next free
    line: list[tuple[float, str, str]] = []  # (finish, uid, phase): a FIFO tandem ends in acceptance order
    told: dict[str, list[tuple[int, float, float, float]]] = {}

    def finish_until(t: float) -> None:
        while line and line[0][0] <= t:
            end, uid, phase = line.pop(0)
            job = book.end(uid)
            assert job is not None
            history.record(job.raw_s, job.p50_s, job.p90_s, end - job.accepted, job.ahead)
            told.setdefault(phase, []).append((job.ahead, job.p50_s, job.p90_s, end - job.accepted))

    def submit(t: float, phase: str) -> None:
        job = book.add(f"{phase}-{len(book.entries)}-{t}", "sd-t2i", NORMAL, t, stages)
        ahead = book.ahead(job, t)
        job.raw_s = eta.raw(eta.remaining_work(stages, None, 0), ahead, capacity, max(stages))
        est = history.estimate(job.raw_s, ahead, capacity)
        job.p50_s, job.p90_s, job.ahead = est.eta_s, est.eta_p90_s, est.ahead
        done = t
        for i, s in enumerate(stages):
            done = free[i] = max(done, free[i]) + s * rng.lognormvariate(-sigma * sigma / 2, sigma) + hop_s
        line.append((done, job.uid, phase))

    t = 0.0
    for _ in range(10):
        submit(t, "sequential")
        t = line[-1][0]
        finish_until(t)
    start = t
    for _ in range(16):
        submit(t, "saturate")
    while t < start + seconds:
        t = line[0][0]
        finish_until(t)
        submit(t, "saturate")
    for load in (0.5, 1.0):
        finish_until(float("inf"))
        t = end = max(free) + 0.5
        end += seconds
        while (t := t + rng.expovariate(load * capacity)) < end:
            finish_until(t)
            submit(t, f"{load}x")
    finish_until(float("inf"))
    return told


def _coverage(rows: list[tuple[int, float, float, float]]) -> float:
    return sum(actual <= p90 for _, _, p90, actual in rows) / len(rows)


def test_p90_coverage_in_the_goal_band_on_a_quiet_and_on_a_busy_engine() -> None:
    # the regimes err differently: alone (nobody ahead) the raw model is the stage work and the ratio carries
    # the service's noise; in a line it is the line's drain, tight. One calibration for both (the saturation
    # run's tight ratios told to the quiet 0.5x run) covered 64% of the jobs that found the engine idle and
    # 77% of the 0.5x run's (and 97% of the 1x run's long-line jobs); per regime both land in the goal band
    runs = [_bench_replica(seed) for seed in range(4)]
    low, high = eta.COVERAGE_GOAL
    for phase in ("0.5x", "1.0x"):
        rows = [row for run in runs for row in run[phase]]
        assert len(rows) > 400
        assert low <= _coverage(rows) <= high, (phase, _coverage(rows))
        assert eta.calibration([(p50, p90, a) for _, p50, p90, a in rows])["within_p50_share"] >= eta.WITHIN_GOAL
        for run in runs:
            assert low - 0.05 <= _coverage(run[phase]) <= high + 0.02, (phase, _coverage(run[phase]))
    idle = [row for run in runs for row in run["0.5x"] if row[0] == 0]
    queued = [row for run in runs for row in run["1.0x"] if row[0] >= 8]
    assert len(idle) > 100 and len(queued) > 100
    assert low <= _coverage(idle) <= high and low <= _coverage(queued) <= high


def test_a_regime_without_history_borrows_its_neighbours_with_a_margin() -> None:
    history = eta.History()
    assert history.factors(3) == (eta.PRIOR_P50, eta.PRIOR_P90)
    for i in range(30):  # only idle jobs finished so far, 1.0x to 1.29x their raw model
        history.record(1.0, 1.0, 1.5, 1.0 + i / 100, ahead=0)
    f50, f90 = history.factors(0)
    assert 1.1 < f50 < 1.2 and 1.25 < f90 < 1.3
    b50, b90 = history.factors(12)  # a queued job: nothing of its own regime yet
    assert b50 == f50 and b90 >= eta.PRIOR_P90 * b50
    for _ in range(eta.MIN_REGIME):
        history.record(4.0, 4.0, 4.4, 3.6, ahead=12)
    assert history.factors(12) == (0.9, 0.9)  # its own ratios, once it has enough
    assert history.factors(0) == (f50, f90)  # and they do not move the idle regime's


def test_a_job_whose_cancel_was_asked_counts_ahead_of_nobody_but_keeps_its_entry() -> None:
    from engine.proxy.eta import Book

    book = Book()
    first, middle, last = (book.add(u, "sd-t2i", 0, 0.0, (0.1, 0.2)) for u in ("a", "b", "c"))
    assert book.ahead(last, 1.0) == 2 and book.counts("sd-t2i")[0] == 3
    book.cancelling("b")
    assert book.ahead(last, 1.0) == 1 and book.counts("sd-t2i")[0] == 2
    assert book.entries["b"] is middle and book.ahead(middle, 1.0) == 1  # its own estimate still has its place
    book.cancelling("unknown")  # another Proxy's job: nothing to mark
    assert book.end("b") is middle and "b" not in book.entries
