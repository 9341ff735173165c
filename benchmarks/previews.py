"""Live previews' cost (issue 28 item 2): job time at ``preview_every=5`` against previews off, in the same
process and run (interleaved, median of ``--runs``: off, on with each encoding of ``--formats``, and on with
``--before``'s older publisher, in turn), one preview's pieces (the snapshot, the projection, each encoding),
and one preview's cost by each method (the linear projection fitted to the loaded VAE, the VAE at reduced
size), on the tiny models with one torch thread.

    git show f0d62a2:engine/stages/preview.py > preview_before.py
    OMP_NUM_THREADS=1 python benchmarks/previews.py --runs 9 --steps 20 \
        --workflows sd-t2i,flux.1-dev,qwen-image --before preview_before.py

``--models DIR`` measures the folders in DIR (``<workflow>/`` each, as ``onepiece models make-tiny --out DIR``
writes); without it, tiny models are built in a temporary folder first.

Previews go to a real redis-server (started here on a free port) through JobStore.preview.add, as a worker
writes them. Prints one line per workflow and a JSON summary; figures in benchmarks/previews.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
import uuid
from types import SimpleNamespace
from typing import Any

SHAPES = {  # a step of a realistic share of the job: the tiny models at larger shapes than their warm-up's
    "sd-t2i": {"height": 128, "width": 128},
    "flux.1-dev": {"height": 128, "width": 128},
    "qwen-image": {"height": 128, "width": 128},
    "wan2.1-t2v": {"height": 128, "width": 128, "num_frames": 17},
    "wan2.2-t2v-a14b": {"height": 128, "width": 128, "num_frames": 17},
}


def _job(runner: Any, params: dict[str, Any], store: Any, every: int) -> float:
    """Seconds from the job's start until its result and (with previews) its last preview are written."""
    uid = uuid.uuid4().hex
    for name, ex in runner.executors.items():
        ex._preview_uid = (uid, name)
    t0, c0 = time.perf_counter(), time.thread_time()
    runner.run({**params, "preview_every": every}, {}, progress=lambda *a: None)
    CPU["loop"] += time.thread_time() - c0
    want = params["num_inference_steps"] // every if every else 0
    seen, after = 0, "0-0"
    while seen < want:  # blocking reads of the job's preview stream: woken by each write
        got = store.preview.since(uid, after, block_ms=10_000)
        if not got:
            raise RuntimeError(f"{uid}: {seen} of {want} previews after 10 s")
        seen, after = seen + len(got), got[-1].id
    return time.perf_counter() - t0


#: CPU seconds: of the thread running the stages ("loop"), of the preview thread ("render": making the
#: pictures, "write": the store's preview.add), and of the loop inside the preview hook ("hook": what a
#: preview blocks it: the snapshot of the latents and the hand-over)
CPU = {"loop": 0.0, "render": 0.0, "write": 0.0, "hook": 0.0}


def _timed(fn: Any, key: str) -> Any:
    def timed(*a: Any, **k: Any) -> Any:
        c0 = time.thread_time()
        try:
            return fn(*a, **k)
        finally:
            CPU[key] += time.thread_time() - c0
    return timed


#: which publisher the stages use: "now" (engine.worker.previews) or "before" (--before's module)
ARM = {"publisher": "now"}


def _attach(runner: Any, store: Any, before: Any = None) -> list[Any]:
    """Each stage gets the worker's preview publisher, as TaskWorker.open_run attaches it (its rendering,
    writing and hook timed on their own threads' CPU clocks); with ``before`` (an older copy of the module)
    a second one of that version, used while ``ARM["publisher"]`` says "before"."""
    from engine.worker.previews import Previews

    pubs = []
    for ex in runner.executors.values():
        mine = {"now": Previews(_Store(store), ex)}
        if before is not None:
            mine["before"] = before.Previews(_Store(store), ex)
        for pub in mine.values():
            pub._render = _timed(pub._render, "render")
            pubs.append(pub)
        run = ex.run

        def attached(i: Any, p: Any, ctx: Any, _run: Any = run, _mine: Any = mine, _ex: Any = ex) -> Any:
            _mine[ARM["publisher"]].attach(ctx, *_ex._preview_uid, p)
            if ctx.preview is not None:  # the loop's share: the hook, its snapshot of the latents included
                ctx.preview = _timed(ctx.preview, "hook")
            return _run(i, p, ctx)

        ex.run = attached
    return pubs


def _use(pubs: list[Any], arm: str) -> None:
    """The stages use the publisher and encoding of ``arm`` (a format, or "before") from the next job on."""
    ARM["publisher"] = "before" if arm == "before" else "now"
    if arm == "before":
        return
    fmt, _, where = arm.partition("-")  # "jpeg-thread": the projection on the preview thread, not the loop
    for pub in pubs:
        pub.fmt = fmt
        if hasattr(pub, "project_on_loop"):
            pub.project_on_loop = where != "thread"
        if pub.renderer is not None:
            pub.renderer.fmt, pub.renderer.mime = fmt, FORMATS_MIME[fmt]


def _module(path: str) -> Any:
    """The preview module as it was, from a file (``git show REV:engine/stages/preview.py > FILE``)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("preview_before", path)
    assert spec is not None and spec.loader is not None
    module = sys.modules["preview_before"] = importlib.util.module_from_spec(spec)  # its dataclasses look it up
    spec.loader.exec_module(module)
    return module


FORMATS_MIME = {"jpeg": "image/jpeg", "png": "image/png"}


def _ms(fn: Any, n: int = 50) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(1000 * statistics.median(times), 3)


def _pieces(z: Any, grid: Any, r: Any) -> dict[str, Any]:
    """One linear preview's pieces, milliseconds (median of 50), from the loop's latents ``z``: the loop's
    snapshot; the uint8 projection as made now (one product on the packed tokens) and as it was (unpack,
    einsum, then the float ops to levels); each encoding of the resized picture; the whole picture."""
    from engine.stages.preview import encode, plane, snapshot, to_levels

    s = snapshot(z)
    px = r.projection.pixels(s, grid)
    side = max(px.shape[:2]) * r.projection.scale
    return {"snapshot": _ms(lambda: snapshot(z)), "project_to_uint8": _ms(lambda: r.projection.pixels(s, grid)),
            "unpack_einsum_levels_before": _ms(lambda: to_levels(r.projection.rgb(plane(s, grid)))),
            **{f"encode_{f}": _ms(lambda f=f: encode(px, side, f)) for f in FORMATS_MIME},
            **{f"bytes_{f}": len(encode(px, side, f)) for f in FORMATS_MIME},
            "picture_jpeg": _ms(lambda: r.picture(s, grid)), "grid": list(px.shape[:2]), "side": min(side, 256)}


class _Store:
    """The JobStore, its preview writes timed on the preview thread's CPU clock."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.preview = SimpleNamespace(add=_timed(store.preview.add, "write"))
        self.add_preview = self.preview.add  # what the --before publisher (an older module) calls


def _method_cost(runner: Any, params: dict[str, Any]) -> dict[str, Any]:
    """One preview's milliseconds by each method, on the denoise stage's own latents at this shape (those
    after its last step), and each method's one-time set-up (the fit; loading the VAE)."""
    from engine.stages.preview import Renderer, plane

    ex = next(e for e in runner.executors.values() if getattr(e, "preview_family", None))
    latents: list[Any] = []
    run = ex.run

    def keep(i: Any, p: Any, ctx: Any) -> Any:
        ctx.preview, ctx.preview_every = (lambda s, n, z: latents.append(z)), 1
        return run(i, p, ctx)

    ex.run = keep
    try:
        runner.run({**params, "preview_every": 0}, {}, progress=lambda *a: None)
    finally:
        ex.run = run
    grid = ex.preview_grid(params) if hasattr(ex, "preview_grid") else None
    z = plane(latents[-1], grid)
    out: dict[str, Any] = {}
    for method in ("linear", "vae"):
        r = Renderer(ex.model_dir, ex.preview_family, "cpu", method)
        t0 = time.perf_counter()
        r.ready(z.shape[1])
        setup = time.perf_counter() - t0
        times = []
        for _ in range(9):
            t0 = time.perf_counter()
            r.render(z)
            times.append(time.perf_counter() - t0)
        out[method] = {"setup_s": round(setup, 4), "per_preview_ms": round(1000 * statistics.median(times), 3)}
        if r.projection is not None:
            out[method]["fit_r2"] = round(r.projection.r2, 3)
            out[method]["pieces_ms"] = _pieces(latents[-1], grid, r)
    return out


def _measure(runner: Any, params: dict[str, Any], store: Any, args: Any, pubs: list[Any]) -> dict[str, Any]:
    """The interleaved runs: previews off, then on with each format, ``args.runs`` times; medians."""
    arms = ["off", *args.formats.split(","), *(["before"] if args.before else [])]
    wall: dict[str, list[float]] = {a: [] for a in arms}
    cpu: dict[str, list[float]] = {}
    for run in range(args.runs):
        for arm in arms[run % len(arms):] + arms[:run % len(arms)]:  # each arm in each position in turn
            CPU.update(loop=0.0, render=0.0, write=0.0, hook=0.0)
            if arm != "off":
                _use(pubs, arm)
            wall[arm].append(_job(runner, params, store, 0 if arm == "off" else args.every))
            for k, v in CPU.items():
                cpu.setdefault(f"{arm}_{k}", []).append(v)
    med = {k: statistics.median(v) for k, v in cpu.items()}
    n = args.steps // args.every
    row: dict[str, Any] = {"off_s": round(statistics.median(wall["off"]), 4)}
    for arm in arms[1:]:
        row[arm] = {
            "on_s": round(statistics.median(wall[arm]), 4),
            "ratio": round(statistics.median(wall[arm]) / statistics.median(wall["off"]), 4),
            # CPU: the job's loop-thread CPU with previews plus the preview thread's, over the loop's CPU
            # without: the added time if the preview thread had no core of its own (load-robust)
            "cpu_ratio": round((med[f"{arm}_loop"] + med[f"{arm}_render"] + med[f"{arm}_write"]) / med["off_loop"], 4),
            "hook_us_per_preview": round(1e6 * med[f"{arm}_hook"] / n, 1),
            "loop_added_ms_per_preview": round(1e3 * (med[f"{arm}_loop"] - med["off_loop"]) / n, 3),
            "render_cpu_ms_per_preview": round(1e3 * med[f"{arm}_render"] / n, 3),
            "write_cpu_ms_per_preview": round(1e3 * med[f"{arm}_write"] / n, 3),
        }
    return row


def main() -> None:
    with contextlib.ExitStack() as stack:
        _main(stack)


def _main(stack: contextlib.ExitStack) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=None, help="a folder of <workflow>/ model folders (default: tiny ones built here)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--workflows", default=",".join(SHAPES))
    ap.add_argument("--formats", default="jpeg,png", help="encodings to measure, each an arm of the A/B (FORMAT-thread: the picture projected on the preview "
                         "thread rather than the loop)")
    ap.add_argument("--before", default="", help="an older engine/stages/preview.py, measured as one more arm")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    from engine.embedded import RedisServer
    from engine.stages.runner import LocalRunner
    from engine.stages.tiny import models_or_tiny
    from engine.store import JobStore
    from engine.workflow import get_workflow

    wanted = args.workflows.split(",")
    models = stack.enter_context(models_or_tiny(args.models, wanted))
    server = RedisServer("redis-server", tempfile.mkdtemp(prefix="previews-bench-")).start()
    store = JobStore.from_url(server.url, ttl=60)
    summary = {}
    try:
        for wf in wanted:
            spec = get_workflow(wf)
            params = spec.resolve_params({**spec.warm_up_request()[0], **SHAPES[wf], "num_inference_steps": args.steps})
            runner = LocalRunner(wf, models / wf)
            methods = _method_cost(runner, params)
            pubs = _attach(runner, store, _module(args.before) if args.before else None)
            for arm in ("before", "now") if args.before else ("now",):  # warm: projections fitted, caches filled
                ARM["publisher"] = arm
                _job(runner, params, store, args.every)
            row = _measure(runner, params, store, args, pubs)
            for p in pubs:
                p.close()
            row.update(methods=methods, shape=SHAPES[wf], steps=args.steps, every=args.every)
            summary[wf] = row
            arms = "; ".join(f"{a}: ratio {row[a]['ratio']}, CPU {row[a]['cpu_ratio']}, hook "
                             f"{row[a]['hook_us_per_preview']} us, render {row[a]['render_cpu_ms_per_preview']} ms, "
                             f"write {row[a]['write_cpu_ms_per_preview']} ms"
                             for a in [*args.formats.split(","), *(["before"] if args.before else [])])
            print(f"{wf}: off {row['off_s']}s; {arms}; linear {methods['linear']['per_preview_ms']} ms/preview "
                  f"(pieces {methods['linear']['pieces_ms']}), vae {methods['vae']['per_preview_ms']} ms/preview",
                  flush=True)
    finally:
        store.close()
        server.stop()
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
