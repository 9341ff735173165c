"""Priorities inside a StepBatcher's active set (engine.worker.batching): a high request arriving into a
running batch of low ones steps in a group of its own while they pause, the paused ones resume and end with
the bytes of their solo runs, a paused one that waited past the aging bound steps again, and the set never
holds more than its cap."""

from __future__ import annotations

import types
from typing import Any

import pytest

from engine.dispatch import order
from engine.worker import batching
from engine.workflow import message as wm
from tests.engine.worker.rig import SPEC, BatcherHost

LOW, NORMAL, HIGH = order.LEVELS["low"], order.LEVELS["normal"], order.LEVELS["high"]


class _Delivery:
    """A ring delivery of an encoded message that records its release."""

    def __init__(self, uid: str, raw: bytes, released: list[str]) -> None:
        self.uid, self.view, self.released = uid, memoryview(raw), released

    def release(self) -> None:
        self.released.append(self.uid)


def _uid(name: str) -> str:
    return name.encode().hex().ljust(32, "0")


def _arrival(name: str, priority: int, params: dict[str, Any], released: list[str]) -> _Delivery:
    h = wm.Header(uid=_uid(name), workflow="sd-t2i", stage="denoise", route=SPEC.route(), priority=priority,
                  params=params)
    return _Delivery(name, wm.encode(h), released)


class _Host(BatcherHost):
    """The TaskWorker calls a StepBatcher makes: its inbox hands out ``arrivals`` one list per take, each
    request's values come from ``values`` (by UID), and what is handed on is recorded with its widest batch."""

    def __init__(self, values: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.values = values or {}
        self.arrivals: list[list[Any]] = []
        self.done: dict[str, Any] = {}
        self.widest: dict[str, int] = {}

    def recv_many(self, n: int, timeout: float) -> list[Any]:
        return self.arrivals.pop(0) if self.arrivals else []

    def values_of(self, msg: Any) -> dict[str, Any]:
        return self.values.get(msg.header.uid) or super().values_of(msg)

    def close_run(self, h: Any, run: Any, values: Any, out: Any, share_s: float = 0.0, widest: int = 1,
                  **kw: Any) -> None:
        self.done[h.uid] = out
        self.widest[h.uid] = widest


def _turn(batcher: Any) -> None:
    """One turn of the serving loop: take what the inbox holds, let joiners in, step."""
    batcher.take(0.0)
    batcher.admit_joiners()
    if batcher.active:
        batcher.step()


# -- real tiny SD denoise -----------------------------------------------------------------------------------

@pytest.mark.models
def test_a_high_arrival_steps_alone_and_the_paused_lows_equal_their_solo_runs(sd: Any) -> None:
    import torch

    from engine.stages.base import StageContext
    from engine.worker.batching import StepBatcher

    denoise = sd.executors["denoise"]
    names = [f"low{i}" for i in range(7)] + ["high"]
    reqs = {n: SPEC.resolve_params({"prompt": f"a boat number {i}", "height": 64, "width": 64,
                                    "num_inference_steps": 6 if n != "high" else 4, "seed": i})
            for i, n in enumerate(names)}
    embeds = {n: sd.executors["text_encode"].run({}, reqs[n], StageContext()) for n in names}
    solo = {n: denoise.run(embeds[n], reqs[n], StageContext())["denoised"] for n in names}
    host, released = _Host({_uid(n): dict(embeds[n]) for n in names}), []
    batcher = StepBatcher(host, denoise, 7)  # type: ignore[arg-type]
    host.arrivals = [[_arrival(n, LOW, reqs[n], released) for n in names[:7]]]
    _turn(batcher)
    _turn(batcher)  # the seven low ones share two steps
    host.arrivals = [[_arrival("high", HIGH, reqs["high"], released)]]
    while len(host.done) < len(names):
        _turn(batcher)
        assert len(batcher.active) <= batcher.max_held
    sizes = list(batcher.sizes)
    # the high one joined the full batch (beyond max_batch) and stepped its 4 steps alone; then the lows
    assert sizes == [7, 7, 1, 1, 1, 1, 7, 7, 7, 7], sizes
    assert host.widest[_uid("high")] == 1 and all(host.widest[_uid(n)] == 7 for n in names[:7])
    for n in names:
        assert torch.equal(host.done[_uid(n)]["denoised"], solo[n]), f"{n} differs from its solo run"
    assert sorted(released) == sorted(names)  # each released once


# -- a stage of plain numbers, on a clock the test moves --------------------------------------------------

class _Clock:
    """``time`` as the batcher sees it: ``monotonic`` is the test's, moved one second by each step."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.perf_counter = __import__("time").perf_counter

    def monotonic(self) -> float:
        return self.now


class _Steps:
    """A stepped stage of plain numbers (every request shares); each step takes a second of ``clock``."""

    def __init__(self, clock: _Clock) -> None:
        self.clock, self.batches = clock, []

    def batch_key(self, params: Any, options: Any = None) -> Any:
        return "all"

    def begin(self, inputs: Any, params: Any, options: Any = None) -> dict[str, Any]:
        return {"i": 0, "n": int(params["num_inference_steps"]), "uid": params["uid"], "x": 1}

    def step(self, states: list[dict[str, Any]]) -> None:
        self.batches.append([st["uid"] for st in states])
        self.clock.now += 1.0
        for st in states:
            st["i"] += 1
            st["x"] = st["x"] * 3 + len(st["uid"])

    def progress(self, state: dict[str, Any]) -> tuple[int, int]:
        return state["i"], state["n"]

    def end(self, state: dict[str, Any]) -> dict[str, Any]:
        return {"x": state["x"]}


def _want(uid: str, steps: int) -> int:
    x = 1
    for _ in range(steps):
        x = x * 3 + len(uid)
    return x


def _numbers(monkeypatch: pytest.MonkeyPatch, max_batch: int, **kw: Any) -> tuple[Any, _Host, _Steps]:
    from engine.worker.batching import StepBatcher

    clock = _Clock()
    monkeypatch.setattr(batching, "time", types.SimpleNamespace(monotonic=clock.monotonic,
                                                                perf_counter=clock.perf_counter))
    steps, host = _Steps(clock), _Host()
    return StepBatcher(host, steps, max_batch, **kw), host, steps  # type: ignore[arg-type]


def _job(name: str, priority: int, n: int, released: list[str]) -> _Delivery:
    return _arrival(name, priority, {"num_inference_steps": n, "uid": name}, released)


@pytest.mark.parametrize("aging_s", [3.5, 1000.0])
def test_a_paused_low_request_steps_again_once_it_waited_the_aging_bound(
        monkeypatch: pytest.MonkeyPatch, aging_s: float) -> None:
    """Two low requests pause for a long high one. With the bound at 3.5 s (of steps of one second) they
    step again, with the high one, after 4 paused steps; with a bound far off they wait for it to end."""
    monkeypatch.setattr(order, "AGING_S", aging_s)
    batcher, host, steps = _numbers(monkeypatch, 3)
    released: list[str] = []
    host.arrivals = [[_job("l0", LOW, 8, released), _job("l1", LOW, 8, released)]]
    _turn(batcher)  # the lows share a step
    host.arrivals = [[_job("hi", HIGH, 12, released)]]
    while batcher.active or batcher.waiting or host.arrivals:
        _turn(batcher)
    if aging_s < 100:  # paused at 1 s, aged at 4 s of waiting: the step after the fourth high one alone
        assert steps.batches[:6] == [["l0", "l1"]] + [["hi"]] * 4 + [["l0", "l1", "hi"]], steps.batches
        assert steps.batches[6:12] == [["l0", "l1", "hi"]] * 6 and steps.batches[12:] == [["hi"]]
    else:  # never aged: they resume when it ends
        assert steps.batches == [["l0", "l1"]] + [["hi"]] * 12 + [["l0", "l1"]] * 7, steps.batches
    assert host.done == {_uid(n): {"x": _want(n, s)} for n, s in (("l0", 8), ("l1", 8), ("hi", 12))}
    assert sorted(released) == ["hi", "l0", "l1"]


def test_the_active_set_holds_at_most_its_cap_and_each_level_steps_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """max_batch 2, cap 4: two lows run; a normal and a high join beyond max_batch, a second high (the set
    full) waits in line though its group has room. Each step runs one level's group; all end with their own
    results."""
    monkeypatch.setattr(order, "AGING_S", 1e6)
    batcher, host, steps = _numbers(monkeypatch, 2)
    assert batcher.max_held == 4
    released: list[str] = []
    host.arrivals = [[_job("l0", LOW, 3, released), _job("l1", LOW, 3, released)]]
    _turn(batcher)
    host.arrivals = [[_job("n0", NORMAL, 2, released)]]
    _turn(batcher)  # n0 joins the full batch and steps alone
    host.arrivals = [[_job("h0", HIGH, 2, released), _job("h1", HIGH, 2, released)]]
    _turn(batcher)
    assert len(batcher.active) == 4 and [w.msg.header.params["uid"] for w in batcher.waiting] == ["h1"]
    while batcher.active or batcher.waiting:
        _turn(batcher)
        assert len(batcher.active) <= 4
    # h1 would share h0's group but for the cap: it joins when h0 leaves; then n0 resumes, then the lows
    assert steps.batches == [["l0", "l1"], ["n0"], ["h0"], ["h0"], ["h1"], ["h1"], ["n0"],
                             ["l0", "l1"], ["l0", "l1"]], steps.batches
    want = {"l0": 3, "l1": 3, "n0": 2, "h0": 2, "h1": 2}
    assert host.done == {_uid(n): {"x": _want(n, s)} for n, s in want.items()}
    assert sorted(released) == sorted(want)


def test_a_high_arrival_fills_its_own_group_up_to_max_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three highs arrive into a full batch of two lows (max_batch 2, cap 6): two join beyond it and step
    together, the third waits for a place in their group, the lows pause until the highs are done."""
    monkeypatch.setattr(order, "AGING_S", 1e6)
    batcher, host, steps = _numbers(monkeypatch, 2, max_held=6)
    released: list[str] = []
    host.arrivals = [[_job("l0", LOW, 2, released), _job("l1", LOW, 2, released)]]
    _turn(batcher)
    host.arrivals = [[_job("h0", HIGH, 1, released), _job("h1", HIGH, 2, released),
                      _job("h2", HIGH, 1, released)]]
    while batcher.active or batcher.waiting or host.arrivals:
        _turn(batcher)
    assert steps.batches == [["l0", "l1"], ["h0", "h1"], ["h1", "h2"], ["l0", "l1"]], steps.batches
    assert len(host.done) == 5 and sorted(released) == ["h0", "h1", "h2", "l0", "l1"]


def test_one_that_must_step_alone_waits_until_it_is_the_oldest_of_its_level() -> None:
    """After a failed batch its requests step alone, one at a time; a request of the same level taken before
    them (a low one that aged to high while paused) does not wait for all of them, and steps at once."""
    def active(seq: int, priority: int, alone: bool, waited: float = 0.0) -> batching.Active:
        w = batching.Waiting(types.SimpleNamespace(), types.SimpleNamespace(header=types.SimpleNamespace(priority=priority)),
                             "k", seq=seq)
        return batching.Active(w, None, {}, None, 0.0, alone=alone, queued_s=waited)

    b = batching.StepBatcher(types.SimpleNamespace(), types.SimpleNamespace(), max_batch=4)
    aged = active(1, order.LEVELS["low"], alone=False, waited=order.AGING_S + 1)  # counts as high now
    failed = [active(s, order.HIGH, alone=True) for s in (2, 3)]
    later = active(4, order.HIGH, alone=False)
    b.active = [*failed, later, aged]
    assert b._group(0.0) == [aged, later]  # the oldest may share: the alone ones wait their turn
    b.active = [*failed, later]
    assert b._group(0.0) == [failed[0]]  # the oldest must step alone: it steps alone
