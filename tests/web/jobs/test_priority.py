"""Request priorities on the platform: the native API and both OpenAI routes take ``priority`` (``low``,
``normal``, ``high``); anything else is a 400 naming it, more than the API key's tier allows a 403 naming it;
the ledger row records it and the engine's message carries it to every stage."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from engine.store import keys
from engine.workflow import message as wm
from onepiece_platform.accounts.models import ApiKey
from onepiece_platform.jobs.models import Job
from tests.fixtures.web import client_for, make_user, sd_body

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")


def _header_priority(store: Any, uid: str) -> int:
    """The priority in the message the engine keeps for the job (the one its first stage is handed)."""
    return wm.decode(store.r.get(keys.input_key(uid))).header.priority


def test_native_api_priority_tiers(alice, store) -> None:
    _, c, _ = alice
    r = c.post("/api/v1/jobs", {**sd_body(), "priority": "urgent"}, format="json")
    assert r.status_code == 400 and r.json()["field"] == "priority"
    r = c.post("/api/v1/jobs", {**sd_body(), "priority": "high"}, format="json")  # an ordinary key: normal at most
    assert r.status_code == 403 and r.json()["field"] == "priority" and "normal" in r.json()["detail"]
    assert not Job.objects.exists()  # refused before anything was written or sent
    r = c.post("/api/v1/jobs", {**sd_body(), "priority": "low"}, format="json")
    assert r.status_code == 202 and r.json()["priority"] == "low"
    low = r.json()["uid"]
    r = c.post("/api/v1/jobs", sd_body(), format="json")  # the default
    assert r.status_code == 202 and r.json()["priority"] == "normal"
    assert Job.objects.get(uid=low).priority == "low" and _header_priority(store, low) == -1
    assert _header_priority(store, r.json()["uid"]) == 0

    assert {k["max_priority"] for k in c.get("/api/v1/keys").json()} == {"normal"}  # the key's tier, listed
    staff, key = make_user("ops", is_staff=True)  # staff keys may use high
    r = client_for(key).post("/api/v1/jobs", {**sd_body(), "priority": "high"}, format="json")
    assert r.status_code == 202 and _header_priority(store, r.json()["uid"]) == 1
    ApiKey.objects.filter(user=staff).update(max_priority="normal")  # a key's own tier overrides its owner's
    r = client_for(key).post("/api/v1/jobs", {**sd_body(), "priority": "high"}, format="json")
    assert r.status_code == 403 and r.json()["field"] == "priority"


def test_openai_routes_take_priority_through_extra_body(oa) -> None:
    client, user = oa
    for bad, status in (("urgent", openai.BadRequestError), ("high", openai.PermissionDeniedError)):
        with pytest.raises(status) as e:
            client.images.generate(prompt="a cat", size="64x64", extra_body={"priority": bad,
                                                                               "num_inference_steps": 2})
        assert e.value.body["param"] == "priority"
        with pytest.raises(status) as e:
            client.videos.create(prompt="a cat", size="64x64", model="wan2.1-t2v",
                                 extra_body={"priority": bad, "num_inference_steps": 2})
        assert e.value.body["param"] == "priority"
    assert e.value.body["type"] == "permission_error"
    assert not Job.objects.exists()
    v = client.videos.create(prompt="a cat", size="64x64", model="wan2.1-t2v",
                             extra_body={"priority": "low", "num_inference_steps": 2})
    assert Job.objects.get(uid=v.id).priority == "low"


def test_one_vocabulary_from_the_engine_to_the_ledger() -> None:
    """The platform's priority names, their order and the ledger's choices are the engine's enumeration,
    and each name reaches the header as the engine's level."""
    from engine.dispatch.order import LEVELS
    from engine.workflow.options import Priority
    from onepiece_platform.accounts.models import PRIORITIES, PriorityTier
    from onepiece_platform.jobs.api.openai_serializers import ImageGenerateSerializer

    names = [p.value for p in Priority]
    assert list(PRIORITIES) == names == sorted(LEVELS, key=LEVELS.__getitem__)  # lowest first
    for field in (Job._meta.get_field("priority"), PriorityTier._meta.get_field("max_priority"),
                  ApiKey._meta.get_field("max_priority")):
        assert [value for value, _ in field.choices] == names, field
    assert list(ImageGenerateSerializer().fields["priority"].choices) == names
