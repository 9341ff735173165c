"""The embedded services are the real servers, reachable by their clients."""

from __future__ import annotations

import etcd3gw
import redis


def test_redis_fixture_is_a_real_server(redis_server) -> None:
    r = redis.Redis.from_url(redis_server.url)
    r.set("onepiece:test", b"x", ex=5)
    assert r.get("onepiece:test") == b"x"
    assert r.info("server")["redis_version"]


def test_etcd_fixture_is_a_real_server(etcd_server) -> None:
    host, port = etcd_server.url.removeprefix("http://").split(":")
    client = etcd3gw.client(host=host, port=int(port))
    lease = client.lease(ttl=5)
    assert client.create("/onepiece/test/once", "a", lease=lease) is True
    assert client.create("/onepiece/test/once", "b", lease=lease) is False
    lease.revoke()
    assert client.get("/onepiece/test/once") == []
