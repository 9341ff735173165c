"""``onepiece bench e2e``'s baselines on private engines (issue 24, items 7c and 7d): the single-stage sd-t2i
gives the staged workflow's bytes, is offered only where the bench registers it, and the smallest run of
both baselines fills every field they add to ``bench e2e --json``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.bench.single_stage import MODULE, NAME

SD = dict(prompt="a cat on the moon", height=64, width=64, num_inference_steps=3, seed=5)


@pytest.fixture
def bench_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The registry with the benchmark-only workflows, as the bench's private engine's processes see it."""
    from engine.workflow.registry import workflows

    monkeypatch.setenv("ONEPIECE_BENCH_WORKFLOWS", MODULE)
    workflows.cache_clear()
    yield
    monkeypatch.delenv("ONEPIECE_BENCH_WORKFLOWS")
    workflows.cache_clear()
    assert NAME not in workflows()


def test_single_stage_is_not_offered_without_the_bench() -> None:
    from engine.workflow.registry import request_workflow, workflows

    assert NAME not in workflows()
    with pytest.raises(Exception, match="unknown workflow"):
        request_workflow(NAME)


@pytest.mark.models
def test_single_stage_png_equals_the_staged_png(bench_registry: None, tiny_models: dict[str, Path]) -> None:
    from engine.stages.runner import LocalRunner
    from engine.workflow import get_workflow

    staged = LocalRunner("sd-t2i", tiny_models["sd-t2i"], "cpu")
    single = LocalRunner(NAME, tiny_models["sd-t2i"], "cpu")
    assert get_workflow(NAME).route() == ["pipeline"]  # really one stage

    def png(runner: Any, params: dict[str, Any]) -> bytes:
        return bytes(runner.run(get_workflow(runner.spec.name).resolve_params(params), {}).outputs["image"])

    ref = png(staged, SD)
    assert ref[:8] == b"\x89PNG\r\n\x1a\n"
    assert png(single, SD) == ref
    # the seed and the prompt reach it: other ones, other bytes (equal again to the staged run of them)
    other = {**SD, "seed": 6, "prompt": "a red car"}
    assert png(single, other) != ref and png(single, other) == png(staged, other)


@pytest.mark.slow
@pytest.mark.models
@pytest.mark.timeout(900)
def test_private_engine_baselines_fill_every_field(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    from engine.bench import e2e
    from engine.bench.variants import MIX_WORKFLOWS
    from engine.worker.threads import usable_cores

    cores = usable_cores()

    mix = {wf: str(tiny_models[wf]) for wf in MIX_WORKFLOWS}
    r = e2e.baselines_on_private_engines(str(tiny_models["sd-t2i"]), seconds=1.0, in_flight=3,
                                         single_stage_instances=1, mix_model_dirs=mix)
    # 7c: the staged engine against itself serving the whole pipeline as one stage, same Proxy and store
    assert r["single_stage_output_equal"] is True  # the same request through both: the same png bytes
    assert r["single_stage_instances"] == 1
    for name in ("single_stage_capacity_rps", "single_stage_staged_capacity_rps", "staged_vs_single_stage_capacity"):
        assert isinstance(r[name], float) and r[name] > 0, (name, r[name])
    assert r["staged_vs_single_stage_capacity"] == pytest.approx(
        r["single_stage_staged_capacity_rps"] / r["single_stage_capacity_rps"])
    # 7d: an equal mix of the three workflows, staged as default_assignment deploys them, vs a monolith each
    assert r["mixed_workflows"] == list(MIX_WORKFLOWS)
    # every workflow of the mix was served through the staged engine (over the whole run: a one-second window
    # on a loaded host may hold no completion of a slower workflow, so the window's own counts are only checked
    # to be a part of the run's)
    served, in_window = r["mixed_served_by_workflow"], r["mixed_completed_by_workflow"]
    assert set(served) == set(MIX_WORKFLOWS) and all(n > 0 for n in served.values()), served
    assert sum(in_window.values()) > 0 and all(0 < n <= served[wf] for wf, n in in_window.items()), in_window
    for name in ("mixed_capacity_rps", "monolith_mix_capacity_rps", "mixed_vs_monolith_capacity",
                 "staged_rss_mb", "monolith_rss_mb"):
        assert isinstance(r[name], float) and r[name] > 0, (name, r[name])
    assert r["mixed_vs_monolith_capacity"] == pytest.approx(r["mixed_capacity_rps"] / r["monolith_mix_capacity_rps"])
    # the monolith searched over processes x threads: a process per workflow, and K processes serving all
    configs = r["monolith_mix_by_config"]
    assert set(configs) == {"per-workflow", *(f"shared-{k}x{max(1, cores // k)}" for k in range(1, cores + 1))}
    assert all(c["rps"] > 0 for c in configs.values()), configs
    best = configs[r["monolith_mix_config"]]
    assert r["monolith_mix_capacity_rps"] == best["rps"] == max(c["rps"] for c in configs.values())
    # memory, summed over each side's processes: every monolith loaded a pipeline (tens of MiB at least), and
    # the staged side's stage workers are counted apart from its Proxy, node, redis and etcd; proportional
    # memory splits the pages that torch's libraries share between processes, so it is below the summed RSS
    assert best["rss_mb"] > 50 * best["processes"] and r["monolith_rss_mb"] == best["rss_mb"]
    assert 0 < r["monolith_pss_mb"] <= r["monolith_rss_mb"]
    for kind in ("rss", "pss"):
        b = r[f"staged_{kind}_breakdown_mb"]
        assert {"stage_workers", "node", "proxy", "redis", "etcd"} <= set(b), b
        assert b["stage_workers"] > 30 * 3 and r[f"staged_{kind}_mb"] == pytest.approx(sum(b.values()))
    assert r["staged_pss_mb"] < r["staged_rss_mb"]
