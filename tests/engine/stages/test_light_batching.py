"""Light stages batch (issue 37, item 2): sd-t2i's CLIP text encoder takes several requests in one call
(engine.stages.base.BatchedCallStage), each item the bytes of its solo run and of the one-call pipeline's
own ``encode_prompt``; through an instance's TaskWorker they share a call, the ledger's event says the batch
size, and no progress event is written for a stage without steps."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from engine.workflow import get_workflow

pytestmark = pytest.mark.models

WF = "sd-t2i"
ROWS = [("a cat", None), ("a red boat on a lake at dawn, oil painting", "blurry"), ("a dog", ""),
        ("the moon over a city of glass and light, at night, very detailed", "low quality, text")]


@pytest.fixture(scope="module")
def runner(tiny_models: dict[str, Path]) -> Any:
    from engine.stages.runner import LocalRunner

    return LocalRunner(WF, tiny_models[WF], "cpu")


def _params(prompt: str, negative: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": prompt, "height": 64, "width": 64, "num_inference_steps": 2}
    if negative is not None:
        body["negative_prompt"] = negative
    return get_workflow(WF).resolve_params(body)


def test_a_batch_of_prompts_gives_each_its_solo_bytes(runner: Any, tiny_models: dict[str, Path]) -> None:
    import torch
    from diffusers import StableDiffusionPipeline

    from engine.stages.base import StageContext

    enc = runner.executors["text_encode"]
    reqs = [_params(p, n) for p, n in ROWS]
    assert len({enc.batch_key(r) for r in reqs}) == 1
    solo = [enc.run({}, r, StageContext()) for r in reqs]
    states = [enc.begin({}, r) for r in reqs]
    enc.step(states)
    assert all(enc.progress(s) == (1, 1) for s in states)
    batched = [enc.end(s) for s in states]
    pipe = StableDiffusionPipeline.from_pretrained(tiny_models[WF], safety_checker=None, requires_safety_checker=False)
    for (prompt, negative), one, many in zip(ROWS, solo, batched, strict=True):
        for key in ("prompt_embeds", "negative_prompt_embeds"):
            assert torch.equal(many[key], one[key]), (prompt, key)
        with torch.no_grad():  # what the one-call pipeline encodes (in its __call__'s no_grad)
            pos, neg = pipe.encode_prompt(prompt, "cpu", 1, True, negative)
        assert torch.equal(one["prompt_embeds"], pos) and torch.equal(one["negative_prompt_embeds"], neg)
    assert not torch.equal(solo[0]["prompt_embeds"], solo[2]["prompt_embeds"])  # the prompts reach the model


def test_an_instance_encodes_its_requests_together(runner: Any, redis_server: Any, etcd_server: Any) -> None:
    """Through the TaskWorker's batching loop, its ring and store: four requests share one call, each is
    handed on once with its solo embeddings, each stage_finished says batch=4, and no progress event is
    written (the call's one "step" is its end)."""
    import torch

    from engine.stages.base import StageContext
    from engine.store import keys
    from tests.engine.worker.rig import DenoiseRig

    enc = runner.executors["text_encode"]
    uids = [uuid.uuid4().hex for _ in ROWS]
    reqs = {u: _params(p, n) for u, (p, n) in zip(uids, ROWS, strict=True)}
    solo = {u: enc.run({}, reqs[u], StageContext()) for u in uids}
    calls: list[int] = []

    class Counted(type(enc)):  # type: ignore[misc]
        def step(self, states: list[Any]) -> None:
            calls.append(len(states))
            super().step(states)

    enc.__class__ = Counted
    rig = DenoiseRig(redis_server.url, etcd_server.url, WF, stage="text_encode")
    try:
        worker = rig.worker(enc, max_batch=8)
        rig.serve(worker, uids, reqs, {u: {} for u in uids})
        for output in ("prompt_embeds",):
            handed: dict[str, Any] = {}
            rig.collect(handed, output)
            assert sorted(handed) == sorted(uids)
            for u in uids:
                assert torch.equal(handed[u], solo[u][output])
        assert calls == [4], calls  # one call for the four
        for u in uids:
            events = rig.store.events(u)
            finished = [e for e in events if e["type"] == keys.STAGE_FINISHED]
            assert len(finished) == 1 and "batch=4" in finished[0]["detail"], finished
            assert not [e for e in events if e["type"] == keys.PROGRESS], events
    finally:
        enc.__class__ = Counted.__mro__[1]
        rig.close()


@pytest.mark.parametrize("workflow", ["flux.1-dev", "flux.1-schnell"])
def test_flux_prompts_of_one_length_share_a_call(workflow: str, tiny_models: dict[str, Path]) -> None:
    """FLUX.1's CLIP and T5 encoders take a batch of prompts of one ``max_sequence_length``; each item equals
    its solo run, and that the one-call FluxPipeline's encode_prompt; another length is another batch."""
    import torch
    from diffusers import FluxPipeline

    from engine.stages.base import StageContext
    from engine.stages.runner import LocalRunner

    enc = LocalRunner(workflow, tiny_models[workflow], "cpu").executors["text_encode"]
    spec = get_workflow(workflow)
    spec = spec.bound(spec.limits_of(str(tiny_models[workflow])))
    reqs = [spec.resolve_params({"prompt": p, "height": 64, "width": 64}) for p, _ in ROWS]
    assert len({enc.batch_key(r) for r in reqs}) == 1
    other = spec.resolve_params({"prompt": "x", "max_sequence_length": int(reqs[0]["max_sequence_length"]) // 2})
    assert enc.batch_key(other) != enc.batch_key(reqs[0])
    solo = [enc.run({}, r, StageContext()) for r in reqs]
    states = [enc.begin({}, r) for r in reqs]
    enc.step(states)
    pipe = FluxPipeline.from_pretrained(tiny_models[workflow])
    for r, one, many in zip(reqs, solo, [enc.end(s) for s in states], strict=True):
        assert many.keys() == one.keys() == {"prompt_embeds", "pooled_prompt_embeds"}
        for key in one:
            assert torch.equal(many[key], one[key]), (r["prompt"], key)
        with torch.no_grad():  # as the pipeline's __call__ (with grad, SDPA takes another CPU kernel)
            pos, pooled, _ = pipe.encode_prompt(r["prompt"], None, device="cpu",
                                                max_sequence_length=int(r["max_sequence_length"]))
        assert torch.equal(one["prompt_embeds"], pos) and torch.equal(one["pooled_prompt_embeds"], pooled)


def test_wan_prompts_of_one_length_share_a_call(tiny_models: dict[str, Path]) -> None:
    """Wan's umT5 encoder: prompts and negative prompts of one ``max_sequence_length`` in one call, each item
    equal to its solo run and to the one-call WanPipeline's encode_prompt."""
    import torch
    from diffusers import WanPipeline

    from engine.stages.base import StageContext
    from engine.stages.runner import LocalRunner

    workflow = "wan2.1-t2v"
    enc = LocalRunner(workflow, tiny_models[workflow], "cpu").executors["text_encode"]
    spec = get_workflow(workflow)
    spec = spec.bound(spec.limits_of(str(tiny_models[workflow])))
    reqs = [spec.resolve_params({"prompt": p, "negative_prompt": n or "", "height": 32, "width": 32,
                                 "num_frames": 5}) for p, n in ROWS]
    assert len({enc.batch_key(r) for r in reqs}) == 1
    solo = [enc.run({}, r, StageContext()) for r in reqs]
    states = [enc.begin({}, r) for r in reqs]
    enc.step(states)
    pipe = WanPipeline.from_pretrained(tiny_models[workflow], transformer=None, vae=None)
    for r, one, many in zip(reqs, solo, [enc.end(s) for s in states], strict=True):
        for key in ("prompt_embeds", "negative_prompt_embeds"):
            assert torch.equal(many[key], one[key]), (r["prompt"], key)
        with torch.no_grad():
            pos, neg = pipe.encode_prompt(r["prompt"], r["negative_prompt"], True,
                                          max_sequence_length=int(r["max_sequence_length"]), device="cpu")
        assert torch.equal(one["prompt_embeds"], pos) and torch.equal(one["negative_prompt_embeds"], neg)


def test_qwen_prompts_of_one_token_count_share_a_call(tiny_models: dict[str, Path]) -> None:
    """Qwen-Image's Qwen2.5-VL encoder: prompts (and negative prompts) of the same token counts in one call,
    each item equal to its solo run and to the one-call QwenImagePipeline's encode_prompt; another count is
    another batch key (the tokenizer would pad the batch to its longest)."""
    import torch
    from diffusers import QwenImagePipeline

    from engine.stages.base import StageContext
    from engine.stages.runner import LocalRunner

    workflow = "qwen-image"
    enc = LocalRunner(workflow, tiny_models[workflow], "cpu").executors["text_encode"]
    spec = get_workflow(workflow)
    spec = spec.bound(spec.limits_of(str(tiny_models[workflow])))
    by_key: dict[Any, list[dict[str, Any]]] = {}
    for k in range(64):  # the tiny tokenizer splits words unevenly: group prompts by their key
        r = spec.resolve_params({"prompt": f"a photo of thing {k} on a table", "negative_prompt": None if k % 2 else "",
                                 "height": 64, "width": 64})
        by_key.setdefault(enc.batch_key(r), []).append(r)
    # eight in one call: where the batch's SiLU and linears ran over it whole, one of these differed in the
    # last bit (engine.stages.invariant.per_sample)
    reqs = next(iter(by_key.values()))[:8]  # "... thing 0 ..." to "... thing 7 ..."
    assert len(reqs) == 8, {k: len(v) for k, v in by_key.items()}
    longer = spec.resolve_params({"prompt": reqs[0]["prompt"] + " on a mat in the sun"})
    assert enc.batch_key(longer) != enc.batch_key(reqs[0])
    solo = [enc.run({}, r, StageContext()) for r in reqs]
    states = [enc.begin({}, r) for r in reqs]
    enc.step(states)
    pipe = QwenImagePipeline.from_pretrained(tiny_models[workflow], transformer=None, vae=None)
    for r, one, many in zip(reqs, solo, [enc.end(s) for s in states], strict=True):
        assert many.keys() == one.keys()
        for key in one:
            assert torch.equal(many[key], one[key]), (r["prompt"], key)
        with torch.no_grad():
            pos, _ = pipe.encode_prompt(r["prompt"], device="cpu",
                                        max_sequence_length=int(r["max_sequence_length"]))
        assert torch.equal(one["prompt_embeds"], pos)
