"""The etcd client over several endpoints, against a real 3-member etcd cluster on loopback.

One member is killed (SIGKILL); the client, given all three endpoints, keeps
reading, writing, creating, running transactions and refreshing a lease that
was granted through the dead member, and a Node Manager elected through the
dead member keeps its leadership (its lease keeps being refreshed elsewhere).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from etcd3gw import exceptions

from engine.coord import etcd_client
from engine.coord.client import FailoverClient, parse_endpoints
from engine.coord.keys import Keyspace
from engine.manager.election import Election, connect
from tests.deploy.etcdcluster import etcd_cluster

KEYS = Keyspace()  # the engine's etcd keys under the default root (/onepiece)


def test_parse_endpoints() -> None:
    assert parse_endpoints("http://a:2379") == ["http://a:2379"]
    assert parse_endpoints(" http://a:2379/, http://b:2379,,http://a:2379") == ["http://a:2379", "http://b:2379"]
    with pytest.raises(ValueError):
        parse_endpoints(" , ")


def test_unreachable_first_endpoint_is_skipped(etcd_server) -> None:  # type: ignore[no-untyped-def]
    c = etcd_client(f"http://127.0.0.1:1,{etcd_server.url}", timeout=2.0)
    c.put("/test/failover/skip", "v")
    assert c.get("/test/failover/skip") == [b"v"]
    assert c.url == etcd_server.url and c.failovers == 1
    c.delete("/test/failover/skip")


def test_every_endpoint_down_raises_promptly() -> None:
    c = etcd_client("http://127.0.0.1:1,http://127.0.0.1:2", timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(exceptions.ConnectionFailedError):
        c.get("/x")
    assert time.monotonic() - t0 < 2.0


def test_other_errors_are_not_failed_over(etcd_server) -> None:  # type: ignore[no-untyped-def]
    c = etcd_client(f"{etcd_server.url},http://127.0.0.1:1")
    lease = c.lease(2)
    lease.revoke()
    with pytest.raises(exceptions.Etcd3Exception):  # etcd's answer (lease not found), not an unreachable member
        lease.revoke()
    assert c.failovers == 0 and c.url == etcd_server.url


def test_cluster_member_loss(tmp_path: Path) -> None:
    with etcd_cluster(tmp_path, ["127.0.0.1"] * 3) as cluster:
        urls = cluster.urls
        assert len(urls.split(",")) == 3
        client = etcd_client(urls)
        assert isinstance(client, FailoverClient) and client.url == cluster.members[0].url

        # Leases, keys and an election, all made through member 0.
        lease = client.lease(3)
        client.put("/t/leased", "alive", lease=lease)
        assert client.create("/t/created", "once") is True
        assert client.create("/t/created", "twice") is False
        nm = Election(connect(urls), "nm-a", ttl=3).start()
        deadline = time.monotonic() + 10
        while not nm.is_leader and time.monotonic() < deadline:
            time.sleep(0.05)
        assert nm.is_leader
        token = nm.leadership.token  # type: ignore[union-attr]

        cluster.members[0].kill()
        assert not cluster.members[0].healthy()
        t0 = time.monotonic()
        assert client.get("/t/created") == [b"once"]
        took = time.monotonic() - t0
        print(f"first read after losing member 0 took {took * 1000:.0f} ms, now via {client.url}")
        assert client.url != cluster.members[0].url and client.failovers == 1
        assert took < 3.0

        # The lease granted through the dead member is refreshed through another, for longer than its TTL.
        for _ in range(6):
            assert lease.refresh() > 0
            time.sleep(1.0)
        assert client.get("/t/leased") == [b"alive"]
        assert lease.ttl() > 0 and b"/t/leased" in lease.keys()

        # Writes, prefix reads, transactions and deletes keep working with 2 of 3 members.
        client.put("/t/p/1", "a")
        client.put("/t/p/2", "b")
        assert sorted(v for v, _ in client.get_prefix("/t/p/")) == [b"a", b"b"]
        assert client.delete_prefix("/t/p/")
        assert client.get_prefix("/t/p/") == []

        # The leader elected through member 0 stays leader (its lease kept alive elsewhere),
        # and its fenced writes still pass etcd's check.
        assert nm.is_leader and nm.leadership.token == token  # type: ignore[union-attr]
        assert nm.fenced_put("/t/fenced", "ok") == token
        assert client.get("/t/fenced") == [b"ok"]

        # A second candidate sees the leader and cannot take over while it lives.
        other = Election(connect(urls), "nm-b", ttl=3)
        assert other.try_acquire() is None
        assert other.current_leader() == ("nm-a", token)

        # When the leader resigns, the lease is revoked through a live member: the key goes.
        nm.stop()
        assert client.get(KEYS.leader()) == []
        lease.revoke()
        assert client.get("/t/leased") == []
