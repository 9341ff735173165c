"""Routes and assignments in a real etcd."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from engine.coord import etcd_client
from engine.worker.config import Assignment, InstanceSpec, default_assignment
from engine.worker.routes import Route, RouteTable, publish_route, withdraw_route


@pytest.fixture
def etcd(etcd_server: Any) -> Iterator[Any]:
    client = etcd_client(etcd_server.url)
    client.delete_prefix("/onepiece/")
    yield client
    client.delete_prefix("/onepiece/")


def test_published_routes_are_read_and_withdrawn(etcd: Any) -> None:
    now = [0.0]
    table = RouteTable(etcd, refresh_s=1.0, clock=lambda: now[0])
    assert table.candidates("sd-t2i", "denoise") == []
    a = Route("sd-t2i", "denoise", "sd-t2i.denoise.1", "shm://b", "n1")
    b = Route("sd-t2i", "denoise", "sd-t2i.denoise.0", "shm://a", "n1")
    publish_route(etcd, a)
    publish_route(etcd, b)
    assert table.candidates("sd-t2i", "denoise") == []  # cached until the refresh interval passes
    now[0] = 2.0
    assert table.candidates("sd-t2i", "denoise") == [b, a]  # sorted by instance id
    assert table.candidates("sd-t2i", "vae_decode") == []
    withdraw_route(etcd, a)
    assert table.candidates("sd-t2i", "denoise", fresh=True) == [b]
    # a re-added instance (a new ring at the same address) is told apart by its generation
    b2 = Route(b.workflow, b.stage, b.instance, b.address, b.node, generation=2)
    publish_route(etcd, b2)
    got = table.candidates("sd-t2i", "denoise", fresh=True)
    assert got == [b2] and got[0].ring_id != b.ring_id


def test_routes_bound_to_a_lease_vanish_with_it(etcd: Any) -> None:
    lease = etcd.lease(5)
    publish_route(etcd, Route("sd-t2i", "denoise", "x", "shm://x"), lease)
    table = RouteTable(etcd)
    assert len(table.candidates("sd-t2i", "denoise", fresh=True)) == 1
    lease.revoke()
    assert table.candidates("sd-t2i", "denoise", fresh=True) == []


def test_unreachable_etcd_keeps_the_last_routes(etcd: Any) -> None:
    publish_route(etcd, Route("sd-t2i", "denoise", "x", "shm://x"))
    table = RouteTable(etcd, refresh_s=0.0)
    assert len(table.candidates("sd-t2i", "denoise")) == 1
    table.client = etcd_client("http://127.0.0.1:1", timeout=0.2)
    assert len(table.candidates("sd-t2i", "denoise")) == 1


def test_assignments_round_trip_and_validate() -> None:
    a = default_assignment({"sd-t2i": "/m/sd"}, device="cpu", step_delay_s=0.1)
    assert [i.stage for i in a.instances] == ["text_encode", "denoise", "vae_decode", "image_encode"]
    assert [i.step_delay_s for i in a.instances] == [0.0, 0.1, 0.0, 0.0]
    assert Assignment.from_json(a.to_json()) == a
    with pytest.raises(KeyError):
        InstanceSpec("x", "sd-t2i", "no-such-stage")
    with pytest.raises(ValueError, match="no model folder"):
        Assignment((InstanceSpec("x", "wan2.1-i2v", "denoise"),), {"sd-t2i": "/m"})
    with pytest.raises(ValueError, match="duplicate"):
        Assignment((InstanceSpec("x", "sd-t2i", "denoise"),) * 2, {"sd-t2i": "/m"})


def test_background_refresh_serves_reads_from_the_cache(etcd: Any) -> None:
    import time

    table = RouteTable(etcd, refresh_s=0.05).start()
    try:
        assert table.candidates("sd-t2i", "denoise") == []
        publish_route(etcd, Route("sd-t2i", "denoise", "x", "shm://x"))
        deadline = time.monotonic() + 5
        while not table.candidates("sd-t2i", "denoise"):
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        table.stop()
