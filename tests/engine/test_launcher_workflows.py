"""``onepiece up --workflows``: serve a subset of the workflows that have model folders (fewer workers)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from engine.embedded import ServiceError
from onepiece_launcher.up import _ensure_models, add_arguments


def _args(models: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--models", str(models), *extra])


def test_workflows_picks_a_subset_and_refuses_one_without_a_model(tmp_path: Path) -> None:
    for name in ("sd-t2i", "wan2.1-i2v", "wan2.1-t2v"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model_index.json").write_text("{}")
    assert set(_ensure_models(_args(tmp_path), {}, tmp_path)) == {"sd-t2i", "wan2.1-i2v", "wan2.1-t2v"}
    assert _ensure_models(_args(tmp_path, "--workflows", "wan2.1-t2v, sd-t2i"), {}, tmp_path) == {
        "wan2.1-t2v": str(tmp_path / "wan2.1-t2v"), "sd-t2i": str(tmp_path / "sd-t2i")}
    (tmp_path / "wan2.1-t2v" / "model_index.json").unlink()
    with pytest.raises(ServiceError, match="no model folder for wan2.1-t2v"):
        _ensure_models(_args(tmp_path, "--workflows", "wan2.1-t2v"), {}, tmp_path)


def test_tiny_models_serve_the_first_workflows_unless_asked_and_all_names_every_one(tmp_path: Path) -> None:
    from engine.workflow import workflows
    from onepiece_launcher.up import DEFAULT_WORKFLOWS

    models = tmp_path / "models"
    for name in workflows():  # as if make-tiny had built every one already (nothing is built here)
        (models / name).mkdir(parents=True)
        (models / name / "model_index.json").write_text("{}")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert set(_ensure_models(parser.parse_args([]), {}, tmp_path)) == set(DEFAULT_WORKFLOWS)
    assert set(_ensure_models(parser.parse_args(["--workflows", "all"]), {}, tmp_path)) == set(workflows())
    with pytest.raises(ServiceError, match="unknown workflow no-such-model"):
        _ensure_models(parser.parse_args(["--workflows", "sd-t2i,no-such-model"]), {}, tmp_path)


def test_spare_slots_default_to_the_cores_a_bottleneck_could_use_on_a_host_without_a_gpu(tmp_path: Path) -> None:
    from engine.worker.threads import is_cuda, usable_cores
    from onepiece_launcher.up import spare_slots

    args = _args(tmp_path)
    assert args.spare_slots is None  # unset: decided from the host
    expected = 0 if is_cuda(None) else usable_cores() - 1
    assert spare_slots(args.spare_slots) == expected
    assert spare_slots(_args(tmp_path, "--spare-slots", "3").spare_slots) == 3  # an operator's choice wins
    assert spare_slots(-2) == 0
