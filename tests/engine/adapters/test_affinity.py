"""Adapter affinity in the ResultDeliver policies (engine.dispatch.deliver): a request with adapters goes where
this sender sent them before, a new adapter where it evicts least, and affinity gives way when the warm
instance is busier than the policy's choice by more than the cost of a load. Pure: no Redis, no model."""

from __future__ import annotations

import pytest

from engine.coord.routes import Route
from engine.dispatch.deliver import Outstanding, make_deliver

ROUTES = [Route("sd-t2i", "denoise", f"i{n}", f"shm://x{n}") for n in range(2)]


def lora(*names: str) -> list[dict[str, object]]:
    return [{"name": n, "scale": 1.0, "digest": n * 8} for n in names]


@pytest.mark.parametrize("policy", ["round-robin", "least-outstanding", "cost-aware"])
def test_requests_follow_their_adapters(policy: str) -> None:
    unacked: dict[str, int] = {}
    out = Outstanding(lambda i: unacked.get(i, 0))
    d = make_deliver(policy, out)
    # every send is acknowledged at once (an idle pool): the policy alone would put all on i0 (or alternate)
    seen = [d.choose_for(ROUTES, 1.0, lora(n), "denoise").instance for n in ("a", "b", "a", "b", "a", "a", "b")]
    assert seen == ["i0", "i1", "i0", "i1", "i0", "i0", "i1"]
    assert d.choose_for(ROUTES, 1.0, lora("a", "b"), "denoise").instance in ("i0", "i1")
    # a request without adapters, or on its way to another stage, is the policy's alone
    if policy == "least-outstanding":
        assert d.choose_for(ROUTES, 1.0, (), "denoise").instance == "i0"
        assert d.choose_for(ROUTES, 1.0, lora("b"), "vae_decode").instance == "i0"


def test_affinity_gives_way_when_the_warm_instance_is_busier_than_a_load() -> None:
    unacked: dict[str, int] = {}
    out = Outstanding(lambda i: unacked.get(i, 0))
    d = make_deliver("least-outstanding", out)
    d.adapter_load_s = 2.5
    assert d.choose_for(ROUTES, 1.0, lora("a"), "denoise").instance == "i0"
    for n in range(1, 4):  # i0 has n requests outstanding (1 s each), i1 none
        out.sent("i0", 1.0)
        unacked["i0"] = n
        want = "i0" if n <= 2 else "i1"  # 2 s of wait beat a 2.5 s load; 3 s do not
        assert d.choose_for(ROUTES, 1.0, lora("a"), "denoise").instance == want, n
