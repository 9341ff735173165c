"""LoRA adapters on the platform: GET /v1/adapters (never a path), the lora field of the native API and both
OpenAI routes (through the openai client's extra_body), its 400s naming lora before any work, the ledger's
record of the job's adapters and digests, and the registry in the admin (staff only)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from onepiece_platform.jobs.models import Job
from tests.fixtures.web import client_for, make_user, sd_body

# live_server for every test, not only the openai one: pytest orders tests by their session-scoped fixtures and
# would split this module apart, building lora_files twice
pytestmark = [pytest.mark.models, pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning"),
              pytest.mark.usefixtures("live_server")]
EXTRA = {"num_inference_steps": 2}


@pytest.fixture(scope="module")
def lora_files(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from engine.adapters.tiny import make_tiny_lora

    out = tmp_path_factory.mktemp("web-lora")
    return {"sd-t2i": make_tiny_lora("sd-t2i", out / "sd", 1, model_dir=tiny_models["sd-t2i"]),
            "wan2.1-t2v": make_tiny_lora("wan2.1-t2v", out / "wan", 2, model_dir=tiny_models["wan2.1-t2v"])}


@pytest.fixture
def registry(tiny_models: dict[str, Path], lora_files: dict[str, Path], tmp_path: Path,
             monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A fresh store (ONEPIECE_ADAPTER_STORE) with sd-t2i's ``ink`` and wan2.1-t2v's ``wave``; the model
    folders where the admin looks for them (ONEPIECE_STATE_DIR/models)."""
    from engine.adapters.registry import store

    state = tmp_path / "state"
    (state / "models").mkdir(parents=True)
    for wf, folder in tiny_models.items():
        (state / "models" / wf).symlink_to(folder)
    monkeypatch.setenv("ONEPIECE_STATE_DIR", str(state))
    monkeypatch.setenv("ONEPIECE_ADAPTER_STORE", str(tmp_path / "adapters"))
    reg = store()
    reg.add("ink", lora_files["sd-t2i"], "sd-t2i", tiny_models["sd-t2i"], 0.75)
    reg.add("wave", lora_files["wan2.1-t2v"], "wan2.1-t2v", tiny_models["wan2.1-t2v"])
    yield reg


BAD = [
    ([{"name": "nope"}], "no adapter named"),
    ([{"name": "wave"}], "is for wan2.1-t2v"),
    ([{"name": "ink", "scale": 7}], "scale"),
    ([{"name": "ink"}] * 5, "at most 4"),
    ([{"name": "../../etc/passwd"}], "adapter name"),
    ([{"name": "/etc/passwd"}], "adapter name"),
    ([{"name": "http://example.com/x.safetensors"}], "adapter name"),
    ([{"name": "ink", "path": "/tmp/x.safetensors"}], "must be"),
    ("ink", "list"),
]


def test_clients_list_adapters_without_paths(registry: Any, alice: Any) -> None:
    _, client, _ = alice
    r = client.get("/v1/adapters")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list" and [a["name"] for a in body["data"]] == ["ink", "wave"]
    ink = body["data"][0]
    assert ink["workflow"] == "sd-t2i" and ink["rank"] == 4 and ink["scale_default"] == 0.75 and ink["created"] > 0
    assert len(ink["targets"]) == 32 and ink["digest"] == registry.get("ink").digest
    assert str(registry.root) not in r.content.decode() and "file" not in ink
    assert [a["name"] for a in client.get("/v1/adapters?workflow=wan2.1-t2v").json()["data"]] == ["wave"]
    from rest_framework.test import APIClient

    assert APIClient().get("/v1/adapters").status_code == 401


def test_native_jobs_take_lora_and_the_ledger_records_digests(registry: Any, alice: Any, store: Any) -> None:
    _, client, _ = alice
    r = client.post("/api/v1/jobs", {**sd_body(), "lora": [{"name": "ink", "scale": 0.5}]}, format="json")
    assert r.status_code == 202, r.content
    job = Job.objects.get(uid=r.json()["uid"])
    assert job.options["lora"] == [{"name": "ink", "scale": 0.5, "digest": registry.get("ink").digest}]
    assert r.json()["params"]["lora"] == job.options["lora"]  # the client sees what its job was given
    # inside params too, with the adapter's default scale
    r = client.post("/api/v1/jobs", sd_body(lora=[{"name": "ink"}]), format="json")
    assert r.status_code == 202 and Job.objects.get(uid=r.json()["uid"]).options["lora"][0]["scale"] == 0.75
    r = client.post("/api/v1/jobs", {**sd_body(lora=[{"name": "ink"}]), "lora": [{"name": "ink"}]}, format="json")
    assert r.status_code == 400 and "lora" in json.dumps(r.json())
    jobs = Job.objects.count()
    for value, words in BAD:
        r = client.post("/api/v1/jobs", {**sd_body(), "lora": value}, format="json")
        assert r.status_code == 400, (value, r.content)
        text = json.dumps(r.json())
        assert '"lora"' in text and words in text, (value, text)
    assert Job.objects.count() == jobs  # refused before any work: no ledger row, nothing sent to the engine


def test_openai_routes_take_lora_through_extra_body(registry: Any, oa: Any, workers: Any) -> None:
    client, _ = oa
    r = client.images.generate(prompt="a cat", size="64x64", response_format="b64_json",
                               extra_body={**EXTRA, "lora": [{"name": "ink", "scale": 1.25}]})
    assert len(r.data) == 1
    job = Job.objects.filter(api="openai", workflow="sd-t2i").latest("created_at")
    assert job.options["lora"] == [{"name": "ink", "scale": 1.25, "digest": registry.get("ink").digest}]
    workers.hold = True
    v = client.videos.create(prompt="a wave", model="wan2.1-t2v", size="64x64",
                             extra_body={**EXTRA, "lora": [{"name": "wave", "scale": 0.5}]})
    assert Job.objects.get(uid=v.id).options["lora"][0]["digest"] == registry.get("wave").digest
    for value, _words in BAD:
        with pytest.raises(openai.BadRequestError) as e:
            client.images.generate(prompt="a cat", size="64x64", extra_body={**EXTRA, "lora": value})
        assert e.value.body["param"] == "lora", value
    with pytest.raises(openai.BadRequestError) as e:
        client.videos.create(prompt="a wave", model="wan2.1-t2v", size="64x64",
                             extra_body={**EXTRA, "lora": [{"name": "ink"}]})
    assert e.value.body["param"] == "lora" and "is for sd-t2i" in e.value.body["message"]


def test_the_admin_adds_and_removes_adapters_for_staff_only(registry: Any, db: None, lora_files: dict[str, Path],
                                                            web_redis: str) -> None:
    from django.test import Client

    from onepiece_platform.adapters.models import AdapterAction

    staff, _ = make_user("op", is_staff=True, is_superuser=True)
    web = Client()
    web.force_login(staff)
    page = web.get("/admin/adapters/adapteraction/")
    assert page.status_code == 200 and b"ink" in page.content and b"wave" in page.content
    data = lora_files["sd-t2i"].read_bytes()
    upload = io.BytesIO(data)
    upload.name = "mine.safetensors"
    r = web.post("/admin/adapters/adapteraction/add/", {"action": "add", "name": "mine", "workflow": "sd-t2i",
                                                        "scale_default": "0.5", "file": upload})
    assert r.status_code == 302, r.content[:2000]
    assert registry.get("mine").scale_default == 0.5 and AdapterAction.objects.get(name="mine").status == "done"
    bad = io.BytesIO(data)
    bad.name = "wrong.safetensors"
    web.post("/admin/adapters/adapteraction/add/", {"action": "add", "name": "wrong", "workflow": "wan2.1-t2v",
                                                    "scale_default": "1", "file": bad})
    assert registry.get("wrong") is None and AdapterAction.objects.get(name="wrong").status == "refused"
    web.post("/admin/adapters/adapteraction/add/", {"action": "remove", "name": "mine", "scale_default": "1"})
    assert registry.get("mine") is None
    # not staff: the admin's sign-in page, and nothing changes
    user, key = make_user("plain")
    other = Client()
    other.force_login(user)
    r = other.post("/admin/adapters/adapteraction/add/", {"action": "remove", "name": "ink", "scale_default": "1"})
    assert r.status_code == 302 and "/admin/login/" in r["Location"] and registry.get("ink") is not None
    assert client_for(key).get("/v1/adapters").status_code == 200
