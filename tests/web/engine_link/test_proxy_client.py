"""ProxyEngineClient against the real Proxy; the web API passes the engine's answers through."""

from __future__ import annotations

import os
import threading

import pytest

from engine.store import keys
from onepiece_platform.engine_link.client import EngineError, EngineRejected
from onepiece_platform.engine_link.proxy import ProxyEngineClient
from tests.fixtures.web import sd_body

pytestmark = pytest.mark.django_db
SD = sd_body()["params"]


def test_submit_status_cancel_result(proxy_url, store) -> None:
    c = ProxyEngineClient(proxy_url, timeout=5)
    acc = c.submit("sd-t2i", SD, {})
    assert len(acc.uid) == 32 and acc.cost_gpu_s > 0
    st = c.status(acc.uid)
    assert st is not None and (st.state, st.workflow) == ("queued", "sd-t2i")
    assert c.result(acc.uid) is None
    assert c.cancel(acc.uid) and store.cancel_requested(acc.uid)
    store.finish(acc.uid, "sd-t2i", keys.COMPLETED, "image_encode", result=b"png!")
    assert c.result(acc.uid) == b"png!" and c.cancel(acc.uid)  # cancel of a finished job: fine
    assert c.status("0" * 32) is None and not c.cancel("0" * 32)
    # a deleted result goes at once; a running job's cannot (it is yet to be written), an unknown one has none
    running = c.submit("sd-t2i", SD, {}).uid
    assert not c.drop_result(running) and not c.drop_result("0" * 32)
    assert c.drop_result(acc.uid) and c.result(acc.uid) is None and store.result(acc.uid) is None
    assert not c.drop_result(acc.uid)  # idempotent: nothing left to drop
    assert c.status(acc.uid) is not None and c.status(acc.uid).state == "completed"  # the job itself stays


def test_wait_is_the_proxys_long_poll_in_rounds_within_the_http_timeout(proxy_url, store) -> None:
    """EngineClient.wait answers when the job ends, not at its timeout, even past one HTTP timeout."""
    c = ProxyEngineClient(proxy_url, timeout=3)  # rounds of 1.5 s
    uid = c.submit("sd-t2i", SD, {}).uid
    st = c.wait(uid, 0.2)
    assert st is not None and st.state == "queued"  # not finished: the status at the timeout
    finisher = threading.Timer(4.0, store.finish, (uid, "sd-t2i", keys.COMPLETED, "image_encode"),
                               {"result": b"png!"})
    finisher.start()
    try:
        st = c.wait(uid, 60)
    finally:
        finisher.join()
    assert st is not None and st.state == "completed"
    assert c.wait("0" * 32, 5) is None


def test_invalid_is_400_with_field(proxy_url) -> None:
    with pytest.raises(EngineRejected) as e:
        ProxyEngineClient(proxy_url).submit("sd-t2i", {**SD, "height": 65}, {})
    assert (e.value.status, e.value.field) == (400, "height")


def test_unreachable_proxy_is_engine_error() -> None:
    from engine.embedded import free_port

    with pytest.raises(EngineError):
        ProxyEngineClient(f"http://127.0.0.1:{free_port('127.0.0.1')}", timeout=1).status("0" * 32)


def test_engine_capacity_503_passes_through_the_api(proxy_url, alice) -> None:
    _, c, _ = alice
    codes = [c.post("/api/v1/jobs", sd_body(seed=i), format="json") for i in range(3)]
    assert [r.status_code for r in codes] == [202, 202, 503]  # the Proxy's queue holds 2
    assert int(codes[2].headers["Retry-After"]) >= 1 and "queue full" in codes[2].json()["detail"]
    from onepiece_platform.jobs.models import Job
    from onepiece_platform.quotas import counters

    assert Job.objects.count() == 2 and counters.usage(alice[0].pk)[0] == 2  # the refused one released


_TOKEN = {"PROXY_TOKEN": os.environ["ONEPIECE_PROXY_TOKEN"]}


def test_engine_down_is_503_not_500(alice, settings) -> None:
    from engine.embedded import free_port

    settings.ONEPIECE = {"ENGINE_CLIENT": "onepiece_platform.engine_link.proxy.ProxyEngineClient",
                         "PROXY_URL": f"http://127.0.0.1:{free_port('127.0.0.1')}", "PROXY_TIMEOUT_S": 1, **_TOKEN}
    r = alice[1].post("/api/v1/jobs", sd_body(), format="json")
    assert r.status_code == 503 and r.headers["Retry-After"]


def test_proxy_discovery_sends_a_job_to_the_least_loaded_sets_proxy(proxy_url, etcd_server, alice,
                                                                    settings) -> None:
    """PROXY_URL = "etcd": the platform asks which Proxy to use (engine.coord.proxies.which_proxy): of two
    sets, the one whose arrival / capacity is lower; a set with no capacity for the workflow never."""
    import json

    from engine.coord import etcd_client
    from engine.coord.keys import Keyspace
    from engine.embedded import free_port

    etcd = etcd_client(etcd_server.url)
    dead = f"http://127.0.0.1:{free_port('127.0.0.1')}"  # the busier set's Proxy: never asked
    state = {"busy": {"proxies": [dead], "workflows": {"sd-t2i": {"capacity": 1.0, "arrival": 0.9}}},
             "idle": {"proxies": [proxy_url], "workflows": {"sd-t2i": {"capacity": 1.0, "arrival": 0.1}}}}
    etcd.put(Keyspace.from_env().sets_state(), json.dumps(state))  # the root of this test (proxy_url)
    settings.ETCD_URL = etcd_server.url
    settings.ONEPIECE = {"ENGINE_CLIENT": "onepiece_platform.engine_link.proxy.ProxyEngineClient",
                         "PROXY_URL": "etcd", **_TOKEN}
    r = alice[1].post("/api/v1/jobs", sd_body(), format="json")
    assert r.status_code == 202, r.json()
    c = ProxyEngineClient("etcd", timeout=5)
    for _ in range(6):  # a look-up tries the registered Proxies in turn: the dead one never fails it
        assert c.status(r.json()["uid"]) is not None
    state["idle"]["workflows"]["sd-t2i"]["capacity"] = 0.0  # now no set can take sd-t2i but the busy one
    etcd.put(Keyspace.from_env().sets_state(), json.dumps(state))  # the root of this test (proxy_url)
    with pytest.raises(EngineError, match="unreachable"):
        ProxyEngineClient("etcd", timeout=1).submit("sd-t2i", SD, {})
