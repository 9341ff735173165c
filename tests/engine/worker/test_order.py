"""Priorities at a stage (engine.dispatch.order): the TaskWorker serves what it holds highest priority first
through its real inbox ring and job store, a stop leaves the rest unreleased, aging bounds how long a low
one is passed over, and the StepBatcher lets a high-priority arrival ahead of waiting low ones."""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass
from typing import Any

import pytest

from engine.dispatch import order
from engine.store import JobStore, keys
from engine.transport.ring import RingConsumer
from engine.worker.taskworker import TaskWorker
from engine.workflow import message as wm
from tests.engine.worker.rig import SPEC, BatcherHost, image_encode_worker, pixels_message

LOW, NORMAL, HIGH = order.LEVELS["low"], order.LEVELS["normal"], order.LEVELS["high"]


def test_names_map_to_levels_and_nothing_else_does() -> None:
    assert [order.level(n) for n in ("low", "normal", "high")] == [-1, 0, 1]
    for bad in ("urgent", "HIGH", 1, None, True):
        with pytest.raises(ValueError, match="priority"):
            order.level(bad)
    assert order.name_of(1) == "high" and order.name_of(-5) == "low"


def test_the_proxy_intake_takes_the_names_only() -> None:
    from engine.proxy.intake import Intake
    from engine.proxy.parsing import BadRequest

    intake = Intake()
    assert intake.submission("sd-t2i", {"prompt": "a cat"}, {}).priority == 0  # normal by default
    assert intake.submission("sd-t2i", {"prompt": "a cat"}, {}, priority="low").priority == -1
    for bad in ("urgent", 1, None):
        with pytest.raises(BadRequest) as e:
            intake.submission("sd-t2i", {"prompt": "a cat"}, {}, priority=bad)
        assert e.value.field == "priority" and e.value.status == 400


@dataclass
class _Item:
    uid: int
    priority: int
    taken: float
    seq: int


def test_aging_bounds_how_long_a_later_arrival_may_pass_a_waiting_one() -> None:
    """A simulated stage under a steady overload of high-priority arrivals (two per service time) with low
    ones among them: every low one is served, and whenever a request taken later is served first, the one
    it passed had waited less than AGING_S (the stated bound), on a clock the test controls."""
    rng = random.Random(7)
    aging, service = 5.0, 1.0
    now, seq, held, served, line = 0.0, 0, [], [], order.Line()
    arrivals = sorted((rng.uniform(0, 200), rng.choice([LOW, HIGH, HIGH, NORMAL])) for _ in range(300))
    arrivals += [(0.0, LOW)]  # a low one waiting from the start, behind everything
    arrivals.sort()
    i = 0
    while i < len(arrivals) or held:
        while i < len(arrivals) and arrivals[i][0] <= now:
            held.append(_Item(seq, arrivals[i][1], arrivals[i][0], seq))
            line.add(held[-1])
            seq, i = seq + 1, i + 1
        if not held:
            now = arrivals[i][0]
            continue
        item = held.pop(order.pick(held, now, aging))
        assert line.pop(now, aging) is item  # the worker's O(1) line chooses as the whole-list rule does
        for other in held:  # everyone it passes that was taken before it waited less than the bound
            if other.seq < item.seq:
                assert now - other.taken < aging, (other, item, now)
        served.append(item)
        now += service
    assert len(served) == len(arrivals) and not len(line) and {s.priority for s in served} == {LOW, NORMAL, HIGH}
    # the ordering is real: some high one passed an earlier low one
    pos = {s.uid: k for k, s in enumerate(served)}
    assert any(a.priority == HIGH and b.priority == LOW and a.seq > b.seq and pos[a.uid] < pos[b.uid]
               for a in served for b in served)


# -- the TaskWorker, through its real ring and store ------------------------------------------------------

def _worker(store: JobStore, consumer: RingConsumer, etcd_url: str) -> TaskWorker:
    return image_encode_worker(store, consumer, etcd_url, instance="sd-t2i.image_encode.ord")


def _send(producer: Any, store: JobStore, priority: int) -> str:
    uid = uuid.uuid4().hex
    store.accept(uid, "sd-t2i", 1.0)
    producer.send(pixels_message(uid, priority))
    return uid


def _serve(worker: TaskWorker, until: int) -> list[str]:
    """Serve until ``until`` messages were handled; the order they were handled in."""
    handled: list[str] = []
    orig = worker.handle

    def handle(d: Any, msg: Any = None) -> None:
        handled.append(msg.header.uid)
        orig(d, msg)

    worker.handle = handle  # type: ignore[method-assign]
    worker.serve(lambda: len(handled) >= until)
    return handled


def test_the_worker_serves_higher_priority_first_and_a_stop_leaves_the_rest_unreleased(
        redis_server: Any, etcd_server: Any, ring: tuple[RingConsumer, Any]) -> None:
    consumer, producer = ring
    store = JobStore.from_url(redis_server.url, ttl=60)
    worker = _worker(store, consumer, etcd_server.url)
    sent = [(_send(producer, store, p), p) for p in (LOW, LOW, NORMAL, HIGH, LOW, HIGH, NORMAL)]
    by = {p: [u for u, q in sent if q == p] for p in (LOW, NORMAL, HIGH)}
    first = _serve(worker, 4)  # then a stop, with three still held
    assert first == by[HIGH] + by[NORMAL]  # highest first, ties in ring order
    for uid in first:
        assert store.status(uid).state == keys.COMPLETED
    for uid in by[LOW]:  # taken, never handled: still queued, and unreleased, so a recovering consumer
        assert store.status(uid).state == keys.QUEUED  # (the next incarnation) gets them again
    assert consumer.stats.released == 4  # the handled ones only
    store.close()


def test_a_message_that_waited_past_the_bound_is_served_as_high(
        redis_server: Any, etcd_server: Any, ring: tuple[RingConsumer, Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With the bound at 0 every held message has waited past it: all count as high and are served in the
    order taken, the low ones no longer passed by later high ones."""
    monkeypatch.setattr(order, "AGING_S", 0.0)
    consumer, producer = ring
    store = JobStore.from_url(redis_server.url, ttl=60)
    worker = _worker(store, consumer, etcd_server.url)
    sent = [_send(producer, store, p) for p in (LOW, HIGH, LOW, HIGH)]
    assert _serve(worker, 4) == sent
    store.close()


# -- the StepBatcher ----------------------------------------------------------------------------------



class _Steps:
    """A stepped stage of plain numbers (every request shares)."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def batch_key(self, params: Any, options: Any = None) -> Any:
        return "all"

    def begin(self, inputs: Any, params: Any, options: Any = None) -> dict[str, Any]:
        return {"i": 0, "n": int(params["num_inference_steps"]), "uid": params["uid"]}

    def step(self, states: list[dict[str, Any]]) -> None:
        self.batches.append([st["uid"] for st in states])
        for st in states:
            st["i"] += 1

    def progress(self, state: dict[str, Any]) -> tuple[int, int]:
        return state["i"], state["n"]

    def end(self, state: dict[str, Any]) -> dict[str, Any]:
        return {"x": state["uid"]}


class _Delivery:
    def __init__(self, uid: str, raw: bytes, released: list[str]) -> None:
        self.uid, self.view, self.released = uid, memoryview(raw), released

    def release(self) -> None:
        self.released.append(self.uid)


class _Worker(BatcherHost):
    """The TaskWorker calls a StepBatcher makes; its inbox hands out ``arrivals`` one list per take."""

    def __init__(self) -> None:
        super().__init__()
        self.done: list[str] = []
        self.arrivals: list[list[Any]] = []

    def recv_many(self, n: int, timeout: float) -> list[Any]:
        return self.arrivals.pop(0) if self.arrivals else []

    def close_run(self, h: Any, run: Any, values: Any, out: Any, *args: Any, **kw: Any) -> None:
        self.done.append(out["x"])


def _arrival(uid: str, priority: int, steps: int, released: list[str]) -> _Delivery:
    h = wm.Header(uid=uid.encode().hex().ljust(32, "0"), workflow="sd-t2i", stage="denoise", route=SPEC.route(), priority=priority,
                  params={"num_inference_steps": steps, "uid": uid})
    return _Delivery(uid, wm.encode(h), released)


def test_a_high_priority_arrival_takes_the_next_free_slot_before_waiting_low_ones() -> None:
    from engine.worker.batching import StepBatcher

    steps, worker, released = _Steps(), _Worker(), []
    batcher = StepBatcher(worker, steps, 2)  # type: ignore[arg-type]
    worker.arrivals = [[_arrival("low0", LOW, 1, released), _arrival("low1", LOW, 3, released),
                        _arrival("low2", LOW, 3, released), _arrival("low3", LOW, 3, released)]]
    batcher.take(0.0)
    batcher.admit_joiners()
    batcher.step()  # low0 and low1 share the first step; low0 is done, a slot is free
    worker.arrivals = [[_arrival("high", HIGH, 2, released)]]  # arrives behind two waiting low ones
    batcher.take(0.0)
    batcher.admit_joiners()
    batcher.step()
    assert steps.batches[:2] == [["low0", "low1"], ["high"]]  # low1 pauses while the high one steps
    while batcher.active or batcher.waiting:
        batcher.admit_joiners()
        batcher.step()
    assert worker.done == ["low0", "high", "low1", "low2", "low3"] and sorted(released) == sorted(worker.done)


def test_a_high_priority_arrival_does_not_wait_for_a_forming_batch_of_low_ones() -> None:
    """A batch of low ones waits (batch_wait) for more; a high one arriving starts it at once, itself first.
    The inbox refuses to be asked again after the high one came: the wait ended there."""
    from engine.worker.batching import StepBatcher

    steps, worker, released = _Steps(), _Worker(), []
    batcher = StepBatcher(worker, steps, 4, wait_s=3600.0)  # type: ignore[arg-type]
    # each take drains the inbox: a batch, then an empty answer
    worker.arrivals = [[_arrival("low0", LOW, 1, released)], [], [], [_arrival("high", HIGH, 1, released)], []]

    def recv_many(n: int, timeout: float) -> list[Any]:
        if not worker.arrivals:
            raise AssertionError("the forming batch kept waiting after a high-priority arrival")
        return worker.arrivals.pop(0)

    worker.recv_many = recv_many  # type: ignore[method-assign]
    batcher.take(0.0)
    batcher.admit_joiners()
    assert [a.w.msg.header.params["uid"] for a in batcher.active] == ["high", "low0"]
