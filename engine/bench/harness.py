"""What ``onepiece bench e2e`` and its side benchmarks (variants, adapters, the streamed video) share: the small
request each workflow sends, the Proxy's credential, a blocking and an asyncio client of the Proxy, the one-call
pipeline baseline (loaded, called, its outputs encoded as the staged side encodes them) and the provenance's
load average after a run.

A module of its own so that those benchmarks import it rather than :mod:`engine.bench.e2e`, which imports them.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from engine.stages import caching

_IMAGE = {"prompt": "a cat on the moon", "height": 64, "width": 64, "seed": 1}
_VIDEO = {"prompt": "a cat on the moon", "height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2,
          "seed": 1}
#: workflow -> the small request ``bench e2e`` sends (the tiny models run it on a CPU; every entry is valid
#: for its tiny model's limits, tests/engine/bench/test_e2e_workflows.py): images 64x64, videos 32x32 with 5
#: frames and 2 steps; FLUX.1 and Qwen-Image at 8 steps, so that a ``--quality`` level predicts some of them
#: (its cache computes the first 3 in full)
PARAMS: dict[str, dict[str, Any]] = {
    "sd-t2i": {**_IMAGE, "num_inference_steps": 3},
    **{wf: {**_IMAGE, "num_inference_steps": 8} for wf in ("flux.1-schnell", "flux.1-dev", "qwen-image")},
    **{wf: dict(_VIDEO) for wf in ("wan2.1-t2v", "wan2.1-i2v", "wan2.2-ti2v-5b", "wan2.2-t2v-a14b",
                                   "wan2.2-i2v-a14b")}}
TERMINAL = ("completed", "failed", "cancelled", "expired")


def auth_headers() -> dict[str, str]:
    """Headers every call to the Proxy carries: its credential (``ONEPIECE_PROXY_TOKEN``)."""
    from engine import envs
    from engine.proxy.auth import auth_headers as bearer

    return bearer(envs.PROXY_TOKEN)


def _call(url: str, method: str = "GET", body: dict[str, Any] | None = None,
          timeout: float = 60) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {**auth_headers(), **({"Content-Type": "application/json"} if data else {})}
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status, ctype = r.read(), r.status, r.headers.get("Content-Type", "")
    except urllib.error.HTTPError as e:
        raw, status, ctype = e.read(), e.code, e.headers.get("Content-Type", "")
    return status, json.loads(raw) if ctype.startswith("application/json") else raw


def _encoded(inputs: dict[str, bytes] | None) -> dict[str, Any]:
    """The ``inputs`` field of a submission (base64 per input), or nothing."""
    import base64

    return {"inputs": {k: base64.b64encode(v).decode() for k, v in inputs.items()}} if inputs else {}


class Client:
    """Blocking client for the sequential latency figure."""

    def __init__(self, proxy: str) -> None:
        self.proxy = proxy.rstrip("/")

    def wait(self, uid: str, timeout: float = 300) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            left = min(30.0, max(0.0, deadline - time.monotonic()))
            status, doc = _call(f"{self.proxy}/v1/requests/{uid}?wait={left:.3f}", timeout=left + 30)
            state = doc.get("state") if isinstance(doc, dict) else None
            if state in TERMINAL:
                return state
            if status != 200:
                time.sleep(0.05)
        return "timeout"

    def run_one(self, workflow: str, params: dict[str, Any],
                inputs: dict[str, bytes] | None = None) -> tuple[str, float]:
        t0 = time.perf_counter()
        status, doc = _call(f"{self.proxy}/v1/requests?workflow={workflow}", "POST",
                            {"workflow": workflow, "params": params, **_encoded(inputs)})
        if status != 202:
            return f"rejected {status}", time.perf_counter() - t0
        state = self.wait(doc["uid"])
        if state == "completed":
            _call(f"{self.proxy}/v1/requests/{doc['uid']}/result")
        return state, time.perf_counter() - t0


def _cores() -> int:
    from engine.worker.threads import usable_cores

    return usable_cores()


def _load_pipeline(model_dir: str, device: str, image: bool = False,
                   cache: caching.CacheSettings | None = None) -> Any:
    """The one-call pipeline of the folder (``image``: one that takes the request's first frame: the Wan2.2 TI2V
    folder's is ``WanPipeline``, text only, and its image-to-video pipeline is ``WanImageToVideoPipeline`` over
    the same components, as the staged stages run it). ``cache``: the quality level's settings, applied with
    diffusers' own hook (``enable_cache``) to each transformer (the Wan2.2 A14B experts each keep their own
    state), the method the staged denoise runs per request."""
    import torch
    from diffusers import DiffusionPipeline

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cls: Any = DiffusionPipeline
    if image and json.loads((Path(model_dir) / "model_index.json").read_text())["_class_name"] == "WanPipeline":
        from diffusers import WanImageToVideoPipeline

        cls = WanImageToVideoPipeline
    pipe = cls.from_pretrained(model_dir, dtype=dtype).to(device)
    pipe.set_progress_bar_config(disable=True)
    if cache is not None:
        for name in ("transformer", "transformer_2"):
            if getattr(pipe, name, None) is not None:
                getattr(pipe, name).enable_cache(cache.config())
    return pipe


def encode_outputs(out: Any, fps: int = 16) -> list[bytes]:
    """What the staged side's last stage hands the client, made from a one-call pipeline's ``output_type="np"``
    output: a png per image (as ``sd``'s image_encode, from uint8 pixels) or an mp4 per video (as ``wan``'s
    video_encode, from uint8 frames), so that both sides of a comparison do the same work."""
    import numpy as np
    from PIL import Image

    def levels(x: Any) -> Any:
        return (np.clip(np.asarray(x), 0, 1) * 255).round().astype(np.uint8)

    if getattr(out, "frames", None) is not None:
        from engine.stages.wan.video import encode_mp4

        return [encode_mp4(levels(v), fps) for v in out.frames]
    pngs = []
    for img in out.images:
        buf = io.BytesIO()
        Image.fromarray(levels(img)).save(buf, format="PNG")
        pngs.append(buf.getvalue())
    return pngs


def pipeline_kwargs(params: dict[str, Any], inputs: dict[str, bytes] | None = None,
                    batch: int = 1) -> dict[str, Any]:
    """The one-call pipeline's keywords for a request: its params but the seed (the generator's), fps (the mp4's:
    :func:`encode_outputs` takes it) and the serving ones (``SERVING_PARAMS``: the quality level reaches the
    pipeline as diffusers' cache hook, :func:`_load_pipeline`, never as a keyword), its image decoded as the
    staged side decodes it. With ``batch`` > 1, the prompts as lists, one per request; the image stays one:
    diffusers' image-to-video pipelines take one image per call (a list is refused) and condition every item of
    the batch on it, encoding it once per generator, which is what ``batch`` requests of that image are."""
    from engine.workflow.options import SERVING_PARAMS

    kwargs = {k: v for k, v in params.items() if k not in {"seed", "fps", *SERVING_PARAMS}}
    if inputs and "image" in inputs:
        from engine.stages.components import decode_image

        kwargs["image"] = decode_image(inputs["image"])
    if batch > 1:
        for name in ("prompt", "negative_prompt"):
            if isinstance(kwargs.get(name), str):
                kwargs[name] = [kwargs[name]] * batch
    return kwargs


def _one_call(pipe: Any, params: dict[str, Any], device: str, batch: int = 1,
              inputs: dict[str, bytes] | None = None) -> list[bytes]:
    """One call of the pipeline (:func:`pipeline_kwargs`), its outputs encoded as the staged side encodes them
    (:func:`encode_outputs`, returned); with ``batch`` > 1, that many requests in one call (a prompt and a
    generator each, seeds ``seed``, ``seed + 1``, ...: what a batching monolith serves)."""
    import torch

    seed = params.get("seed", 0)
    if batch > 1:
        generator: Any = [torch.Generator(device="cpu").manual_seed(seed + i) for i in range(batch)]
    else:
        generator = torch.Generator(device="cpu").manual_seed(seed)
    out = pipe(generator=generator, output_type="np", **pipeline_kwargs(params, inputs, batch))
    if device == "cuda":
        torch.cuda.synchronize()
    return encode_outputs(out, int(params.get("fps", 16)))


class AsyncClient:
    def __init__(self, proxy: str, token: str | None = None) -> None:
        import aiohttp

        from engine.proxy.auth import auth_headers as bearer

        self.proxy = proxy.rstrip("/")
        # no connection cap: the offered load must not be limited by the client
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=None),
                                             headers=bearer(token) if token else auth_headers())

    async def close(self) -> None:
        await self.session.close()

    async def submit(self, workflow: str, params: dict[str, Any], deadline_s: float | None,
                     inputs: dict[str, bytes] | None = None, priority: str | None = None) -> tuple[int, dict[str, Any]]:
        body: dict[str, Any] = {"workflow": workflow, "params": params}
        if priority is not None:
            body["priority"] = priority
        body.update(_encoded(inputs))
        if deadline_s is not None:
            body["deadline_s"] = deadline_s
        # ?workflow= lets the Proxy refuse from its queue state before it reads the body
        async with self.session.post(self.proxy + "/v1/requests", params={"workflow": workflow}, json=body) as r:
            doc = await r.json(content_type=None)
            return r.status, doc if isinstance(doc, dict) else {}

    async def wait(self, uid: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            left = min(30.0, max(0.0, deadline - time.monotonic()))
            try:
                async with self.session.get(f"{self.proxy}/v1/requests/{uid}", params={"wait": f"{left:.3f}"}) as r:
                    doc = await r.json(content_type=None)
                    status = r.status
            except Exception:  # a dropped connection: ask again
                status, doc = 0, {}
            state = doc.get("state") if isinstance(doc, dict) else None
            if state in TERMINAL:
                return state
            if status != 200:
                await asyncio.sleep(0.05)
        return "timeout"


def write_result(result: dict[str, Any], before: dict[str, Any], out: Path) -> int:
    """A benchmark's end: ``result`` with its provenance (:func:`with_load_after` of ``before``) written as JSON
    to ``out`` (its folder made), where it went printed; the exit status 0."""
    result["provenance"] = with_load_after(before)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"written {out}")
    return 0


def with_load_after(before: dict[str, Any]) -> dict[str, Any]:
    """``figures.provenance()`` taken before a run, its load average renamed ``load_average_before`` and the
    load average now beside it as ``load_average_after``."""
    out = {k: v for k, v in before.items() if k != "load_average"}
    return {**out, "load_average_before": before["load_average"], "load_average_after": list(os.getloadavg())}
