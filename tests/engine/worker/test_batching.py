"""A denoise instance serving requests in step-level batches (engine.worker.batching), through its real
inbox ring, job store and route to the next stage: each request's output equals its solo run, a request
cancelled mid-batch and one that fails leave the others untouched, nothing is lost or handed on twice."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from engine.coord import etcd_client
from engine.store import JobStore, keys
from engine.transport.ring import RingConfig, RingConsumer, attach_producer
from engine.worker.routes import Route, RouteTable, publish_route
from engine.worker.taskworker import TaskWorker, WorkerConfig
from engine.workflow import get_workflow
from engine.workflow import message as wm

pytestmark = pytest.mark.models
SPEC = get_workflow("sd-t2i")


def _params(prompt: str, steps: int, seed: int) -> dict[str, Any]:
    return SPEC.resolve_params({"prompt": prompt, "height": 64, "width": 64, "num_inference_steps": steps,
                                "seed": seed})


@pytest.fixture(scope="module")
def sd(tiny_models: dict[str, Path]) -> Any:
    from engine.stages.runner import LocalRunner

    return LocalRunner("sd-t2i", tiny_models["sd-t2i"], "cpu")


def test_batched_requests_equal_solo_runs_and_cancel_and_failure_stay_alone(
        sd: Any, redis_server: Any, etcd_server: Any) -> None:
    import torch

    from engine.stages.base import StageContext
    from engine.stages.components import to_torch

    tag = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
    inbox = RingConsumer.create(f"shm://test-{tag}-dn", RingConfig(slots=32, buffer_bytes=8 << 20))
    outbox = RingConsumer.create(f"shm://test-{tag}-vd", RingConfig(slots=32, buffer_bytes=8 << 20))
    producer = attach_producer(f"shm://test-{tag}-dn")
    etcd = etcd_client(etcd_server.url)
    root = f"/test-{tag}"
    from engine.coord.keys import Keyspace

    space = Keyspace(root)
    publish_route(etcd, Route("sd-t2i", "vae_decode", "sd-t2i.vae_decode.0", f"shm://test-{tag}-vd"), keys=space)
    store = JobStore.from_url(redis_server.url, ttl=60)
    denoise = sd.executors["denoise"]
    reqs = {uuid.uuid4().hex: _params(p, n, s) for p, n, s in
            (("a red boat", 6, 1), ("a green tree", 3, 2), ("a blue car", 8, 3), ("a grey cat", 4, 4))}
    uids = list(reqs)
    cancelled, broken = uids[2], uids[3]
    embeds = {u: sd.executors["text_encode"].run({}, p, StageContext()) for u, p in reqs.items()}
    # the broken request's embeddings have another width: its batch's step raises, then it fails alone
    embeds[broken] = {k: torch.cat([v, v], dim=-1) for k, v in embeds[broken].items()}
    solo = {u: denoise.run(embeds[u], reqs[u], StageContext())["denoised"] for u in uids[:2]}

    shared = []

    class CancelsMidway(type(denoise)):  # the client cancels one request after its second shared step
        def step(self, states: list[Any]) -> None:
            super().step(states)
            if len(states) >= 3:
                shared.append(len(states))
                if len(shared) == 2:
                    store.request_cancel(cancelled)

    denoise.__class__ = CancelsMidway
    cfg = WorkerConfig(instance="sd-t2i.denoise.0", workflow="sd-t2i", stage="denoise", model_dir="/",
                       address=f"shm://test-{tag}-dn", redis_url="", etcd_url=etcd_server.url, max_batch=4)
    worker = TaskWorker(cfg, store, RouteTable(etcd, keys=space), denoise, inbox)
    try:
        for u in uids:
            store.accept(u, "sd-t2i", 1.0)
            h = wm.Header(uid=u, workflow="sd-t2i", stage="denoise", route=SPEC.route(), params=reqs[u])
            producer.send(wm.encode(h, {k: wm.from_numpy(v.numpy()) for k, v in embeds[u].items()}))
        from engine.worker import batching

        batcher = batching.StepBatcher(worker, denoise, 4)
        worker.batcher = batcher
        deadline = time.monotonic() + 120

        def settled() -> bool:
            assert time.monotonic() < deadline, {u: store.state(u) for u in uids}
            return all(store.is_done(u, "denoise") or store.state(u) in keys.TERMINAL for u in uids)

        batcher.serve(settled)
        handed = {}
        while (d := outbox.recv(timeout=0.5)) is not None:
            msg = wm.decode(d.view)
            assert msg.header.uid not in handed, "handed on twice"
            handed[msg.header.uid] = to_torch(msg.tensors["denoised"]).clone()
            d.release()
        assert sorted(handed) == sorted(uids[:2])  # the two good ones, once each
        for u in uids[:2]:
            assert torch.equal(handed[u], solo[u]), "a batched request differs from its solo run"
        assert store.state(cancelled) == keys.CANCELLED
        st = store.status(broken)
        assert st is not None and st.state == keys.FAILED and st.detail.startswith("stage_failed: the denoise")
        assert len(shared) >= 2 and max(batcher.sizes) >= 3  # they really shared steps
        assert inbox.held == 0  # every input released
        finished = [e for u in uids[:2] for e in store.events(u) if e["type"] == keys.STAGE_FINISHED]
        assert all("batch=" in e["detail"] for e in finished), finished
    finally:
        denoise.__class__ = CancelsMidway.__mro__[1]
        producer.close()
        inbox.close()
        outbox.close()
        store.close()
