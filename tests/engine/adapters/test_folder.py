"""Issue 39: ``onepiece adapters add`` takes the folder diffusers' ``save_lora_weights`` writes (and
``load_lora_weights`` reads), not only the weights file in it; a folder with no weights file, or with several
and none of diffusers' name, is one ``error:`` line and exit status 2."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from engine.cli import main

pytestmark = pytest.mark.models  # the LoRA is written with torch and diffusers; the registry reads headers only


@pytest.fixture(scope="module")
def saved(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder written by diffusers' ``save_lora_weights`` (SD's loader) from a tiny random LoRA of sd-t2i."""
    from diffusers.loaders import StableDiffusionLoraLoaderMixin
    from safetensors.torch import load_file

    from engine.adapters.tiny import make_tiny_lora

    src = make_tiny_lora("sd-t2i", tmp_path_factory.mktemp("src"), 3, model_dir=tiny_models["sd-t2i"])
    layers = {k.removeprefix("unet."): v for k, v in load_file(str(src)).items()}
    out = tmp_path_factory.mktemp("saved") / "ink-lora"
    StableDiffusionLoraLoaderMixin.save_lora_weights(out, unet_lora_layers=layers)
    return out


def _add(store: Path, name: str, path: Path, model: Path) -> int:
    return main(["adapters", "--store", str(store), "add", name, str(path), "--workflow", "sd-t2i",
                 "--model", str(model)])


def test_add_takes_the_folder_save_lora_weights_writes(saved: Path, tiny_models: dict[str, Path], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from diffusers.loaders import StableDiffusionLoraLoaderMixin

    weights = saved / "pytorch_lora_weights.safetensors"
    assert [p.name for p in saved.iterdir()] == [weights.name]  # what diffusers wrote
    read, _alphas = StableDiffusionLoraLoaderMixin.lora_state_dict(str(saved))  # what load_lora_weights reads
    model, store = tiny_models["sd-t2i"], tmp_path / "store"
    assert _add(store, "ink", saved, model) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert main(["adapters", "--store", str(store), "list", "--json"]) == 0
    (entry,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert entry["digest"] == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert sorted(f"unet.{t}.lora_{h}.weight" for t in entry["targets"] for h in "AB") == sorted(read)
    # the file itself, as before; a folder whose one .safetensors file has another name
    assert _add(store, "ink-file", weights, model) == 0
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(weights, other / "my_lora.safetensors")
    (other / "README.md").write_text("not weights")
    assert _add(store, "ink-other", other, model) == 0
    # diffusers' name wins over another .safetensors beside it
    both = tmp_path / "both"
    shutil.copytree(saved, both)
    (both / "optimizer.safetensors").write_bytes(b"junk")
    assert _add(store, "ink-both", both, model) == 0


def test_a_folder_without_one_weights_file_is_one_error_line(saved: Path, tiny_models: dict[str, Path],
                                                             tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "adapter_config.json").write_text("{}")
    several = tmp_path / "several"
    several.mkdir()
    for name in ("a.safetensors", "b.safetensors"):
        shutil.copy(saved / "pytorch_lora_weights.safetensors", several / name)
    for folder, words in ((empty, "no .safetensors file"), (several, "2 .safetensors files (a.safetensors, "
                                                                      "b.safetensors)")):
        capsys.readouterr()
        assert _add(tmp_path / "store", "x", folder, tiny_models["sd-t2i"]) == 2
        out, err = capsys.readouterr()
        assert out == "" and len(err.splitlines()) == 1 and err.startswith("error: path: folder "), err
        assert "pytorch_lora_weights.safetensors" in err and words in err, err
