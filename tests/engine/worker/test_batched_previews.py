"""Live previews from a step-batching denoise instance (engine.worker.batching) through its real inbox ring,
job store and route: requests that share steps each get their own previews, in step order, each the
picture of its own latents."""

from __future__ import annotations

import os
import uuid
from typing import Any

import pytest

from engine.coord import etcd_client
from engine.store import JobStore, keys
from engine.transport.ring import RingConfig, RingConsumer, attach_producer
from engine.worker.routes import Route, RouteTable, publish_route
from engine.worker.taskworker import TaskWorker, WorkerConfig
from tests.engine.worker.test_batching import SPEC, _collect, _serve, sd  # noqa: F401  (sd: the fixture)

pytestmark = pytest.mark.models


def test_batched_requests_publish_their_own_previews(sd: Any, redis_server: Any, etcd_server: Any) -> None:  # noqa: F811
    from engine.coord.keys import Keyspace
    from engine.stages.base import StageContext
    from engine.stages.preview import plane

    tag = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
    inbox = RingConsumer.create(f"shm://test-{tag}-dn", RingConfig(slots=32, buffer_bytes=8 << 20))
    outbox = RingConsumer.create(f"shm://test-{tag}-vd", RingConfig(slots=32, buffer_bytes=8 << 20))
    producer = attach_producer(f"shm://test-{tag}-dn")
    etcd = etcd_client(etcd_server.url)
    space = Keyspace(f"/test-{tag}")
    publish_route(etcd, Route("sd-t2i", "vae_decode", "sd-t2i.vae_decode.0", f"shm://test-{tag}-vd"), keys=space)
    store = JobStore.from_url(redis_server.url, ttl=60)
    reqs = {uuid.uuid4().hex: SPEC.resolve_params({"prompt": p, "height": 64, "width": 64, "seed": s,
                                                   "num_inference_steps": n, "preview_every": 2})
            for p, n, s in (("a red boat", 6, 1), ("a green tree", 4, 2), ("a blue car", 6, 3))}
    embeds = {u: sd.executors["text_encode"].run({}, p, StageContext()) for u, p in reqs.items()}
    cfg = WorkerConfig(instance="sd-t2i.denoise.0", workflow="sd-t2i", stage="denoise", model_dir="/",
                       address=f"shm://test-{tag}-dn", redis_url="", etcd_url=etcd_server.url, max_batch=4)
    worker = TaskWorker(cfg, store, RouteTable(etcd, keys=space), sd.executors["denoise"], inbox)
    try:
        handed: dict[str, Any] = {}
        _serve(worker, store, producer, list(reqs), reqs, embeds)
        _collect(outbox, handed)
        worker.previews.close()  # every queued preview written
        finished = [e for u in reqs for e in store.events(u) if e["type"] == keys.STAGE_FINISHED]
        assert all("batch=3" in e["detail"] for e in finished), finished  # they did share steps
        renderer = worker.previews.renderer
        assert renderer is not None
        for u, p in reqs.items():
            n = p["num_inference_steps"]
            got = store.previews(u)
            assert [(x.stage, x.step, x.total) for x in got] == [("denoise", k, n) for k in range(2, n + 1, 2)]
            # the last preview is the picture of this request's own final latents, not a batch neighbour's
            assert got[-1].image == renderer.render(plane(handed[u]))
        assert len({store.latest_preview(u).image for u in reqs}) == len(reqs)
    finally:
        worker.close()
        producer.close()
        outbox.close()
        store.close()
