"""``onepiece models make-tiny`` / ``check`` and the tiny builder's determinism."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from engine.cli import main

pytestmark = pytest.mark.models


def _digest(folder: Path) -> dict[str, str]:
    # the stage pools' cache of these digests is not model content
    from engine.workflow.pools import DIGEST_FILE

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != DIGEST_FILE}


def test_make_tiny_is_deterministic_and_uses_the_published_layout(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    assert main(["models", "make-tiny", "--out", str(tmp_path / "sd"), "--workflow", "sd-t2i"]) == 0
    assert _digest(tmp_path / "sd") == _digest(tiny_models["sd-t2i"])
    assert main(["models", "make-tiny", "--out", str(tmp_path / "sd7"), "--workflow", "sd-t2i", "--seed", "7"]) == 0
    assert _digest(tmp_path / "sd7") != _digest(tiny_models["sd-t2i"])
    wan = _digest(tiny_models["wan2.1-i2v"])
    for f in ("model_index.json", "transformer/config.json", "vae/config.json", "text_encoder/config.json",
              "image_encoder/config.json", "image_processor/preprocessor_config.json",
              "scheduler/scheduler_config.json", "tokenizer/tokenizer_config.json",
              "transformer/diffusion_pytorch_model.safetensors"):
        assert f in wan
    assert sum((tiny_models["wan2.1-i2v"] / f).stat().st_size for f in wan) < 2_000_000
    # text-to-video: the Wan2.1-T2V layout (no image encoder), and the very umT5 and VAE of the I2V model
    t2v = _digest(tiny_models["wan2.1-t2v"])
    assert "transformer/diffusion_pytorch_model.safetensors" in t2v and "image_encoder/config.json" not in t2v
    for f in ("text_encoder/model.safetensors", "tokenizer/tokenizer.json", "vae/diffusion_pytorch_model.safetensors"):
        assert t2v[f] == wan[f]
    assert t2v["transformer/diffusion_pytorch_model.safetensors"] != wan["transformer/diffusion_pytorch_model.safetensors"]


def test_make_tiny_refuses_unknown_workflows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "make-tiny", "--out", str(tmp_path), "--workflow", "nope"]) == 2
    assert "no tiny model for workflow 'nope'" in capsys.readouterr().err


def test_check_names_the_missing_component(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    assert main(["models", "check", str(tiny_models["wan2.1-i2v"]), "--workflow", "wan2.1-i2v"]) == 0
    assert "ok:" in capsys.readouterr().out
    broken = tmp_path / "wan"
    shutil.copytree(tiny_models["wan2.1-i2v"], broken)
    (broken / "image_processor" / "preprocessor_config.json").unlink()
    assert main(["models", "check", str(broken), "--workflow", "wan2.1-i2v"]) == 2
    err = capsys.readouterr().err
    assert "'image_processor'" in err and str(broken / "image_processor" / "preprocessor_config.json") in err


def test_make_tiny_shows_only_its_own_progress(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """What onepiece up shows on its first run: one bar per workflow, none of the libraries' per-file bars
    ("Writing model shards") or warnings meant for their own users (a missing torchvision)."""
    assert main(["models", "make-tiny", "--out", str(tmp_path / "wan"), "--workflow", "wan2.1-i2v"]) == 0
    out, err = capfd.readouterr()
    assert out.strip() == f"wan2.1-i2v: {tmp_path / 'wan'}"
    assert "Writing model shards" not in err and "[transformers]" not in err and "torchvision" not in err, err
    assert "component" in err  # our own bar
