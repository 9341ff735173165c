"""Shared set-ups of the TaskWorker tests: the torch-free image_encode worker and its messages, ticking a
TaskManager until a condition holds, a step-batching denoise instance's rings, route and store, and a
stand-in for the TaskWorker calls a StepBatcher makes."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from engine.coord import etcd_client
from engine.coord.keys import Keyspace
from engine.coord.routes import Route, RouteTable, publish_route
from engine.store import JobStore, keys
from engine.transport.ring import RingConfig, RingConsumer, attach_producer
from engine.worker.stretch import stretched
from engine.worker.taskworker import TaskWorker, WorkerConfig
from engine.workflow import get_workflow
from engine.workflow import message as wm
from engine.workflow.options import Options

SPEC = get_workflow("sd-t2i")
ROUTE = ["text_encode", "denoise", "vae_decode", "image_encode"]
PARAMS = {"prompt": "a cat", "negative_prompt": None, "height": 8, "width": 8, "num_inference_steps": 2,
          "guidance_scale": 7.5, "seed": 0}


def _tag() -> str:
    return f"{os.getpid()}-{uuid.uuid4().hex[:6]}"


@contextmanager
def inbox_ring(slots: int = 32) -> Iterator[tuple[RingConsumer, Any]]:
    """(a new inbox ring's consumer, a producer attached to it), both closed afterwards."""
    address = f"shm://test-{_tag()}-in"
    consumer = RingConsumer.create(address, RingConfig(slots=slots, buffer_bytes=1 << 20))
    producer = attach_producer(address)
    try:
        yield consumer, producer
    finally:
        producer.close()
        consumer.close()


# -- the last stage of sd-t2i, torch-free: pixels to a PNG -------------------------------------------------

def image_encode_worker(store: JobStore, consumer: RingConsumer, etcd_url: str,
                        instance: str = "sd-t2i.image_encode.0", **extra: Any) -> TaskWorker:
    """An image_encode TaskWorker on ``consumer``; ``extra`` goes into its WorkerConfig."""
    from engine.stages.sd.image import SDImageEncode

    cfg = WorkerConfig(instance=instance, workflow="sd-t2i", stage="image_encode", model_dir="/",
                       address="shm://unused", redis_url="", etcd_url=etcd_url, **extra)
    ex = SDImageEncode()
    ex.load("/")
    # as the worker process does (engine.worker.proc): stretched only when the config asks
    served = stretched(ex, cfg.stage_time_s, cfg.stage_stretch, cfg.step_delay_s)
    return TaskWorker(cfg, store, RouteTable(etcd_client(etcd_url)), served, consumer)


def pixels_message(uid: str, priority: int = 0, deadline: float | None = None) -> bytes:
    """An image_encode input: 8x8 pixels, encoded."""
    pixels = (np.arange(8 * 8 * 3) % 251).astype("uint8").reshape(1, 8, 8, 3)
    header = wm.Header(uid=uid, workflow="sd-t2i", stage="image_encode", route=ROUTE, params=PARAMS,
                       priority=priority, deadline=deadline)
    return wm.encode(header, {"pixels": wm.from_numpy(pixels)})


def send_pixels(producer: Any, uid: str) -> None:
    producer.send(pixels_message(uid))


def tick_until(tm: Any, cond: Callable[[], bool], timeout: float = 90, every: float = 0.1) -> None:
    """Tick the TaskManager ``tm`` until ``cond`` (a worker's ready file seen, its route published); fails
    naming each instance's process, readiness and restarts when ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, {i: (x.proc, x.ready, x.restarts) for i, x in tm.instances.items()}
        tm.tick()
        time.sleep(every)


# -- a step-batching denoise instance (sd-t2i by default) ------------------------------------------------

class DenoiseRig:
    """A denoise instance's inbox ring (with a producer), the vae_decode ring its results go to (published as
    the route, in a key space of its own) and the job store; :meth:`close` closes them and the worker.
    ``stage``: another stage that batches (text_encode), its results going to the stage after it."""

    def __init__(self, redis_url: str, etcd_url: str, workflow: str = "sd-t2i", stage: str = "denoise") -> None:
        tag = _tag()
        self.workflow, self.spec, self.stage = workflow, get_workflow(workflow), stage
        route = self.spec.route()
        after = route[route.index(stage) + 1]
        self.address, self.etcd_url = f"shm://test-{tag}-dn", etcd_url
        self.inbox = RingConsumer.create(self.address, RingConfig(slots=32, buffer_bytes=8 << 20))
        self.outbox = RingConsumer.create(f"shm://test-{tag}-vd", RingConfig(slots=32, buffer_bytes=8 << 20))
        self.producer = attach_producer(self.address)
        self.etcd = etcd_client(etcd_url)
        self.space = Keyspace(f"/test-{tag}")
        publish_route(self.etcd, Route(workflow, after, f"{workflow}.{after}.0", f"shm://test-{tag}-vd"),
                      keys=self.space)
        self.store = JobStore.from_url(redis_url, ttl=60)
        self._worker: TaskWorker | None = None

    def worker(self, denoise: Any, max_batch: int = 4) -> TaskWorker:
        """The denoise instance's TaskWorker on the inbox (closed by :meth:`close`, with the inbox)."""
        cfg = WorkerConfig(instance=f"{self.workflow}.{self.stage}.0", workflow=self.workflow, stage=self.stage, model_dir="/",
                           address=self.address, redis_url="", etcd_url=self.etcd_url, max_batch=max_batch)
        self._worker = TaskWorker(cfg, self.store, RouteTable(self.etcd, keys=self.space), denoise, self.inbox)
        return self._worker

    def serve(self, worker: TaskWorker, uids: list[str], reqs: dict[str, Any], embeds: dict[str, Any]) -> None:
        """Send these requests (``reqs``: their params as the spec resolved them) to the worker's inbox, each
        with its model parameters and its options apart as the Proxy sends them, and serve until each was
        handed on or ended."""
        store = self.store
        for u in uids:
            store.accept(u, self.workflow, 1.0)
            params, options = Options.split(reqs[u])
            h = wm.Header(uid=u, workflow=self.workflow, stage=self.stage, route=self.spec.route(), params=params,
                          options=options.to_json())
            self.producer.send(wm.encode(h, {k: wm.from_numpy(v.numpy()) for k, v in embeds[u].items()}))
        deadline = time.monotonic() + 120

        def settled() -> bool:
            assert time.monotonic() < deadline, {u: store.state(u) for u in uids}
            return all(store.is_done(u, self.stage) or store.state(u) in keys.TERMINAL for u in uids)

        worker.serve(settled)  # max_batch 4 and a stage that steps: the batching loop serves it
        assert worker.batcher is not None and not worker.batcher.active

    def collect(self, handed: dict[str, Any], output: str = "denoised") -> None:
        """What reached the next stage's ring (its ``output`` tensor), by UID (a UID handed on twice fails)."""
        from engine.stages.components import to_torch

        while (d := self.outbox.recv(timeout=0.5)) is not None:
            msg = wm.decode(d.view)
            assert msg.header.uid not in handed, "handed on twice"
            handed[msg.header.uid] = to_torch(msg.tensors[output]).clone()
            d.release()

    @contextmanager
    def cancels_midway(self, stage: Any, uid: str, width: int, after: int = 2) -> Iterator[list[int]]:
        """While inside, ``stage`` (the executor given to :meth:`worker`) cancels ``uid`` through the store
        once it has taken ``after`` steps of ``width`` requests; yields the list those steps are counted in."""
        shared: list[int] = []
        plain = type(stage)
        store = self.store

        class CancelsMidway(plain):  # type: ignore[misc, valid-type]
            def step(self, states: list[Any]) -> None:
                super().step(states)
                if len(states) == width:
                    shared.append(width)
                    if len(shared) == after:
                        store.request_cancel(uid)

        stage.__class__ = CancelsMidway
        try:
            yield shared
        finally:
            stage.__class__ = plain

    def close(self) -> None:
        self.producer.close()
        if self._worker is not None:
            self._worker.close()  # it closes its inbox: a ring consumer is closed once
        else:
            self.inbox.close()
        self.outbox.close()
        self.store.close()


class BatcherHost:
    """A StepBatcher's worker (engine.worker.batching.StageHost) with nothing behind it; a test records the
    handed-on results by overriding :meth:`close_run` and feeds the inbox by overriding :meth:`recv_many`."""

    spec = SPEC
    config = WorkerConfig(instance="i", workflow="sd-t2i", stage="denoise", model_dir="/", address="",
                          redis_url="", etcd_url="")

    def __init__(self) -> None:
        self.handled = 0

    def recv_many(self, n: int, timeout: float) -> list[Any]:
        return []  # an inbox that never holds anything new

    def receive(self, n: int, timeout: float) -> list[Any]:
        return self.recv_many(n, timeout)

    def undecodable(self, d: Any, exc: Exception) -> None:
        raise AssertionError(f"undecodable: {exc}")

    def admit(self, h: Any, start: bool = True) -> bool:
        return True

    def idle(self) -> None:
        pass

    def busy(self) -> None:
        pass

    def handled_one(self) -> None:
        self.handled += 1

    def open_run(self, h: Any) -> Any:
        from engine.stages.base import StageContext
        from engine.worker.taskworker import Run

        return Run({}, 0.0, 0.0, 1.0, StageContext())

    def values_of(self, msg: Any) -> dict[str, Any]:
        return {"prompt_embeds": None, "negative_prompt_embeds": None}

    def inputs_of(self, h: Any, values: dict[str, Any]) -> dict[str, Any]:
        return {k: values[k] for k in SPEC.stage("denoise").inputs}

    def close_run(self, h: Any, run: Any, values: Any, out: Any, *args: Any, **kw: Any) -> None:
        raise NotImplementedError

    def finish_run(self, h: Any, run: Any, values: Any, out: Any, share_s: float, batch: int,
                   wall_s: float) -> None:
        self.close_run(h, run, values, out, share_s, batch, wall_s=wall_s)

    def run_alone(self, h: Any, msg: Any) -> bool:
        raise AssertionError(f"{h.uid} ran alone")

    def stopped(self, h: Any, run: Any, exc: Exception) -> None:
        raise AssertionError(f"{h.uid} stopped: {exc}")

    def fail(self, h: Any, exc: Exception) -> bool:
        raise AssertionError(f"{h.uid} failed: {exc}")

    def errored(self, h: Any, exc: Exception) -> None:
        raise AssertionError(f"{h.uid} failed: {exc}")
