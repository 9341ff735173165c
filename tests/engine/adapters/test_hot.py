"""Hot adapters on sd-t2i's denoise: the staged output with adapters is byte-identical to diffusers' one-call
pipeline after ``load_lora_weights`` + ``set_adapters`` (one and two adapters, same seed, same threads);
requests with different adapter sets stepped together get their solo bytes; a request never waits for another
request's adapter load; the LRU keeps at most ``max_adapters`` loaded."""

from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.models

SD = dict(prompt="a cat on the moon", height=64, width=64, num_inference_steps=3, seed=5)


@pytest.fixture(scope="module")
def sd(tiny_models: dict[str, Path], adapters: Any) -> Any:
    from engine.stages.runner import LocalRunner

    runner = LocalRunner("sd-t2i", tiny_models["sd-t2i"], "cpu")
    yield runner
    if runner.executors["denoise"].hot is not None:
        runner.executors["denoise"].hot.close()


@pytest.fixture(scope="module")
def pipe(tiny_models: dict[str, Path]) -> Any:
    from diffusers import StableDiffusionPipeline

    return StableDiffusionPipeline.from_pretrained(tiny_models["sd-t2i"])


def _staged(sd: Any, lora: list[dict[str, Any]] | None, **over: Any) -> np.ndarray:
    from PIL import Image

    params = sd.spec.resolve_params({**SD, **over, **({"lora": lora} if lora else {})})
    out = sd.run(params, {})
    return np.asarray(Image.open(io.BytesIO(bytes(out.outputs["image"]))))


def _reference(pipe: Any, **over: Any) -> np.ndarray:
    import torch

    kw = {k: v for k, v in {**SD, **over}.items() if k != "seed"}
    seed = over.get("seed", SD["seed"])
    return np.asarray(pipe(generator=torch.Generator().manual_seed(seed), output_type="pil", **kw).images[0])


def test_staged_output_with_adapters_equals_the_one_call_pipeline(sd: Any, pipe: Any, adapters: Any) -> None:
    base = _reference(pipe)
    np.testing.assert_array_equal(_staged(sd, None), base)
    pipe.load_lora_weights(str(adapters.file(adapters.get("alpha"))), adapter_name="alpha")
    pipe.load_lora_weights(str(adapters.file(adapters.get("beta"))), adapter_name="beta")
    try:
        pipe.set_adapters(["alpha"], [0.8])
        one = _reference(pipe)
        pipe.set_adapters(["alpha", "beta"], [0.8, -0.5])
        two = _reference(pipe)
    finally:
        pipe.unload_lora_weights()
    assert not np.array_equal(one, base) and not np.array_equal(two, one)  # the adapters change the picture
    np.testing.assert_array_equal(_staged(sd, [{"name": "alpha", "scale": 0.8}]), one)
    np.testing.assert_array_equal(_staged(sd, [{"name": "alpha", "scale": 0.8}, {"name": "beta", "scale": -0.5}]),
                                  two)
    np.testing.assert_array_equal(_staged(sd, None), base)  # adapters loaded, none asked for: the base model
    assert set(sd.executors["denoise"].hot.names()) == {"alpha", "beta"}


def _drive(den: Any, states: dict[str, Any], until: str | None = None, limit: int = 200) -> dict[str, Any]:
    """Step the states together (as the batcher does) until every one is done, or ``until`` is."""
    out = {}
    for _ in range(limit):
        live = {k: s for k, s in states.items() if k not in out}
        if not live or (until is not None and until in out):
            break
        den.step(list(live.values()))
        for k, s in live.items():
            done, total = den.progress(s)
            if done == total:
                out[k] = den.end(s)["denoised"]
    return out


def _request(sd: Any, seed: int, prompt: str, lora: list[dict[str, Any]] | None) -> tuple[Any, Any, Any]:
    """(the text stage's embeddings, the model parameters, the options) of a request, as a worker has them."""
    from engine.stages.base import StageContext
    from engine.workflow.options import Options

    resolved = sd.spec.resolve_params({**SD, "seed": seed, "prompt": prompt, **({"lora": lora} if lora else {})})
    params, options = Options.split(resolved)
    return sd.executors["text_encode"].run({}, params, StageContext()), params, options


@pytest.mark.parametrize("with_pair", [False, True], ids=["one-call", "one-call-per-set"])
def test_mixed_adapter_sets_stepped_together_equal_their_solo_runs(sd: Any, with_pair: bool) -> None:
    """Single adapters (one scale each) and none share one UNet call per step (PEFT's per-sample
    adapter_names); a request with two adapters makes the step one call per adapter set. Both: solo bytes."""
    import torch

    from engine.stages.base import StageContext

    den = sd.executors["denoise"]
    specs = {"a1": (1, "a red boat", [{"name": "alpha", "scale": 0.8}]),
             "a2": (2, "a tree", [{"name": "alpha", "scale": 0.8}]),
             "b": (3, "a car", [{"name": "beta", "scale": 1.0}]),
             "none": (5, "a dog", None)}
    if with_pair:
        specs["ab"] = (4, "a hat", [{"name": "beta", "scale": 1.0}, {"name": "alpha", "scale": 0.3}])
    reqs = {k: _request(sd, *v) for k, v in specs.items()}
    assert len({den.batch_key(p, o) for _e, p, o in reqs.values()}) == 1  # they share a batch
    solo = {k: den.run(e, p, StageContext(options=o))["denoised"] for k, (e, p, o) in reqs.items()}
    calls = []
    hook = den.pipe.unet.register_forward_pre_hook(lambda m, a: calls.append(len(a[0])))
    try:
        together = _drive(den, {k: den.begin(e, p, o) for k, (e, p, o) in reqs.items()})
    finally:
        hook.remove()
    for k in specs:
        assert torch.equal(together[k], solo[k]), f"{k} differs from its solo run"
    assert not torch.equal(solo["a1"], solo["none"])
    steps = SD["num_inference_steps"]
    if with_pair:  # alpha, beta, none, beta+alpha: four calls a step
        assert calls == [4, 2, 2, 2] * steps
    else:  # every row in one call: 4 requests x (negative, positive)
        assert calls == [8] * steps


def test_a_request_never_waits_for_another_requests_adapter_load(sd: Any, adapters: Any) -> None:
    """The read of ``beta`` blocks (a deliberately slow store) until the test lets it go: a request with
    ``alpha`` and one without adapters finish meanwhile; the ``beta`` request then finishes with its solo bytes."""
    import torch

    from engine.adapters.hot import HotAdapters, slot
    from engine.stages.base import StageContext

    den = sd.executors["denoise"]
    beta = [{"name": "beta", "scale": 0.9}]
    slow, fast = _request(sd, 7, "a slow one", beta), _request(sd, 8, "a fast one", [{"name": "alpha", "scale": 1.0}])
    plain = _request(sd, 9, "a plain one", None)
    solo_slow = den.run(*slow[:2], StageContext(options=slow[2]))["denoised"]
    solo_fast = den.run(*fast[:2], StageContext(options=fast[2]))["denoised"]
    solo_plain = den.run(*plain[:2], StageContext(options=plain[2]))["denoised"]

    gate, reading = threading.Event(), threading.Event()
    original = den.hot
    fresh = HotAdapters(den.pipe.unet, "sd-t2i", 8, adapts=den.adapts)  # an instance that has nothing loaded yet

    def slow_read(path: Path, digest: str) -> Any:
        if digest == adapters.get("beta").digest:
            reading.set()
            assert gate.wait(60), "the test never let the slow read go"
        return fresh._read(path, digest)

    fresh.read = slow_read
    original.model.delete_adapters(list(original.loaded))  # the model as a fresh instance has it
    original.loaded.clear()
    den.hot = fresh
    try:
        states = {"slow": den.begin(*slow), "fast": den.begin(*fast), "plain": den.begin(*plain)}
        assert reading.wait(60)
        done = _drive(den, states, until=None, limit=40)
        assert set(done) == {"fast", "plain"}  # finished while beta's read was still blocked
        assert den.progress(states["slow"])[0] == 0 and slot(adapters.get("beta").digest) in fresh.pending
        assert torch.equal(done["fast"], solo_fast) and torch.equal(done["plain"], solo_plain)
        gate.set()
        rest = _drive(den, {"slow": states["slow"]})
        assert torch.equal(rest["slow"], solo_slow)
        assert fresh.report()["load_s_p50"] is not None
    finally:
        gate.set()
        fresh.close()
        fresh.model.delete_adapters(list(fresh.loaded))
        den.hot = original


def test_the_lru_keeps_at_most_max_adapters(sd: Any) -> None:
    import torch

    from engine.adapters.hot import HotAdapters
    from engine.stages.base import StageContext

    den = sd.executors["denoise"]
    original = den.hot  # None when this test runs first in its process: no adapter loaded yet
    if original is not None:
        original.model.delete_adapters(list(original.loaded))
        original.loaded.clear()
    lru = HotAdapters(den.pipe.unet, "sd-t2i", max_adapters=1, adapts=den.adapts)
    den.hot = lru
    try:
        a, b = _request(sd, 1, "x", [{"name": "alpha", "scale": 1.0}]), _request(sd, 1, "x", [{"name": "beta"}])
        first = den.run(*a[:2], StageContext(options=a[2]))["denoised"]
        den.run(*b[:2], StageContext(options=b[2]))
        assert lru.names() == ["beta"] and lru.evicted == 1
        assert set(den.pipe.unet.peft_config) == {s for s in lru.loaded}  # evicted from the model too
        again = den.run(*a[:2], StageContext(options=a[2]))["denoised"]  # loaded again: the same bytes
        assert torch.equal(first, again) and lru.names() == ["alpha"]
    finally:
        lru.close()
        lru.model.delete_adapters(list(lru.loaded))
        den.hot = original
