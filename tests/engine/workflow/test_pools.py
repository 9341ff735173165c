"""Stage pools: stages of different workflows share instances when their executor and component bytes match."""

from __future__ import annotations

import shutil
from pathlib import Path

from engine.stages.registry import pools
from engine.worker.config import Assignment, default_assignment
from engine.workflow.pools import folder_digest, link_identical
from onepiece_launcher.up import DEFAULT_WORKFLOWS

WAN = ("wan2.1-i2v", "wan2.1-t2v")


def _shared(found) -> dict[str, set[tuple[str, str]]]:
    return {p.name: set(p.members) for p in found if p.shared}


def test_the_wan_pair_shares_umt5_the_vae_and_the_mp4_encoder_by_content(tiny_models: dict[str, Path]) -> None:
    dirs = {w: str(tiny_models[w]) for w in DEFAULT_WORKFLOWS}
    shared = _shared(pools(dirs))
    assert shared == {f"wan2.1-i2v/{st}": {(w, st) for w in WAN} for st in ("text_encode", "vae_decode", "video_encode")}
    # the one-instance-per-pool deployment: 4 SD stages + 6 I2V + the T2V denoise alone, not 4 + 6 + 4
    a = default_assignment(dirs)
    assert len(a.instances) == 11
    text = next(i for i in a.instances if i.stage == "text_encode" and i.workflow == "wan2.1-i2v")
    assert text.members == (("wan2.1-i2v", "text_encode"), ("wan2.1-t2v", "text_encode"))
    assert Assignment.from_json(a.to_json()) == a  # the `also` members survive the JSON round trip
    assert len(default_assignment(dirs, share=False).instances) == 14


def test_sharing_follows_the_bytes_not_the_names(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    for w in WAN:
        shutil.copytree(tiny_models[w], tmp_path / w, symlinks=False)
    renamed = tmp_path / "somewhere-else"
    (tmp_path / "wan2.1-t2v").rename(renamed)
    dirs = {"wan2.1-i2v": str(tmp_path / "wan2.1-i2v"), "wan2.1-t2v": str(renamed)}
    assert set(_shared(pools(dirs))) == {f"wan2.1-i2v/{st}" for st in ("text_encode", "vae_decode", "video_encode")}
    # one changed byte in the T2V VAE (a fine-tuned VAE under the same name): the decoder is no longer shared,
    # while the text encoder and the model-free mp4 encoder still are
    weights = renamed / "vae" / "diffusion_pytorch_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.unlink()  # a hard link to the I2V copy, maybe: write a file of its own
    weights.write_bytes(bytes(data))
    assert set(_shared(pools(dirs))) == {f"wan2.1-i2v/{st}" for st in ("text_encode", "video_encode")}


def test_make_tiny_keeps_shared_components_once_on_disk(tiny_models: dict[str, Path]) -> None:
    for comp in ("text_encoder", "tokenizer", "vae"):
        files = sorted(p.relative_to(tiny_models["wan2.1-i2v"] / comp) for p in (tiny_models["wan2.1-i2v"] / comp).iterdir()
                       if p.is_file() and not p.name.startswith("."))
        for rel in files:
            a, b = tiny_models["wan2.1-i2v"] / comp / rel, tiny_models["wan2.1-t2v"] / comp / rel
            assert a.stat().st_ino == b.stat().st_ino, f"{comp}/{rel} is written twice"
    assert (tiny_models["wan2.1-i2v"] / "transformer" / "config.json").stat().st_ino != \
        (tiny_models["wan2.1-t2v"] / "transformer" / "config.json").stat().st_ino


def test_linking_is_idempotent_and_digests_are_cached(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / name / "vae").mkdir(parents=True)
        (tmp_path / name / "model_index.json").write_text("{}")
        (tmp_path / name / "vae" / "w.bin").write_bytes(b"same bytes")
    assert link_identical(tmp_path) == len(b"same bytes")
    assert link_identical(tmp_path) == 0
    digest = folder_digest(tmp_path / "a" / "vae")
    assert (tmp_path / "a" / "vae" / ".onepiece-digest.json").exists()
    assert folder_digest(tmp_path / "b" / "vae") == digest
