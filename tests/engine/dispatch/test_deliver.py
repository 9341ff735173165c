"""ResultDeliver policies pick from local knowledge only."""

from __future__ import annotations

import pytest

from engine.coord.routes import Route
from engine.dispatch.deliver import Outstanding, make_deliver

ROUTES = [Route("sd-t2i", "denoise", f"i{n}", f"shm://x{n}") for n in range(3)]


def _outstanding(unacked: dict[str, int]) -> Outstanding:
    return Outstanding(lambda inst: unacked.get(inst, 0))


def test_round_robin_cycles() -> None:
    d = make_deliver("round-robin", _outstanding({}))
    assert [d.choose(ROUTES, 1.0).instance for _ in range(4)] == ["i0", "i1", "i2", "i0"]


def test_least_outstanding_counts_only_unacknowledged_sends() -> None:
    unacked: dict[str, int] = {}
    out = _outstanding(unacked)
    d = make_deliver("least-outstanding", out)
    for inst, n in (("i0", 2), ("i1", 1)):
        for _ in range(n):
            out.sent(inst, 1.0)
        unacked[inst] = n
    assert d.choose(ROUTES, 1.0).instance == "i2"
    out.sent("i2", 1.0)
    unacked["i2"] = 1
    unacked["i0"] = 0  # i0's consumer released both
    assert d.choose(ROUTES, 1.0).instance == "i0"
    assert out.count("i0") == 0


def test_cost_aware_weighs_predicted_seconds() -> None:
    unacked: dict[str, int] = {}
    out = _outstanding(unacked)
    d = make_deliver("cost-aware", out)
    out.sent("i0", 100.0)  # one big request
    unacked["i0"] = 1
    for _ in range(3):  # three small ones
        out.sent("i1", 1.0)
    unacked["i1"] = 3
    out.sent("i2", 5.0)
    unacked["i2"] = 1
    assert d.choose(ROUTES, 1.0).instance == "i1"
    unacked["i0"] = 0
    assert d.choose(ROUTES, 1.0).instance == "i0"
    # the oldest sends are the acknowledged ones: i1 keeps its last two
    unacked["i1"] = 2
    assert out.cost("i1") == 2.0


def test_unknown_policy() -> None:
    with pytest.raises(ValueError, match="known: cost-aware, least-outstanding, round-robin"):
        make_deliver("random", _outstanding({}))
