"""Per-stage profile of the tiny workflows: load time, compute time, peak memory, bytes handed on.

    python benchmarks/stages_profile.py [--device cpu|cuda] [--repeats 5] [--workflow NAME]
                                        [--model-dir DIR]  (default: tiny models built in a temp dir)

Memory: on CUDA, ``torch.cuda.max_memory_allocated`` around each call (peak
allocated by the stage, after resetting the peak); on CPU, the peak of the
process's RSS sampled every 1 ms by a thread during the call, minus the RSS
just before it, in a separate pass after the timed runs (an RSS delta:
allocator caching makes repeated runs show less than a cold first run). Compute time is the median over ``--repeats`` requests
after one warm-up request. Bytes handed on = the whole Workflow Message the
stage sends to the next one (header + aligned payloads).
"""

from __future__ import annotations

import argparse
import io
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEFAULT_PARAMS: dict[str, dict[str, Any]] = {
    "wan2.1-i2v": {"prompt": "a cat walks on the beach", "height": 64, "width": 64, "num_frames": 9,
                   "num_inference_steps": 3},
    "wan2.1-t2v": {"prompt": "a cat walks on the beach", "height": 64, "width": 64, "num_frames": 9,
                   "num_inference_steps": 3},
    "sd-t2i": {"prompt": "a cat on the moon", "height": 64, "width": 64, "num_inference_steps": 3},
}


class PeakMemory:
    """Peak memory of a block: CUDA allocator peak, or sampled RSS delta on CPU."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.peak = 0

    def measure(self, fn: Callable[[], Any]) -> Any:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            out = fn()
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - base
            return out
        import psutil

        proc = psutil.Process()
        base = proc.memory_info().rss
        peak = [base]
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], proc.memory_info().rss)
                stop.wait(0.001)

        t = threading.Thread(target=sample, name="profile-rss", daemon=True)
        t.start()
        try:
            out = fn()
        finally:
            stop.set()
            t.join()
        self.peak = max(peak[0], proc.memory_info().rss) - base
        return out


def _png() -> bytes:
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.random.RandomState(0).rand(48, 64, 3) * 255).astype("uint8")).save(buf, format="PNG")
    return buf.getvalue()


def profile(workflow: str, model_dir: Path, device: str, repeats: int) -> list[dict[str, Any]]:
    from engine.stages.runner import LocalRunner
    from engine.workflow import get_workflow

    load_mem: dict[str, int] = {}

    def load_hook(stage: str, load: Callable[[], Any]) -> Any:
        pm = PeakMemory(device)
        ex = pm.measure(load)
        load_mem[stage] = pm.peak
        return ex

    runner = LocalRunner(workflow, model_dir, device, load_hook=load_hook)
    import psutil

    print(f"# {workflow}: process RSS with all its stages loaded: {psutil.Process().memory_info().rss / 2**20:.0f} MiB")
    run_mem: dict[str, list[int]] = {s: [] for s in runner.executors}
    # Memory is sampled in its own pass: the RSS sampler thread competes for
    # the CPU and the GIL and would inflate the timed runs.
    sampling = [False]
    for name, ex in runner.executors.items():
        original = ex.run

        def wrapped(inputs: Any, params: Any, ctx: Any, _o: Any = original, _n: str = name) -> Any:
            if not sampling[0]:
                return _sync(device, _o(inputs, params, ctx))
            pm = PeakMemory(device)
            out = pm.measure(lambda: _sync(device, _o(inputs, params, ctx)))
            run_mem[_n].append(pm.peak)
            return out

        ex.run = wrapped  # type: ignore[method-assign]
    params = get_workflow(workflow).resolve_params(DEFAULT_PARAMS[workflow])
    inputs = {"image": _png()} if get_workflow(workflow).request_inputs else {}
    runner.run(params, inputs)  # warm-up: first calls pay one-off kernel/alloc setup
    results = [runner.run(params, inputs) for _ in range(repeats)]
    sampling[0] = True
    runner.run(params, inputs)
    rows = []
    for name in runner.executors:
        rows.append({
            "workflow": workflow, "stage": name, "load_s": runner.load_s[name],
            "compute_s": statistics.median(r.stats[name].compute_s for r in results),
            "load_peak": load_mem[name], "run_peak": max(run_mem[name]),
            "out_bytes": results[0].stats[name].out_bytes, "payload_bytes": results[0].stats[name].payload_bytes,
        })
    return rows


def _sync(device: str, out: Any) -> Any:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
    return out


def _mib(n: int) -> str:
    return f"{n / 2**20:7.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--workflow", choices=sorted(DEFAULT_PARAMS), default=None)
    parser.add_argument("--model-dir", type=Path, default=None, help="folder with <workflow>/ sub-folders")
    args = parser.parse_args()

    t0 = time.perf_counter()
    import diffusers
    import torch
    import transformers

    import_s = time.perf_counter() - t0
    diffusers.utils.logging.disable_progress_bar()
    diffusers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    workflows = [args.workflow] if args.workflow else sorted(DEFAULT_PARAMS)
    with tempfile.TemporaryDirectory() as tmp:
        root = args.model_dir
        if root is None:
            from engine.stages.tiny import make_tiny

            root = Path(tmp)
            for w in workflows:
                make_tiny(root / w, w)
        rows = [row for w in workflows for row in profile(w, root / w, args.device, args.repeats)]

    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    mem = "CUDA max_memory_allocated delta" if args.device == "cuda" else "sampled RSS delta"
    print(f"# stage profile: device={args.device} ({gpu}), torch {torch.__version__}, "
          f"diffusers {diffusers.__version__}, threads {torch.get_num_threads()}, repeats {args.repeats}")
    print(f"# import torch+diffusers+transformers: {import_s:.2f} s (paid once per worker process)")
    for w in workflows:
        print(f"# {w} params: {DEFAULT_PARAMS[w]}")
    print(f"# peak memory: {mem}; compute: median; hands on: bytes of the message sent to the next stage")
    print()
    print("| workflow | stage | load ms | compute ms | load peak MiB | run peak MiB | hands on (bytes) | payload (bytes) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['workflow']} | {r['stage']} | {r['load_s'] * 1e3:.1f} | {r['compute_s'] * 1e3:.1f} | "
              f"{_mib(r['load_peak'])} | {_mib(r['run_peak'])} | {r['out_bytes']:,} | {r['payload_bytes']:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
