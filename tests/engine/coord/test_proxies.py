"""Proxy registration's reader: which Proxy a client gets, from the Workflow Sets' state in a real etcd."""

from __future__ import annotations

import json
import uuid

import pytest

from engine.coord import etcd_client, proxies
from engine.coord.keys import Keyspace

WF = "sd-t2i"


def test_which_proxy_picks_the_least_loaded_set(etcd_server) -> None:
    client = etcd_client(etcd_server.url)
    root = f"/onepiece-test-{uuid.uuid4().hex[:6]}"
    state = {
        "A": {"proxies": ["http://a:1"], "workflows": {WF: {"capacity": 2.0, "arrival": 1.8}}},
        "B": {"proxies": ["http://b:1", "http://b:2"], "workflows": {WF: {"capacity": 1.0, "arrival": 0.2}}},
        "C": {"proxies": [], "workflows": {WF: {"capacity": 9.0, "arrival": 0.0}}},  # no Proxy: never chosen
    }
    client.put(Keyspace(root).sets_state(), json.dumps(state))
    try:
        assert proxies.which_proxy(client, WF, root, rng=lambda xs: xs[0]) == "http://b:1"
        assert proxies.which_proxy(client, None, root, rng=lambda xs: xs[-1]) == "http://b:2"  # any, for look-ups
        with pytest.raises(proxies.NoProxy, match="wan2.1-i2v"):
            proxies.which_proxy(client, "wan2.1-i2v", root)
    finally:
        client.delete_prefix(root + "/")
