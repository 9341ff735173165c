"""``onepiece up --workflows``: serve a subset of the workflows that have model folders (fewer workers)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from engine.embedded import ServiceError
from engine.launcher import _ensure_models, add_arguments


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
