"""The worker's preview publisher (engine.worker.previews.Previews) on the tiny SD model and a real redis-server:
a preview is the picture of the latents at its step even when the loop writes them in place afterwards, and a
job whose previews pile up behind a busy thread keeps its latest ones, in step order, without costing another
job any. The thread is held inside its first store write by an event, so what is waiting is known."""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.stages.base import StageContext
from engine.stages.preview import plane, snapshot
from engine.store import JobStore
from engine.worker.previews import PER_JOB, Previews
from engine.workflow.options import Options


@dataclass
class _Denoise:
    """What the publisher reads of a denoise executor: its model folder and preview family."""

    model_dir: Path
    preview_family: str = "sd"


@pytest.fixture
def denoise(tiny_models: dict[str, Path]) -> _Denoise:
    """The tiny SD model the session built (the publisher fits its projection from that VAE)."""
    return _Denoise(tiny_models["sd-t2i"])


class _HeldStore:
    """The real job store, whose first preview write (``store.preview.add``) waits until the test releases it."""

    def __init__(self, store: JobStore) -> None:
        self.store, self.entered, self.release = store, threading.Event(), threading.Event()
        self.preview = self  # the publisher writes through ``store.preview.add``: this object's add

    def add(self, *args: Any) -> Any:
        if not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(60), "the test never released the preview thread"
        return self.store.preview.add(*args)


def _latents(seed: int) -> torch.Tensor:
    return torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(seed))


def _ctx(pub: Previews, uid: str) -> StageContext:
    ctx = StageContext(options=Options(preview_every=1))
    pub.attach(ctx, uid, "denoise", {})
    assert ctx.preview is not None
    return ctx


def test_a_preview_shows_the_latents_of_its_step_not_what_the_loop_writes_later(job_store: JobStore,
                                                                               denoise: _Denoise) -> None:
    """Both hand-overs: the first preview's snapshot (the thread has no fitted projection yet, and fits it,
    from the VAE on disk, before it reads the latents) and a later one's uint8 picture made on the loop."""
    held = _HeldStore(job_store)
    pub, uid = Previews(held, denoise), uuid.uuid4().hex
    ctx = _ctx(pub, uid)
    zs = [_latents(1), _latents(2)]
    at_step = [z.clone() for z in zs]
    try:
        ctx.step_done(1, 3, zs[0])
        zs[0].mul_(-3.0).add_(1.0)  # the next step writes the loop's tensor in place
        assert held.entered.wait(60)  # the thread is inside step 1's write: step 2 waits for it
        ctx.step_done(2, 3, zs[1])
        zs[1].mul_(-3.0).add_(1.0)
    finally:
        held.release.set()
        pub.close()
    got = job_store.preview.since(uid)
    assert [p.step for p in got] == [1, 2]
    renderer = pub.renderer
    assert renderer is not None
    for p, z, was in zip(got, zs, at_step, strict=True):
        assert p.image == renderer.render(plane(was)) != renderer.render(plane(z))
        assert p.mime == "image/jpeg"


def test_a_backlog_keeps_each_jobs_latest_previews_in_step_order(job_store: JobStore, denoise: _Denoise) -> None:
    held = _HeldStore(job_store)
    pub = Previews(held, denoise)
    a, b = uuid.uuid4().hex, uuid.uuid4().hex
    ctx_a, ctx_b = _ctx(pub, a), _ctx(pub, b)
    extra = 2
    n = 1 + PER_JOB + extra
    try:
        ctx_a.step_done(1, n, _latents(0))
        assert held.entered.wait(60)
        for step in range(2, n + 1):  # PER_JOB + extra previews of a wait: its oldest `extra` give way
            ctx_a.step_done(step, n, _latents(step))
        ctx_b.step_done(1, 2, _latents(100))
        ctx_b.step_done(2, 2, _latents(101))
    finally:
        held.release.set()
        pub.close()
    assert [p.step for p in job_store.preview.since(a)] == [1, *range(2 + extra, n + 1)]
    assert [p.step for p in job_store.preview.since(b)] == [1, 2]  # a's backlog cost b nothing
    assert pub.skipped == extra
    assert pub.waiting == {} and not pub.order


def test_all_jobs_together_keep_at_most_max_waiting_the_oldest_of_all_giving_way(
        job_store: JobStore, monkeypatch: pytest.MonkeyPatch, denoise: _Denoise) -> None:
    from engine.worker import previews

    monkeypatch.setattr(previews, "MAX_WAITING", 3)
    held = _HeldStore(job_store)
    pub = Previews(held, denoise)
    first, *jobs = (uuid.uuid4().hex for _ in range(6))
    try:
        _ctx(pub, first).step_done(1, 1, _latents(0))
        assert held.entered.wait(60)  # the thread is inside the first write: the rest wait
        for k, uid in enumerate(jobs):  # one preview each, five jobs: the two oldest give way
            _ctx(pub, uid).step_done(1, 1, _latents(k + 1))
            assert sum(len(q) for q in pub.waiting.values()) <= 3
    finally:
        held.release.set()
        pub.close()
    assert [len(job_store.preview.since(u)) for u in jobs] == [0, 0, 1, 1, 1]
    assert len(job_store.preview.since(first)) == 1 and pub.skipped == 2
    assert pub.waiting == {} and not pub.order


@pytest.mark.parametrize("shape,grid", [((2, 4, 5, 8, 6), None), ((2, 12, 16), (6, 8)), ((3, 4, 8, 8), None)])
def test_the_snapshot_is_a_copy_of_what_the_preview_draws(shape: tuple[int, ...], grid: Any) -> None:
    """SD (4-D), Wan / Qwen-Image (5-D: the middle frame) and FLUX / Qwen-Image packed tokens (3-D)."""
    z = torch.randn(*shape)
    s = snapshot(z)
    assert s.shape[0] == 1 and s.ndim == min(z.ndim, 4) and s.untyped_storage().data_ptr() != z.untyped_storage().data_ptr()
    assert torch.equal(plane(s, grid), plane(z, grid))


@pytest.mark.parametrize("shape,grid", [((1, 4, 6, 10), None), ((1, 15, 16), (6, 10))])
def test_the_uint8_projection_is_the_fitted_map_on_the_unpacked_latents(shape: tuple[int, ...], grid: Any) -> None:
    """The picture's levels, computed straight from the latents (packed tokens as they lie), are the fitted
    map's colours (rgb() on the unpacked plane) scaled to 0..255, to rounding."""
    from engine.stages.preview import Projection, to_levels

    g = torch.Generator().manual_seed(3)
    sol = torch.randn(3, 5, generator=g).t() / 2  # column-major, as lstsq's solution comes
    proj = Projection(sol[:4], sol[4], 1.0, 8)
    z = torch.randn(*shape, generator=g)
    got = proj.pixels(z, grid)
    want = to_levels(proj.rgb(plane(z, grid)))
    assert got.shape == want.shape and got.dtype == torch.uint8
    assert (got.int() - want.int()).abs().max() <= 1
    assert 0 < int((want == 0).sum() + (want == 255).sum()) < want.numel()  # the clamp was exercised
