"""Mixed-adapter batches in sd-t2i's stepped denoise: one UNet call per step for requests of different
adapters (PEFT's per-sample ``adapter_names``) against one call per adapter set, and both against the same
requests without adapters and with one adapter; interleaved rounds in one process, one thread.

    OMP_NUM_THREADS=1 python benchmarks/adapter_batches.py [--model DIR] [--requests 8] [--adapters 4]

Prints the median time of stepping the batch to its end in each mode and the ratios; every mode's outputs
are checked equal to the requests' solo runs first (the tests do so too: tests/engine/adapters/test_hot.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="sd-t2i model folder (default: a tiny one built here)")
    p.add_argument("--requests", type=int, default=6)  # 8 guided requests (16 rows) differ from solo: see adapters.md
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="onepiece-adapter-batches-"))
    os.environ["ONEPIECE_ADAPTER_STORE"] = str(tmp / "store")
    import torch

    torch.set_num_threads(1)
    from engine.adapters.registry import store
    from engine.adapters.tiny import make_tiny_lora
    from engine.stages.base import StageContext
    from engine.stages.runner import LocalRunner
    from engine.stages.tiny import make_tiny
    from engine.workflow.options import Options

    model = a.model or str(make_tiny(tmp / "models", "sd-t2i")["sd-t2i"])
    reg = store()
    for k in range(a.adapters):
        reg.add(f"b{k}", make_tiny_lora("sd-t2i", tmp / f"l{k}", k + 1, model_dir=model), "sd-t2i", model)
    r = LocalRunner("sd-t2i", model, "cpu")
    den = r.executors["denoise"]

    def requests(n_adapters: int) -> list:
        out = []
        for i in range(a.requests):
            params = {"prompt": f"a cat {i}", "height": 64, "width": 64, "num_inference_steps": a.steps, "seed": i}
            if n_adapters:
                params["lora"] = [{"name": f"b{i % n_adapters}", "scale": 1.0}]
            q, o = Options.split(r.spec.resolve_params(params))  # the model's parameters, the options (lora)
            out.append((r.executors["text_encode"].run({}, q, StageContext()), q, o))
        return out

    def drive(reqs: list) -> tuple[float, list]:
        states = [den.begin(e, q, o) for e, q, o in reqs]
        t0 = time.perf_counter()
        while any(den.progress(s)[0] < den.progress(s)[1] for s in states):
            den.step([s for s in states if den.progress(s)[0] < den.progress(s)[1]])
        return time.perf_counter() - t0, [den.end(s)["denoised"] for s in states]

    modes = {"no adapters": (0, True), "one adapter": (1, True),
             f"{a.adapters} adapters, one call per set": (a.adapters, False),
             f"{a.adapters} adapters, one call (mixed)": (a.adapters, True)}
    reqs = {m: requests(n) for m, (n, _mixed) in modes.items()}
    for m, (_n, mixed) in modes.items():  # equality first, and warm-up
        den.mixed_batches = mixed
        _t, outs = drive(reqs[m])
        solo = [den.run(e, q, StageContext(options=o))["denoised"] for e, q, o in reqs[m]]
        assert all(torch.equal(x, y) for x, y in zip(outs, solo, strict=True)), f"{m}: not the solo bytes"
    times: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(a.rounds):
        for m, (_n, mixed) in modes.items():
            den.mixed_batches = mixed
            times[m].append(drive(reqs[m])[0])
    med = {m: statistics.median(v) for m, v in times.items()}
    base = med["no adapters"]
    for m, t in med.items():
        print(f"{m:36s} {t * 1e3:7.0f} ms  {t / base:5.2f}x of no adapters")
    grouped, mixed = med[f"{a.adapters} adapters, one call per set"], med[f"{a.adapters} adapters, one call (mixed)"]
    print(f"mixed vs one call per set: {grouped / mixed:.2f}x faster ({a.requests} requests, {a.steps} steps, "
          f"load average {os.getloadavg()[0]:.1f})")
    den.hot.close()


if __name__ == "__main__":
    main()
