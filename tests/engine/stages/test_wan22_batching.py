"""Wan2.2's denoise stages batch their steps (issue 37): the A14B experts (``denoise_high``, ``denoise_low``) and
the 5B model's ``denoise``. Requests of one size, guidance mode and text length share one transformer call per
step over their cond and uncond rows, joining at step boundaries with other step counts (so other boundary
steps: one request's low expert may have no step at all), seeds, guidance scales and quality levels, and each
item is the bytes of the same request stepped alone, which are ``run``'s (the one-call pipeline's bytes:
test_wan22.py). Same process, same thread count for every side.

The 5B's per-token timestep (``expand_timesteps``: a (batch, tokens) timestep, its time embedding over every
token) was measured equal in a batch here too: each sample's time embedding runs apart inside the batched call
(engine.stages.invariant.per_sample), and requests with and without a first frame share a call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.workflow import get_workflow
from engine.workflow.options import Options
from tests.engine.stages.staged import batch_key, begin

pytestmark = pytest.mark.models

A14B = ("wan2.2-t2v-a14b", "wan2.2-i2v-a14b")
TI2V = "wan2.2-ti2v-5b"


@pytest.fixture(scope="module")
def runners(tiny_models: dict[str, Path]) -> dict[str, Any]:
    from engine.stages.runner import LocalRunner

    return {w: LocalRunner(w, tiny_models[w], "cpu") for w in (*A14B, TI2V)}


def _params(workflow: str, folder: Path, **p: Any) -> dict[str, Any]:
    spec = get_workflow(workflow)
    return spec.bound(spec.limits_of(str(folder))).resolve_params({"height": 32, "width": 32, "num_frames": 5, **p})


def _inputs(runner: Any, params: dict[str, Any], png: bytes | None, stage: str) -> dict[str, Any]:
    """What ``stage`` receives: the outputs of the stages before it, each run alone (``png`` None: no image)."""
    from engine.stages.base import StageContext

    values: dict[str, Any] = {"image": png or b""} if runner.spec.image_inputs() else {}
    route = runner.spec.route()
    for before in route[:route.index(stage)]:
        values.update(runner.executors[before].run(values, params, StageContext()))
    return values


def _solo(ex: Any, inputs: dict[str, Any], resolved: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``run``'s outputs, what it reported: its progress, its previews and its stats)."""
    from engine.stages.base import StageContext

    params, options = Options.split(resolved)
    seen: dict[str, Any] = {"progress": [], "previews": []}
    ctx = StageContext(options=options, progress=lambda s, n: seen["progress"].append((s, n)),
                       preview=lambda s, n, z: seen["previews"].append((s, n, z.clone())), preview_every=1)
    out = ex.run(inputs, params, ctx)
    seen["stats"] = ctx.stats
    return out, seen


def _together(ex: Any, inputs: list[dict[str, Any]], reqs: list[dict[str, Any]], joins: dict[int, list[int]],
              leave: dict[int, int] | None = None) -> tuple[dict[int, dict[str, Any]], list[int], dict[int, Any]]:
    """Requests stepped together as the batcher steps them (request ``k`` begins at tick ``t`` for each ``k`` in
    ``joins[t]``; leaves at its end, or after ``leave[k]`` steps, as a cancelled one leaves). Returns (each
    finished request's outputs, the batch width at each tick, what each reported after each step: its
    progress, its estimate, its preview, then its stats)."""
    states: dict[int, Any] = {}
    out: dict[int, dict[str, Any]] = {}
    seen: dict[int, Any] = {}
    widths: list[int] = []
    for tick in range(20):
        for k in joins.get(tick, []):
            states[k] = begin(ex, inputs[k], reqs[k])
            seen[k] = {"progress": [], "estimates": [], "previews": []}
        if not states:
            break
        widths.append(len(states))
        ex.step(list(states.values()))
        for k, st in list(states.items()):
            done, total = ex.progress(st)
            if total:  # a request with no step in this stage reports none (as run)
                seen[k]["progress"].append((done, total))
                seen[k]["estimates"].append(ex.estimate(st))
                step, steps, z = ex.preview(st)
                seen[k]["previews"].append((step, steps, z.clone()))
            if leave and done == leave.get(k):
                del states[k]
            elif done >= total:
                out[k], seen[k]["stats"] = ex.end(st), ex.stats(st)
                del states[k]
    return out, widths, seen


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def _check(ex: Any, inputs: list[dict[str, Any]], reqs: list[dict[str, Any]], joins: dict[int, list[int]],
           leave: dict[int, int] | None = None) -> tuple[list[dict[str, Any]], list[int], list[dict[str, Any]]]:
    """Each request that finishes in the batch equals its stepped-alone run and ``run`` (outputs, progress,
    previews, stats); returns (``run``'s outputs, the batch widths, ``run``'s stats)."""
    import torch

    out, widths, seen = _together(ex, inputs, reqs, joins, leave)
    assert sorted(out) == sorted(set(range(len(reqs))) - set(leave or {}))
    solo, stats = [], []
    for k, (e, r) in enumerate(zip(inputs, reqs, strict=True)):
        ran, reported = _solo(ex, e, r)
        solo.append(ran)
        stats.append(reported["stats"])
        if k not in out:
            continue
        assert _same(out[k], ran), f"request {k} ({r['quality']}) in the batch differs from its solo run"
        one, _, one_seen = _together(ex, [e], [r], {0: [0]})
        assert _same(one[0], ran), f"request {k} stepped alone differs from run"
        # the batcher reports the stage's own steps, as run does; previews count the whole run's steps
        assert seen[k]["progress"] == reported["progress"] == one_seen[0]["progress"]
        assert [(s, n) for s, n, _ in seen[k]["previews"]] == [(s, n) for s, n, _ in reported["previews"]]
        assert all(torch.equal(z, y) for (_, _, z), (_, _, y) in zip(seen[k]["previews"], reported["previews"],
                                                                      strict=True))
        assert all(torch.equal(e, z) for e, (_, _, z) in zip(seen[k]["estimates"], seen[k]["previews"], strict=True))
        assert seen[k]["stats"] == reported["stats"]
    return solo, widths, stats


@pytest.mark.parametrize("workflow", A14B)
def test_expert_requests_joining_mid_batch_equal_their_solo_runs(workflow: str, runners: dict[str, Any],
                                                                 tiny_models: dict[str, Path],
                                                                 input_png: bytes) -> None:
    """Three requests through both experts: other step counts (so other boundaries; t2v's 2-step request has
    none left for the low expert), seeds, guidance scales (``guidance_scale_2``: the low expert's) and quality
    levels, the third joining at the second step; each expert's items equal their solo runs, the high one's
    handed-on UniPC state included."""
    import torch

    runner, folder = runners[workflow], tiny_models[workflow]
    png = input_png if workflow == "wan2.2-i2v-a14b" else None
    steps = (5, 2, 8) if workflow == "wan2.2-t2v-a14b" else (4, 6, 9)
    rows = [("a red boat", steps[0], 1, 5.0, None, "lossless"), ("a tree", steps[1], 2, 3.0, 2.0, "lossless"),
            ("a blue car", steps[2], 3, 6.5, 4.0, "high")]
    reqs = [_params(workflow, folder, prompt=p, num_inference_steps=n, seed=s, guidance_scale=g,
                    guidance_scale_2=g2, quality=q) for p, n, s, g, g2, q in rows]
    high, low = runner.executors["denoise_high"], runner.executors["denoise_low"]
    assert len({batch_key(high, r) for r in reqs} | {batch_key(low, r) for r in reqs}) == 1
    embeds = [_inputs(runner, r, png, "denoise_high") for r in reqs]
    handed, widths, high_stats = _check(high, embeds, reqs, {0: [0, 1], 1: [2]})
    assert widths[:2] == [2, 3]
    bounds = [int(h["scheduler_counters"][-2]) for h in handed]
    assert len(set(bounds)) == 3 and (workflow != "wan2.2-t2v-a14b" or bounds[1] == steps[1])  # none left
    lows = [{**e, **h} for e, h in zip(embeds, handed, strict=True)]
    # the longest low side first, the first request joining it at its second step
    denoised, widths, low_stats = _check(low, lows, reqs, {0: [2, 1], 1: [0]})
    assert widths[:2] == ([2, 2] if workflow == "wan2.2-t2v-a14b" else [2, 3])
    assert not torch.equal(denoised[0]["denoised"], denoised[2]["denoised"])  # the requests differ
    # the "high" request's caches predicted some passes in one of the experts (its quality was served)
    assert high_stats[2]["cache_skipped"] > 0 or low_stats[2]["cache_skipped"] > 0
    assert "cache_skipped" not in high_stats[0] | low_stats[0]


def test_ti2v_requests_with_and_without_an_image_share_a_batch(runners: dict[str, Any],
                                                               tiny_models: dict[str, Path],
                                                               input_png: bytes) -> None:
    """The 5B model: a timestep per latent token, the first frame held by a mask where there is an image (none
    where there is not: every token at the step's timestep). Four requests, two with an image, other step
    counts, seeds and quality levels, joining mid-run; one leaves after two steps (cancelled), and the others
    still equal their solo runs."""
    runner, folder = runners[TI2V], tiny_models[TI2V]
    rows = [("a red boat", 4, 1, 5.0, "lossless", True), ("a tree", 5, 2, 3.0, "high", False),
            ("a blue car", 3, 3, 6.5, "lossless", False), ("a dog", 6, 4, 5.0, "lossless", True)]
    reqs = [_params(TI2V, folder, prompt=p, num_inference_steps=n, seed=s, guidance_scale=g, quality=q)
            for p, n, s, g, q, _ in rows]
    den = runner.executors["denoise"]
    assert len({batch_key(den, r) for r in reqs}) == 1
    inputs = [_inputs(runner, r, input_png if image else None, "denoise") for r, row in zip(reqs, rows, strict=True)
              for image in [row[-1]]]
    assert [e["condition"].numel() > 0 for e in inputs] == [True, False, False, True]
    _, widths, stats = _check(den, inputs, reqs, {0: [0, 1], 1: [2, 3]}, leave={3: 2})
    assert max(widths) == 4 == den_default(TI2V, "denoise") and widths[-1] == 1
    assert stats[1]["cache_skipped"] > 0


def den_default(workflow: str, stage: str) -> int:
    """The stage's default ``max_batch`` (its spec's: benchmarks/wan22_batching.py)."""
    return get_workflow(workflow).stage(stage).max_batch


def test_defaults_are_the_measured_ones() -> None:
    assert [den_default(w, s) for w in A14B for s in ("denoise_high", "denoise_low")] == [4, 4, 4, 4]
    assert den_default(TI2V, "denoise") == 4


def test_what_cannot_share_a_step_never_does(runners: dict[str, Any], tiny_models: dict[str, Path]) -> None:
    """Another size, frame count or text length, or an unguided request (one pass), is another batch key, in
    each Wan2.2 denoise stage; step counts, seeds, guidance scales and quality levels are not."""
    for workflow, stage in ((A14B[0], "denoise_high"), (A14B[1], "denoise_low"), (TI2V, "denoise")):
        ex = runners[workflow].executors[stage]
        base = _params(workflow, tiny_models[workflow], prompt="x")
        other = [{**base, "height": 64}, {**base, "width": 64}, {**base, "num_frames": 9},
                 {**base, "max_sequence_length": 64}, {**base, "guidance_scale": 1.0}]
        assert len({batch_key(ex, r) for r in (base, *other)}) == 1 + len(other), (workflow, stage)
        same = [{**base, "num_inference_steps": 3}, {**base, "seed": 9}, {**base, "guidance_scale": 7.0},
                {**base, "quality": "high"}] + ([{**base, "guidance_scale_2": 1.0}] if stage != "denoise" else [])
        assert {batch_key(ex, r) for r in same} == {batch_key(ex, base)}, (workflow, stage)
