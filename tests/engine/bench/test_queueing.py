"""The simulation agrees with queueing facts, and with the allocator's predicted throughput."""

from __future__ import annotations

import pytest

from engine.bench.queueing import poisson_arrivals, simulate
from engine.manager.allocator import StageProfile, for_budget


def test_light_load_latency_is_the_sum_of_service_times() -> None:
    times = {"a": 0.1, "b": 0.5, "c": 0.2}
    r = simulate(list(times), {"a": 1, "b": 1, "c": 1}, lambda s, i: times[s], [i * 10.0 for i in range(50)])
    assert r.latency_p50 == pytest.approx(0.8)
    assert r.latency_p99 == pytest.approx(0.8)


def test_saturated_throughput_is_the_bottleneck_rate() -> None:
    times = {"enc": 0.2, "denoise": 3.0, "dec": 0.5}
    inst = {"enc": 1, "denoise": 4, "dec": 1}
    r = simulate(list(times), inst, lambda s, i: times[s], [0.0] * 400)  # all at once: saturated
    assert r.throughput == pytest.approx(4 / 3.0, rel=0.02)
    assert r.utilisation["denoise"] > 0.95 > r.utilisation["enc"]


def test_the_allocators_prediction_holds_in_simulation() -> None:
    profile = [StageProfile("text", 0.3), StageProfile("denoise", 5.0), StageProfile("decode", 1.1)]
    alloc = for_budget(profile, 40)
    times = {p.name: p.seconds for p in profile}
    r = simulate([p.name for p in profile], alloc.instances, lambda s, i: times[s], [0.0] * 2000)
    assert r.throughput == pytest.approx(alloc.throughput, rel=0.03)


def test_poisson_load_below_capacity_keeps_up() -> None:
    times = {"a": 1.0, "b": 2.0}
    arrivals = poisson_arrivals(rate=0.8, count=3000, seed=3)  # capacity 1/s with 1 + 2 instances
    r = simulate(["a", "b"], {"a": 1, "b": 2}, lambda s, i: times[s], arrivals)
    assert r.throughput == pytest.approx(0.8, rel=0.05)
    assert r.latency_p50 < 10.0


def test_a_stage_without_instances_is_refused() -> None:
    with pytest.raises(ValueError, match="no instances"):
        simulate(["a"], {"a": 0}, lambda s, i: 1.0, [0.0])
