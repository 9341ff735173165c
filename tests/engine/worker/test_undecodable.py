"""A worker that cannot decode a message fails its job with the reason (issue 16), instead of dropping it
and leaving the job queued for ever with its quota and in-flight place held."""

from __future__ import annotations

import uuid
from typing import Any

from engine.store import JobStore, keys
from engine.transport.ring import RingConsumer
from engine.workflow import message as wm
from tests.engine.worker.rig import PARAMS, ROUTE, image_encode_worker


def test_an_undecodable_message_fails_its_job_with_the_reason(redis_server: Any, etcd_server: Any,
                                                              ring: tuple[RingConsumer, Any]) -> None:
    consumer, producer = ring
    store = JobStore.from_url(redis_server.url, ttl=60)
    uid = uuid.uuid4().hex
    store.accept(uid, "sd-t2i", 1.0)
    # a header the codec refuses (as it refused the 1.1 MB prompt an older Proxy let through)
    header = wm.Header(uid=uid, workflow="sd-t2i", stage="image_encode", route=ROUTE, params=PARAMS,
                       priority="high")  # type: ignore[arg-type]
    producer.send(wm.encode(header))
    worker = image_encode_worker(store, consumer, etcd_server.url)
    d = consumer.recv(timeout=5)
    assert d is not None
    worker.handle(d)
    st = store.status(uid)
    assert st is not None and st.state == keys.FAILED, st
    assert "could not decode" in st.detail and "priority" in st.detail and st.stage == "image_encode"
    assert store.r.zscore(keys.inflight_key("sd-t2i"), uid) is None  # its admission place is free again
    assert consumer.recv(timeout=0.05) is None  # released
    producer.send(b"OPWM garbage without a uid")  # nothing to name: dropped, the worker carries on
    d = consumer.recv(timeout=5)
    assert d is not None
    worker.handle(d)
    assert consumer.held == 0
    store.close()
