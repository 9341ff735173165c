"""The operators' registry: what adding refuses (before anything is served), what it records, and that a
request's ``lora`` can only name registered adapters of its workflow (400 naming ``lora``, never a path)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine.adapters.registry import AdapterError, AdapterStore
from engine.workflow import InvalidRequest, get_workflow
from engine.workflow.options import Options

pytestmark = pytest.mark.models  # the tiny LoRAs are written with torch; the checks themselves are torch-free


def _lora(adapters: Any, name: str) -> Path:
    return adapters.files_dir / name / "pytorch_lora_weights.safetensors"


def test_adding_records_the_digest_and_copies_the_file_into_the_store(adapters: Any) -> None:
    a = adapters.get("alpha")
    src = _lora(adapters, "alpha")
    assert a.digest == hashlib.sha256(src.read_bytes()).hexdigest()
    stored = adapters.file(a)
    assert stored.parent == adapters.root / "files" and stored.read_bytes() == src.read_bytes()
    assert a.rank == 4 and a.workflow == "sd-t2i" and len(a.targets) == 32
    assert all(t.rsplit(".", 1)[-1] in ("to_q", "to_k", "to_v", "0") for t in a.targets)
    assert "file" not in a.public() and str(adapters.root) not in json.dumps(a.public())
    assert [x.name for x in adapters.list("sd-t2i")] == ["alpha", "beta"]


def test_make_tiny_lora_is_deterministic(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    from engine.adapters.tiny import make_tiny_lora

    one = make_tiny_lora("sd-t2i", tmp_path / "a", 7, model_dir=tiny_models["sd-t2i"]).read_bytes()
    two = make_tiny_lora("sd-t2i", tmp_path / "b", 7, model_dir=tiny_models["sd-t2i"]).read_bytes()
    other = make_tiny_lora("sd-t2i", tmp_path / "c", 8, model_dir=tiny_models["sd-t2i"]).read_bytes()
    assert one == two and one != other


def test_adding_refuses_bad_files(adapters: Any, tiny_models: dict[str, Path], tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    from engine.adapters import registry

    reg = AdapterStore(tmp_path / "store")
    sd = tiny_models["sd-t2i"]
    good = _lora(adapters, "alpha")

    def refused(path: Path, workflow: str = "sd-t2i", name: str = "x", model: Path = sd) -> str:
        with pytest.raises(AdapterError) as err:
            reg.add(name, path, workflow, model)
        assert reg.list() == []  # nothing recorded
        return str(err.value)

    pickle = tmp_path / "lora.bin"
    pickle.write_bytes(good.read_bytes())
    assert "safetensors files only" in refused(pickle)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    assert "not a safetensors file" in refused(junk)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(good.read_bytes()[:-10])
    assert "data section's length" in refused(cut)  # a truncated file: its offsets run past the data
    # an SD LoRA is no LoRA of Wan's transformer
    assert "not a LoRA of wan2.1-t2v's transformer" in refused(good, "wan2.1-t2v", model=tiny_models["wan2.1-t2v"])
    # a target module the model does not have, and factors that do not fit the module's weight
    missing = tmp_path / "missing.safetensors"
    save_file({"unet.no_such_block.to_q.lora_A.weight": np.zeros((4, 8), "float32"),
               "unet.no_such_block.to_q.lora_B.weight": np.zeros((8, 4), "float32")}, str(missing))
    assert "'no_such_block.to_q' is not in sd-t2i's unet" in refused(missing)
    module = adapters.get("alpha").targets[0]
    misfit = tmp_path / "misfit.safetensors"
    save_file({f"unet.{module}.lora_A.weight": np.zeros((4, 3), "float32"),
               f"unet.{module}.lora_B.weight": np.zeros((8, 4), "float32")}, str(misfit))
    assert "do not fit its weight" in refused(misfit)
    # rank and size limits
    monkeypatch.setattr(registry, "MAX_RANK", 2)
    assert "rank 4; the limit is 2" in refused(good)
    monkeypatch.setattr(registry, "MAX_RANK", 256)
    monkeypatch.setattr(registry, "MAX_BYTES", 100)
    assert "the limit is 100" in refused(good)
    monkeypatch.setattr(registry, "MAX_BYTES", 1 << 30)
    for bad in ("../up", "/etc/x", "http://evil/x", "A", "", "a" * 65):
        assert "adapter name" in refused(good, name=bad)
    assert "takes no adapters" in refused(good, "no-such-workflow")
    reg.add("ok", good, "sd-t2i", sd)
    with pytest.raises(AdapterError, match="exists"):
        reg.add("ok", good, "sd-t2i", sd)
    assert reg.remove("ok") and not reg.remove("ok")
    assert list((reg.root / "files").glob("*.safetensors")) == []


def test_the_store_never_resolves_a_file_outside_it(adapters: Any, tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "copy"
    shutil.copytree(adapters.root, root)
    doc = json.loads((root / "registry.json").read_text())
    doc["adapters"]["alpha"]["file"] = "../../../etc/passwd"
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(b"x")
    doc["adapters"]["beta"]["file"] = str(outside)
    (root / "registry.json").write_text(json.dumps(doc))
    reg = AdapterStore(root)
    for name in ("alpha", "beta"):
        with pytest.raises(AdapterError, match="not in the adapter store"):
            reg.file(reg.get(name))


def test_a_request_names_registered_adapters_of_its_workflow_only(adapters: Any) -> None:
    sd = get_workflow("sd-t2i")
    beta = adapters.get("beta")
    got = sd.resolve_params({"prompt": "x", "lora": [{"name": "alpha", "scale": 0.8}, {"name": "beta"}]})
    assert got["lora"] == [{"name": "alpha", "scale": 0.8, "digest": adapters.get("alpha").digest},
                           {"name": "beta", "scale": 0.5, "digest": beta.digest}]  # beta's default scale
    assert "lora" not in sd.resolve_params({"prompt": "x"}) and "lora" not in sd.resolve_params({"prompt": "x",
                                                                                                 "lora": []})
    assert sd.resolve_params(dict(got))["lora"] == got["lora"]  # resolved params resolve to themselves (the Proxy)
    bad: list[Any] = [
        "alpha", {"name": "alpha"}, [{"name": "nope"}], [{"name": "wave"}], [{"name": "alpha", "scale": 9}],
        [{"name": "alpha", "scale": float("nan")}], [{"name": "alpha", "scale": True}], [{"name": "alpha"}] * 2,
        [{"name": n} for n in ("alpha", "beta", "alpha", "beta", "alpha")], [{"name": "../../etc/passwd"}],
        [{"name": "/etc/passwd"}], [{"name": "http://example.com/x.safetensors"}], [{"path": "/tmp/x"}],
        [{"name": "alpha", "path": "/tmp/x"}], [{"name": "alpha", "digest": "0" * 64}],
    ]
    for value in bad:
        with pytest.raises(InvalidRequest) as err:
            sd.resolve_params({"prompt": "x", "lora": value})
        assert err.value.field == "lora", value
    with pytest.raises(InvalidRequest) as err:
        get_workflow("wan2.1-t2v").resolve_params({"prompt": "x", "lora": [{"name": "alpha"}]})
    assert err.value.field == "lora" and "is for sd-t2i" in str(err.value)


def test_the_proxy_intake_answers_400_naming_lora(adapters: Any) -> None:
    from engine.proxy.intake import Intake
    from engine.proxy.parsing import BadRequest

    intake = Intake()
    body = {"workflow": "sd-t2i", "params": {"prompt": "x", "lora": [{"name": "../x", "scale": 1}]}}
    with pytest.raises(BadRequest) as err:
        intake.parse(json.dumps(body).encode(), "application/json")
    assert err.value.field == "lora" and err.value.status == 400
    body["params"]["lora"] = [{"name": "alpha", "scale": 0.25}]
    sub = intake.parse(json.dumps(body).encode(), "application/json")
    assert sub.options.lora[0]["digest"] == adapters.get("alpha").digest and "lora" not in sub.params
    # what the denoise stage reads: the header's options, whole
    assert Options.from_json(intake.ticket(sub).header.options).lora == sub.options.lora


def test_the_cli_adds_lists_and_removes(adapters: Any, tiny_models: dict[str, Path], tmp_path: Path) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "engine.cli", "adapters", "--store", str(tmp_path / "s"),
                               *args], capture_output=True, text=True, timeout=120)

    src = str(_lora(adapters, "beta"))
    add = cli("add", "ink", src, "--workflow", "sd-t2i", "--model", str(tiny_models["sd-t2i"]),
              "--scale-default", "0.7")
    assert add.returncode == 0, add.stderr
    bad = cli("add", "ink2", src, "--workflow", "wan2.1-t2v", "--model", str(tiny_models["wan2.1-t2v"]))
    assert bad.returncode == 2 and "error: path:" in bad.stderr
    listed = [json.loads(line) for line in cli("list", "--json").stdout.splitlines()]
    assert [(a["name"], a["scale_default"], a["digest"]) for a in listed] == [("ink", 0.7, adapters.get("beta").digest)]
    assert cli("remove", "ink").returncode == 0 and cli("list").stdout == ""
    assert cli("remove", "ink").returncode == 2
