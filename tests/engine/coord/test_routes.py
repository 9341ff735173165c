"""Routes and assignments in a real etcd."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from engine.coord import etcd_client
from engine.coord.routes import Route, RouteTable, publish_route, withdraw_route
from engine.worker.config import Assignment, InstanceSpec, default_assignment


@pytest.fixture
def etcd(etcd_server: Any, etcd_root: str) -> Iterator[Any]:
    """A client of the session's etcd, the engine's keys under a root of this test's own."""
    yield etcd_client(etcd_server.url)


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


# -- watches: routes and capacities reach readers when they change, not by polling ---------------------------
def _ranges(etcd_url: str) -> float:
    """How many range reads the etcd member has served (its own counter, from its /metrics)."""
    import re
    import urllib.request
    from urllib.parse import urlparse

    u = urlparse(etcd_url)
    with urllib.request.urlopen(f"{u.scheme}://{u.hostname}:{u.port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return float(re.search(r"^etcd_mvcc_range_total (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]


def _until(what: str, check: Any, timeout: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def test_a_watched_table_takes_changes_from_the_watch_and_reads_nothing(tmp_path: Any) -> None:
    import json
    import threading

    from engine.coord.keys import Keyspace
    from engine.embedded import EtcdServer

    # an etcd of its own: the session's member serves other tests' tables too, whose reads it would count
    server = EtcdServer("etcd", tmp_path / "etcd").start()
    etcd, etcd_server = etcd_client(server.url), server
    # refresh_s is what it would poll at: 40 reads a second, if it polled
    table = RouteTable(etcd, refresh_s=0.05).start()
    try:
        _until("the table watches", lambda: table.watching)
        before = _ranges(etcd_server.url)
        for i in range(5):  # each change is seen, from its watch event
            publish_route(etcd, Route("sd-t2i", "denoise", f"sd-t2i.denoise.{i}", f"shm://{i}"))
            _until(f"route {i} seen", lambda n=i + 1: len(table.candidates("sd-t2i", "denoise")) == n)
        withdraw_route(etcd, Route("sd-t2i", "denoise", "sd-t2i.denoise.0", "shm://0"))  # a DELETE
        _until("the withdrawn route gone", lambda: len(table.candidates("sd-t2i", "denoise")) == 4)
        etcd.put(Keyspace.from_env().capacity("sd-t2i"), json.dumps({"rps": 7.5}))
        _until("the capacity seen", lambda: table.capacity("sd-t2i") == 7.5)
        etcd.put(Keyspace.from_env().capacity("sd-t2i"), "{not json")  # left out, as a read leaves it out
        _until("the malformed capacity dropped", lambda: table.capacity("sd-t2i") is None)
        threading.Event().wait(1.0)  # a second with nothing changing: a polling table would read 40 times
        # every change came with its watch event: the table read nothing (the slack: anything else in etcd)
        reads = _ranges(etcd_server.url) - before
        assert reads <= 2, reads
        assert table.watching
        assert [r.instance for r in table.candidates("sd-t2i", "denoise")] == [
            f"sd-t2i.denoise.{i}" for i in range(1, 5)]
    finally:
        table.stop()
        server.stop()


def test_a_broken_watch_falls_back_to_polling_with_a_warning_then_watches_again(
        tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from engine.embedded import EtcdServer

    server = EtcdServer("etcd", tmp_path / "etcd").start()
    client = etcd_client(server.url, timeout=1.0)
    # polls every 0.1 s while the watch is down; tries a watch again after 1 s of polling
    table = RouteTable(client, refresh_s=0.1, full_read_s=1.0).start()
    try:
        _until("the table watches", lambda: table.watching)
        with caplog.at_level(logging.WARNING, logger="engine.coord.routes"):
            server.stop()  # the watches' streams end with the member
            _until("the table stops watching", lambda: not table.watching)
            _until("a warning says it polls", lambda: "polling every 0.1s" in caplog.text)
            server.start()  # same ports, same data
            publish_route(client, Route("sd-t2i", "denoise", "x", "shm://x"))
            _until("the route seen after the restart", lambda: len(table.candidates("sd-t2i", "denoise")) == 1)
            _until("the table watches again", lambda: table.watching, timeout=20)
        publish_route(client, Route("sd-t2i", "denoise", "y", "shm://y"))
        _until("a change seen by the new watch", lambda: len(table.candidates("sd-t2i", "denoise")) == 2)
    finally:
        table.stop()
        server.stop()
