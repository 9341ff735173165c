"""``onepiece run``: a clear error (exit 2) for every bad input, before any stage runs."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from engine.cli import main


@pytest.fixture
def no_stage_may_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make loading any stage fail the test: errors must come before the stages."""
    from engine.stages import runner

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a stage was loaded before the input was validated")

    monkeypatch.setattr(runner.LocalRunner, "__init__", refuse)


@pytest.fixture(scope="module")
def image_file(tmp_path_factory: pytest.TempPathFactory, input_png: bytes) -> Path:
    path = tmp_path_factory.mktemp("img") / "first.png"
    path.write_bytes(input_png)
    return path


def _wan(models: dict[str, Path], image: Path | str | None, tmp_path: Path, *extra: str) -> list[str]:
    args = ["run", "wan2.1-i2v", "--model-dir", str(models["wan2.1-i2v"]), "--out", str(tmp_path / "o.mp4"),
            "--prompt", "a cat", "--size", "32x32", "--frames", "5", "--steps", "2"]
    if image is not None:
        args += ["--image", str(image)]
    return args + list(extra)


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err
    return err


@pytest.mark.usefixtures("no_stage_may_load")
@pytest.mark.parametrize(("extra", "expected"), [
    (["--frames", "0"], "num_frames must be >= 1"),
    (["--frames", "-3"], "num_frames must be >= 1"),
    (["--frames", "10"], "num_frames - 1 must be divisible by 4"),
    (["--frames", "257"], "num_frames must be <= 125"),  # the tiny transformer's rope_max_seq_len (32)
    (["--steps", "1000"], "num_inference_steps must be <= 100"),
    (["--steps", "0"], "num_inference_steps must be >= 1"),
    (["--size", "4096x4096"], "must be <= 512"),  # the same: 32 patches of 16 px
    (["--size", "528x512"], "rope_max_seq_len is 32"),
    (["--size", "30x32"], "multiple of 16"),
    (["--size", "big"], "--size must look like WIDTHxHEIGHT"),
    (["--prompt", ""], "prompt must not be empty"),
    (["--prompt", "   "], "prompt must not be empty"),
])
def test_bad_parameters_are_refused(
    extra: list[str], expected: str, tiny_models: dict[str, Path], image_file: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert expected in _error(capsys, _wan(tiny_models, image_file, tmp_path, *extra))


@pytest.mark.usefixtures("no_stage_may_load")
def test_missing_unreadable_and_non_image_files_are_refused(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], input_png: bytes,
) -> None:
    assert "needs --image" in _error(capsys, _wan(tiny_models, None, tmp_path))
    missing = tmp_path / "nope.png"
    err = _error(capsys, _wan(tiny_models, missing, tmp_path))
    assert "cannot read --image" in err and str(missing) in err
    text = tmp_path / "notes.png"
    text.write_text("not an image at all")
    err = _error(capsys, _wan(tiny_models, text, tmp_path))
    assert "not a readable image" in err and str(text) in err
    truncated = tmp_path / "cut.png"
    truncated.write_bytes(input_png[: len(input_png) // 2])
    assert "not a readable image" in _error(capsys, _wan(tiny_models, truncated, tmp_path))
    assert "is a directory" in _error(capsys, _wan(tiny_models, tmp_path, tmp_path)).lower()


@pytest.mark.usefixtures("no_stage_may_load")
@pytest.mark.parametrize("component", ["transformer", "image_encoder", "tokenizer", "scheduler", "vae"])
def test_a_missing_component_is_named_with_its_path(
    component: str, tiny_models: dict[str, Path], image_file: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    broken = tmp_path / "wan"
    shutil.copytree(tiny_models["wan2.1-i2v"], broken)
    shutil.rmtree(broken / component)
    argv = _wan({"wan2.1-i2v": broken}, image_file, tmp_path)
    err = _error(capsys, argv)
    assert f"missing component '{component}'" in err and str(broken / component) in err


@pytest.mark.usefixtures("no_stage_may_load")
def test_missing_weights_and_missing_folder_are_named(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    broken = tmp_path / "sd"
    shutil.copytree(tiny_models["sd-t2i"], broken)
    (broken / "unet" / "diffusion_pytorch_model.safetensors").unlink()
    base = ["run", "sd-t2i", "--prompt", "a cat", "--out", str(tmp_path / "o.png"), "--model-dir"]
    err = _error(capsys, [*base, str(broken)])
    assert "'unet'" in err and "no weight files" in err
    err = _error(capsys, [*base, str(tmp_path / "absent")])
    assert "does not exist" in err and str(tmp_path / "absent") in err


@pytest.mark.usefixtures("no_stage_may_load")
def test_options_a_workflow_does_not_take_are_refused(
    tiny_models: dict[str, Path], image_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    base = ["run", "sd-t2i", "--model-dir", str(tiny_models["sd-t2i"]), "--out", str(tmp_path / "o.png")]
    assert "takes no --frames" in _error(capsys, [*base, "--prompt", "a", "--frames", "9"])
    assert "takes no --image" in _error(capsys, [*base, "--prompt", "a", "--image", str(image_file)])
    assert "prompt must not be empty" in _error(capsys, base)
    assert "unknown workflow" in _error(capsys, ["run", "nope", "--model-dir", "x", "--out", "y"])
    t2v = ["run", "wan2.1-t2v", "--model-dir", str(tiny_models["wan2.1-t2v"]), "--out", str(tmp_path / "t.mp4")]
    assert "takes no --image" in _error(capsys, [*t2v, "--prompt", "a", "--image", str(image_file)])


@pytest.mark.models
def test_a_good_request_writes_the_output_files(
    tiny_models: dict[str, Path], image_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([*_wan(tiny_models, image_file, tmp_path), "--no-progress"]) == 0
    assert (tmp_path / "o.mp4").read_bytes()[4:8] == b"ftyp"
    out = tmp_path / "o.png"
    assert main(["run", "sd-t2i", "--model-dir", str(tiny_models["sd-t2i"]), "--out", str(out), "--prompt",
                 "a cat", "--size", "64x64", "--steps", "2", "--no-progress"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wrote" in capsys.readouterr().out
    t2v = tmp_path / "t.mp4"
    assert main(["run", "wan2.1-t2v", "--model-dir", str(tiny_models["wan2.1-t2v"]), "--out", str(t2v), "--prompt",
                 "a cat", "--size", "32x32", "--frames", "5", "--steps", "2", "--no-progress"]) == 0
    assert t2v.read_bytes()[4:8] == b"ftyp"
    # wan2.2-ti2v-5b's first frame is optional: a prompt alone is text to video
    ti2v = tmp_path / "ti2v.mp4"
    assert main(["run", "wan2.2-ti2v-5b", "--model-dir", str(tiny_models["wan2.2-ti2v-5b"]), "--out", str(ti2v),
                 "--prompt", "a cat", "--size", "64x64", "--frames", "5", "--steps", "2", "--no-progress"]) == 0
    assert ti2v.read_bytes()[4:8] == b"ftyp"
