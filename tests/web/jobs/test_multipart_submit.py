"""The native multipart submit reads every field the JSON submit reads (``priority``, ``lora``,
``deadline_s``, ``webhook_url``, ``inputs``), never silently dropping one; an unknown or repeated field is a
400 naming it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from onepiece_platform.jobs.models import Job
from tests.fixtures.web import sd_body

pytestmark = pytest.mark.models  # a tiny sd-t2i model, for an adapter the registry takes


@pytest.fixture(scope="module")
def ink_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a tiny sd-t2i model folder, a LoRA file for it)."""
    from engine.adapters.tiny import make_tiny_lora
    from engine.stages.tiny import make_tiny

    out = tmp_path_factory.mktemp("multipart-lora")
    model = make_tiny(out / "sd-t2i", "sd-t2i")["sd-t2i"]
    return model, make_tiny_lora("sd-t2i", out / "lora", 1, model_dir=model)


@pytest.fixture
def registry(ink_files: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from engine.adapters.registry import store

    monkeypatch.setenv("ONEPIECE_ADAPTER_STORE", str(tmp_path / "adapters"))
    reg = store()
    reg.add("ink", ink_files[1], "sd-t2i", ink_files[0], 0.75)
    yield reg


def _form(**fields: Any) -> dict[str, Any]:
    body = sd_body()
    return {"workflow": body["workflow"], "params": json.dumps(body["params"]), **fields}


def test_multipart_records_priority_deadline_and_lora(registry: Any, alice: Any, store: Any) -> None:
    _, client, _ = alice
    r = client.post("/api/v1/jobs", _form(priority="low", deadline_s="600",
                                          lora=json.dumps([{"name": "ink", "scale": 0.5}])), format="multipart")
    assert r.status_code == 202, r.content
    job = Job.objects.get(uid=r.json()["uid"])
    assert job.priority == "low" and job.deadline_s == 600.0
    assert job.options["lora"] == [{"name": "ink", "scale": 0.5, "digest": registry.get("ink").digest}]
    # lora as the openai client's form fields, lora[][name] and lora[][scale]
    r = client.post("/api/v1/jobs", _form(**{"lora[][name]": "ink", "lora[][scale]": "1.25"}), format="multipart")
    assert r.status_code == 202, r.content
    assert Job.objects.get(uid=r.json()["uid"]).options["lora"][0]["scale"] == 1.25


@pytest.mark.parametrize(("fields", "field"), [
    ({"priority": "high"}, "priority"),  # over an ordinary account's tier: 403
    ({"priority": "urgent"}, "priority"),
    ({"deadline_s": "0"}, "deadline_s"),
    ({"lora": json.dumps([{"name": "nope"}])}, "lora"),
    ({"colour": "red"}, "colour"),  # unknown: refused, never ignored
    ({"params": "[1"}, "params"),
    ({"lora[][name]": "ink", "lora[][scale]": "\uff10.\uff15"}, "lora"),  # a full-width scale, "０.５"
    ({"deadline_s": "\uff16\uff10"}, "deadline_s"),  # "６０"
])
def test_multipart_refuses_what_json_refuses(registry: Any, alice: Any, store: Any, fields: dict, field: str) -> None:
    _, client, _ = alice
    r = client.post("/api/v1/jobs", _form(**fields), format="multipart")
    assert r.status_code in (400, 403), r.content
    assert field in json.dumps(r.json())
    assert not Job.objects.exists()


def test_multipart_refuses_a_repeated_field(alice: Any, store: Any) -> None:
    _, client, _ = alice
    body = _form()
    r = client.post("/api/v1/jobs", {**body, "priority": ["low", "normal"]}, format="multipart")
    assert r.status_code == 400 and r.json()["field"] == "priority"
    assert not Job.objects.exists()
