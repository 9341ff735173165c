"""The allocator equals Theorem 1 on two stages and exhaustive search on longer chains."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.manager.allocator import AllocationError, StageProfile, for_budget, for_rate, theorem1, throughput


@pytest.mark.parametrize(("k", "t_x", "t_y"), [(1, 1.0, 3.0), (2, 0.5, 1.7), (4, 2.0, 2.0), (3, 0.2, 9.1), (5, 1.3, 1.31)])
def test_two_stages_match_theorem_1(k: int, t_x: float, t_y: float) -> None:
    stages = [StageProfile("x", t_x), StageProfile("y", t_y)]
    a = for_rate(stages, rate=k / t_x)
    assert a.instances == {"x": k, "y": theorem1(k, t_x, t_y)}
    assert a.instances["y"] == math.ceil(k * t_y / t_x - 1e-9)
    assert a.throughput >= k / t_x - 1e-9


def _best_by_search(stages: list[StageProfile], budget: int) -> float:
    best = 0.0
    ranges = [range(s.min_instances, (s.max_instances or budget) + 1) for s in stages]
    for combo in itertools.product(*ranges):
        if sum(combo) <= budget:
            best = max(best, throughput(stages, dict(zip([s.name for s in stages], combo, strict=True)))[0])
    return best


@settings(max_examples=150, deadline=None)
@given(
    times=st.lists(st.floats(0.05, 10.0), min_size=3, max_size=5),
    budget=st.integers(5, 12),
    caps=st.lists(st.one_of(st.none(), st.integers(1, 4)), min_size=5, max_size=5),
)
def test_budget_allocation_is_optimal_on_chains(times: list[float], budget: int, caps: list[int | None]) -> None:
    stages = [StageProfile(f"s{i}", t, 1, caps[i]) for i, t in enumerate(times)]
    if len(stages) > budget:
        return
    a = for_budget(stages, budget)
    best = _best_by_search(stages, budget)
    assert a.throughput == pytest.approx(best)
    # and it is within one instance per stage of an optimal allocation
    assert a.total + a.idle == budget


def test_wan_like_chain_puts_the_devices_on_denoise() -> None:
    stages = [StageProfile("text_encode", 0.2), StageProfile("image_encode", 0.1), StageProfile("vae_encode", 0.6),
              StageProfile("denoise", 30.0), StageProfile("vae_decode", 2.0)]
    a = for_budget(stages, 64)
    assert a.bottleneck == "denoise"
    assert a.instances["denoise"] >= 56
    assert a.instances["text_encode"] == 1


def test_bad_requests_are_typed_errors() -> None:
    with pytest.raises(AllocationError, match="below the per-stage minimums"):
        for_budget([StageProfile("a", 1.0, 2), StageProfile("b", 1.0, 2)], 3)
    with pytest.raises(ValueError, match="positive"):
        StageProfile("a", 0.0)
    capped = for_rate([StageProfile("a", 1.0, 1, 2)], rate=10)
    assert capped.instances == {"a": 2} and "capped" in capped.notes[0]
