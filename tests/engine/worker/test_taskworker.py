"""The TaskWorker core in-process: results written once, redeliveries dropped, inputs kept when the store is down."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from engine.store import JobStore, keys
from engine.transport.ring import RingConsumer
from engine.worker.stretch import StretchedExecutor, stretched
from tests.engine.worker.rig import image_encode_worker, pixels_message, send_pixels


def test_last_stage_writes_once_and_drops_redeliveries(redis_server: Any, etcd_server: Any,
                                                       ring: tuple[RingConsumer, Any]) -> None:
    consumer, producer = ring
    store = JobStore.from_url(redis_server.url, ttl=60)
    uid = uuid.uuid4().hex
    store.accept(uid, "sd-t2i", 1.0)
    worker = image_encode_worker(store, consumer, etcd_server.url)
    for _ in range(2):  # the second is what a restarted upstream worker would send again
        send_pixels(producer, uid)
        d = consumer.recv(timeout=5)
        assert d is not None
        worker.handle(d)
    assert consumer.recv(timeout=0.05) is None  # both inputs were released, nothing comes back
    assert store.result(uid) is not None and store.result(uid)[:8] == b"\x89PNG\r\n\x1a\n"
    types = [e["type"] for e in store.events(uid)]
    assert types.count(keys.COMPLETED) == 1 and types.count(keys.STAGE_STARTED) == 1
    # the last stage's time is on record too, before the terminal event (the ledger charges stage times)
    assert types == [keys.ACCEPTED, keys.STAGE_STARTED, keys.STAGE_FINISHED, keys.COMPLETED]
    assert store.is_done(uid, "image_encode")
    stats = store.instances.read("sd-t2i.image_encode.0")
    assert int(stats["requests"]) >= 1 and float(stats["busy_s"]) > 0
    store.close()


def test_a_stretched_stage_takes_its_floor_time(redis_server: Any, etcd_server: Any,
                                                ring: tuple[RingConsumer, Any]) -> None:
    """ONEPIECE_STAGE_TIME_S reaches the worker as stage_time_s: the stage occupies its instance that
    long, and the measured stage time the Node Manager reads includes it."""
    consumer, producer = ring
    store = JobStore.from_url(redis_server.url, ttl=60)
    uid = uuid.uuid4().hex
    worker = image_encode_worker(store, consumer, etcd_server.url, stage_time_s=0.3)
    store.r.delete(keys.instance_key("sd-t2i.image_encode.0"))
    uids = [uid, uuid.uuid4().hex]
    for u in uids:
        store.accept(u, "sd-t2i", 1.0)
        send_pixels(producer, u)
        d = consumer.recv(timeout=5)
        assert d is not None
        worker.handle(d)
        assert store.state(u) == keys.COMPLETED
        stats = store.instances.read("sd-t2i.image_encode.0")
        if u == uids[0]:  # a new process's first run (warm-up) is not offered as the stage's time
            assert "last_stage_s" not in stats and float(stats["busy_s"]) >= 0.3
    assert float(stats["last_stage_s"]) >= 0.3
    store.close()


def test_an_unreachable_store_keeps_the_input_for_the_next_incarnation(etcd_server: Any,
                                                                       ring: tuple[RingConsumer, Any]) -> None:
    consumer, producer = ring
    dead = JobStore.from_url("redis://127.0.0.1:1/0")
    worker = image_encode_worker(dead, consumer, etcd_server.url)
    send_pixels(producer, uuid.uuid4().hex)
    d = consumer.recv(timeout=5)
    assert d is not None
    with pytest.raises(Exception, match="(?i)connect"):
        worker.handle(d)  # the process would die here and its TaskManager restart it
    assert consumer.held == 1  # not released: a recovering consumer delivers it again
    d.release()
    dead.close()


def test_work_that_cannot_end_by_its_deadline_is_not_started(redis_server: Any, etcd_server: Any,
                                                             ring: tuple[RingConsumer, Any]) -> None:
    """A stage that took 0.6 s here (stretched, as a GPU stage would) for a request of this cost does not
    start one with 0.2 s left: expired at admission with the reason, the stage never runs. One with 30 s
    left runs; before any run nothing is expired for want of a measurement."""
    import time

    consumer, producer = ring
    store = JobStore.from_url(redis_server.url, ttl=60)
    worker = image_encode_worker(store, consumer, etcd_server.url, stage_time_s=0.6)
    try:
        uids = {None: uuid.uuid4().hex, 0.2: uuid.uuid4().hex, 30.0: uuid.uuid4().hex}
        for left, uid in uids.items():
            store.accept(uid, "sd-t2i", 1.0)
            deadline = time.time() + left if left is not None else None
            producer.send(pixels_message(uid, deadline=deadline))
            d = consumer.recv(timeout=5)
            assert d is not None
            worker.handle(d)
        first, doomed, fine = (store.status(uids[k]) for k in (None, 0.2, 30.0))
        assert first is not None and first.state == keys.COMPLETED
        assert doomed is not None and doomed.state == keys.EXPIRED and "cannot finish by its deadline" in doomed.detail
        assert keys.STAGE_STARTED not in [e["type"] for e in store.events(uids[0.2])]
        assert fine is not None and fine.state == keys.COMPLETED
    finally:
        store.close()


def test_stretching_is_a_wrapper_applied_only_when_configured() -> None:
    """Stretched stage times are a wrapper executor, not branches in the TaskWorker: off, the worker
    serves the executor itself; on, each run sleeps to its floor and each step its step time."""
    import time

    from engine.stages.base import StageContext, StageExecutor

    class Steps(StageExecutor):
        dtype_name = "float32"

        def load(self, model_dir: Any, device: str | None = None) -> None:
            self.model_dir = model_dir

        def run(self, inputs: Any, params: Any, ctx: StageContext) -> dict[str, Any]:
            for i in range(3):
                ctx.step_done(i + 1, 3)
            return {"out": 1}

    ex = Steps()
    assert stretched(ex) is ex and stretched(ex, 0.0, 1.0, 0.0) is ex
    wrapped = stretched(ex, floor_s=0.2)
    assert isinstance(wrapped, StretchedExecutor) and wrapped.dtype_name == "float32"
    t0 = time.perf_counter()
    assert wrapped.run({}, {}, StageContext()) == {"out": 1}
    assert time.perf_counter() - t0 >= 0.2
    seen: list[tuple[int, float]] = []
    t0 = time.perf_counter()
    stretched(ex, step_s=0.05).run({}, {}, StageContext(progress=lambda s, n: seen.append((s, time.perf_counter()))))
    assert [s for s, _ in seen] == [1, 2, 3] and seen[2][1] - seen[0][1] >= 0.1
    assert time.perf_counter() - t0 >= 0.15


class _Broken:
    """An image encoder that fails inside the stage the way a model bug does."""

    def run(self, values: Any, params: Any, ctx: Any) -> Any:
        raise RuntimeError("shape '[1, 1, 52, -1]' is invalid for input of size 128")


def test_a_stage_exception_reaches_the_client_as_stage_failed(redis_server: Any, etcd_server: Any,
                                                             ring: tuple[RingConsumer, Any]) -> None:
    consumer, producer = ring
    store = JobStore.from_url(redis_server.url, ttl=60)
    worker = image_encode_worker(store, consumer, etcd_server.url)
    for _ in range(3):  # runs after the first are sampled: the stage publishes its price fit
        good = uuid.uuid4().hex
        store.accept(good, "sd-t2i", 1.0)
        send_pixels(producer, good)
        worker.handle(consumer.recv(timeout=5))
    fit = store.instances.price_fits([("sd-t2i.image_encode.0", "sd-t2i")]).get(("sd-t2i.image_encode.0", "sd-t2i"))
    assert fit is not None and '"u_max": 64' in fit  # 8x8 pixels of work per run
    worker.executor = _Broken()
    uid = uuid.uuid4().hex
    store.accept(uid, "sd-t2i", 1.0)
    send_pixels(producer, uid)
    worker.handle(consumer.recv(timeout=5))
    st = store.status(uid)
    assert st is not None and st.state == keys.FAILED
    # the client's detail: a stable code, the stage, the kind of error; never the tensor shapes
    assert st.detail.startswith("stage_failed: the image_encode stage failed (RuntimeError)"), st.detail
    assert "shape" not in st.detail
    stopped = [e for e in store.events(uid) if e["type"] == keys.STAGE_STOPPED]
    assert stopped and "shape '[1, 1, 52, -1]'" in stopped[0]["detail"]  # the stage run (admin) has it
    store.close()
