"""A denoise instance serving requests in step-level batches (engine.worker.batching), through its real
inbox ring, job store and route to the next stage: each request's output equals its solo run, a request
cancelled mid-batch and one that fails leave the others untouched, nothing is lost or handed on twice."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from engine.store import keys
from engine.workflow import message as wm
from tests.engine.worker.rig import SPEC, BatcherHost, DenoiseRig

pytestmark = pytest.mark.models


def _params(prompt: str, steps: int, seed: int) -> dict[str, Any]:
    return SPEC.resolve_params({"prompt": prompt, "height": 64, "width": 64, "num_inference_steps": steps,
                                "seed": seed})


def test_batched_requests_equal_solo_runs_and_cancel_and_failure_stay_alone(
        sd: Any, redis_server: Any, etcd_server: Any) -> None:
    """Phase 1: three requests share steps, one is cancelled mid-batch. Phase 2: a broken request breaks the
    batch it joins: it fails alone, its partner completes. Every good one equals its solo run."""
    import torch

    from engine.stages.base import StageContext

    rig = DenoiseRig(redis_server.url, etcd_server.url)
    store = rig.store
    denoise = sd.executors["denoise"]
    reqs = {uuid.uuid4().hex: _params(p, n, s) for p, n, s in
            (("a red boat", 6, 1), ("a green tree", 3, 2), ("a blue car", 8, 3), ("a grey cat", 4, 4),
             ("a pink hat", 5, 5))}
    uids = list(reqs)
    good, cancelled, broken = [uids[0], uids[1], uids[4]], uids[2], uids[3]
    embeds = {u: sd.executors["text_encode"].run({}, p, StageContext()) for u, p in reqs.items()}
    # the broken request's embeddings have another width: its batch's step raises, then it fails alone
    embeds[broken] = {k: torch.cat([v, v], dim=-1) for k, v in embeds[broken].items()}
    solo = {u: denoise.run(embeds[u], reqs[u], StageContext())["denoised"] for u in good}
    shared: list[int] = []

    class CancelsMidway(type(denoise)):  # the client cancels one request after its second shared step
        def step(self, states: list[Any]) -> None:
            super().step(states)
            if len(states) >= 3:
                shared.append(len(states))
                if len(shared) == 2:
                    store.request_cancel(cancelled)

    denoise.__class__ = CancelsMidway
    worker = rig.worker(denoise)
    try:
        handed: dict[str, Any] = {}
        for phase in ([uids[0], uids[1], cancelled], [broken, uids[4]]):
            rig.serve(worker, phase, reqs, embeds)
            rig.collect(handed)
        assert sorted(handed) == sorted(good)  # every good one, once
        for u in good:
            assert torch.equal(handed[u], solo[u]), "a batched request differs from its solo run"
        assert store.state(cancelled) == keys.CANCELLED and len(shared) >= 2
        st = store.status(broken)
        assert st is not None and st.state == keys.FAILED and st.detail.startswith("stage_failed: the denoise")
        assert rig.inbox.held == 0  # every input released
        finished = [e for u in uids[:2] for e in store.events(u) if e["type"] == keys.STAGE_FINISHED]
        assert all("batch=3" in e["detail"] for e in finished), finished
    finally:
        denoise.__class__ = CancelsMidway.__mro__[1]
        rig.close()


class _Steps:
    """A stepped stage of plain numbers that breaks only in a batch, after its second step (as running out
    of device memory at a batch size would): each request must still finish, alone, with its own result."""

    def __init__(self) -> None:
        self.calls: list[int] = []

    def batch_key(self, params: Any, options: Any = None) -> Any:
        return "all"

    def begin(self, inputs: Any, params: Any, options: Any = None) -> dict[str, int]:
        return {"i": 0, "n": int(params["num_inference_steps"]), "x": int(params["seed"])}

    def step(self, states: list[dict[str, int]]) -> None:
        self.calls.append(len(states))
        if len(states) > 1 and states[0]["i"] >= 2:
            raise MemoryError("out of memory at this batch size")
        for st in states:
            st["i"] += 1
            st["x"] = st["x"] * 3 + 1

    def progress(self, state: dict[str, int]) -> tuple[int, int]:
        return state["i"], state["n"]

    def end(self, state: dict[str, int]) -> dict[str, Any]:
        return {"x": state["x"]}


class _FakeWorker(BatcherHost):
    """The TaskWorker calls a StepBatcher makes, recorded: each handed-on result in ``done``."""

    def __init__(self) -> None:
        super().__init__()
        self.done: dict[str, int] = {}

    def close_run(self, h: Any, run: Any, values: Any, out: Any, *args: Any, **kw: Any) -> None:
        self.done[h.uid] = out["x"]


class _Delivery:
    """A ring delivery that records its release."""

    def __init__(self, uid: str, released: list[str]) -> None:
        self.uid, self.released = uid, released

    def release(self) -> None:
        self.released.append(self.uid)


def _waiting(batcher: Any, uid: str, steps: int, seed: int, released: list[str]) -> None:
    from engine.worker.batching import Waiting

    h = wm.Header(uid=uid, workflow="sd-t2i", stage="denoise", route=SPEC.route(),
                  params={"num_inference_steps": steps, "seed": seed})
    batcher.waiting.append(Waiting(_Delivery(uid, released), wm.Message(h, {}, {}), "all"))  # type: ignore[arg-type]


def test_a_step_that_fails_only_in_a_batch_does_not_loop() -> None:
    from engine.worker.batching import StepBatcher

    steps, worker, released = _Steps(), _FakeWorker(), []
    batcher = StepBatcher(worker, steps, 4)  # type: ignore[arg-type]
    want = {}
    for seed in range(3):
        _waiting(batcher, f"u{seed}", 5, seed, released)
        x = seed
        for _ in range(5):
            x = x * 3 + 1
        want[f"u{seed}"] = x
    for _ in range(200):
        if not batcher.active and not batcher.waiting:
            break
        batcher.admit_joiners()
        if batcher.active:
            batcher.step()
    # each finished once, with its own result, and released once
    assert worker.done == want and sorted(released) == ["u0", "u1", "u2"]
    assert steps.calls.count(3) == 3 and max(steps.calls[3:]) == 1  # after the failure, alone to the end


def test_a_stop_finishes_the_requests_stepping_and_leaves_the_rest_unreleased() -> None:
    """SIGTERM mid-batch: the requests already stepping are finished and handed on (as the plain path
    finishes the request at hand); one not begun stays unreleased, for the next incarnation."""
    from engine.worker.batching import StepBatcher

    steps, worker, released = _Steps(), _FakeWorker(), []
    batcher = StepBatcher(worker, steps, 2)  # type: ignore[arg-type]
    for seed in range(3):  # two share a batch; the third waits for room
        _waiting(batcher, f"u{seed}", 2 if seed else 4, seed, released)
    calls = iter([False, True])  # one turn of the loop, then SIGTERM
    batcher.serve(lambda: next(calls, True))
    assert sorted(worker.done) == ["u0", "u1"] and sorted(released) == ["u0", "u1"]  # finished, handed on, released
    assert [w.msg.header.uid for w in batcher.waiting] == ["u2"] and not batcher.active  # never begun: kept


class _PartSteps(_Steps):
    """A stepped stage whose steps are the last part of the run's (as a Wan2.2 low-noise expert's): its
    progress counts its own steps, its previews the whole run's (10 steps before it); a request with no step
    here (0 of them) ends at once."""

    def begin(self, inputs: Any, params: Any, options: Any = None) -> dict[str, int]:
        return {**super().begin(inputs, params, options), "before": 10}

    def step(self, states: list[dict[str, int]]) -> None:
        for st in states:
            st["i"] += 1

    def estimate(self, state: dict[str, int]) -> Any:
        return state["i"]

    def preview(self, state: dict[str, int]) -> tuple[int, int, Any]:
        return state["before"] + state["i"], state["before"] + state["n"], state["i"]


def test_the_batcher_reports_progress_by_the_stage_and_previews_by_the_stage_s_own_numbering() -> None:
    from engine.stages.base import StageContext
    from engine.worker.batching import StepBatcher
    from engine.worker.taskworker import Run

    steps, worker, released = _PartSteps(), _FakeWorker(), []
    seen: dict[str, dict[str, list[Any]]] = {}

    def open_run(h: Any) -> Run:
        got = seen.setdefault(h.uid, {"progress": [], "previews": []})
        ctx = StageContext(progress=lambda s, n: got["progress"].append((s, n)),
                           preview=lambda s, n, z: got["previews"].append((s, n, z)), preview_every=1)
        return Run({}, 0.0, 0.0, 1.0, ctx)

    worker.open_run = open_run  # type: ignore[method-assign]
    batcher = StepBatcher(worker, steps, 4)  # type: ignore[arg-type]
    _waiting(batcher, "three", 3, 1, released)
    _waiting(batcher, "none", 0, 2, released)  # no step of it here: no progress event, no preview
    for _ in range(20):
        if not batcher.active and not batcher.waiting:
            break
        batcher.admit_joiners()
        if batcher.active:
            batcher.step()
    assert sorted(worker.done) == ["none", "three"]
    assert seen["three"]["progress"] == [(1, 3), (2, 3), (3, 3)]
    assert seen["three"]["previews"] == [(11, 13, 1), (12, 13, 2), (13, 13, 3)]
    assert seen["none"] == {"progress": [], "previews": []}
