"""The priority tier belongs to the user: every key and signed-in session of the user is capped by it, a new
key inherits it, an operator's change applies at once to all of them, and a key's own setting only lowers it.
A request that names no priority runs at the highest its key allows, up to normal."""

from __future__ import annotations

import importlib

import pytest
from django.apps import apps as django_apps
from rest_framework.test import APIClient

from onepiece_platform.accounts.models import ApiKey, PriorityTier
from onepiece_platform.jobs.models import Job
from onepiece_platform.quotas.models import Quota
from tests.fixtures.web import client_for, make_user, sd_body


def _session(user) -> APIClient:
    c = APIClient()
    c.force_login(user)
    return c


def _submit(client: APIClient, priority: str | None = None) -> tuple[int, dict]:
    body = sd_body() if priority is None else {**sd_body(), "priority": priority}
    r = client.post("/api/v1/jobs", body, format="json")
    return r.status_code, r.json()


def test_a_low_tier_user_gets_low_by_key_by_session_and_by_a_new_key(alice, store) -> None:
    user, key_client, _ = alice
    PriorityTier.objects.create(user=user, max_priority="low")
    session = _session(user)
    minted = session.post("/api/v1/keys", {"name": "fresh"}, format="json").json()
    assert minted["max_priority"] == "low"  # a new key inherits its owner's tier
    new_key = client_for(minted["key"])
    for c in (key_client, session, new_key):
        status, body = _submit(c, "normal")
        assert status == 403 and body["field"] == "priority" and "at most low" in body["detail"]
        status, body = _submit(c)  # naming none: the highest allowed, here low
        assert status == 202 and body["priority"] == "low"
    assert {k["max_priority"] for k in session.get("/api/v1/keys").json()} == {"low"}
    assert not Job.objects.exclude(priority="low").exists()


def test_an_operators_change_applies_to_every_key_and_session_at_once(alice, store) -> None:
    user, key_client, _ = alice
    Quota.objects.create(user=user, max_concurrent_jobs=10)  # six jobs stay queued (no workers here)
    session = _session(user)
    assert _submit(key_client, "high")[0] == 403 and _submit(session, "high")[0] == 403
    PriorityTier.objects.create(user=user, max_priority="high")  # the operator raises the user
    for c in (key_client, session):
        status, body = _submit(c, "high")
        assert status == 202 and body["priority"] == "high"
        assert _submit(c)[1]["priority"] == "normal"  # naming none: up to normal, never above it
    PriorityTier.objects.filter(user=user).update(max_priority="low")  # and lowers them
    for c in (key_client, session):
        assert _submit(c, "normal")[0] == 403 and _submit(c)[1]["priority"] == "low"


def test_a_keys_own_setting_only_lowers_its_owners_tier(alice, store) -> None:
    user, key_client, raw = alice
    row = ApiKey.objects.get(prefix=raw.split("_")[1])
    ApiKey.objects.filter(pk=row.pk).update(max_priority="high")  # above the owner's tier (normal): no effect
    assert _submit(key_client, "high")[0] == 403
    PriorityTier.objects.create(user=user, max_priority="high")
    ApiKey.objects.filter(pk=row.pk).update(max_priority="low")  # below it: the key is capped
    status, body = _submit(key_client, "normal")
    assert status == 403 and "this API key" in body["detail"] and "at most low" in body["detail"]
    assert _submit(key_client)[1]["priority"] == "low"
    assert _submit(_session(user), "high")[0] == 202  # the owner's other doors keep the tier


def test_staff_default_high_others_normal_unless_set(db) -> None:
    staff, _ = make_user("ops", is_staff=True)
    plain, _ = make_user("plain")
    assert ApiKey.objects.get(user=staff).max_priority_allowed == "high"
    assert ApiKey.objects.get(user=plain).max_priority_allowed == "normal"
    PriorityTier.objects.create(user=staff, max_priority="normal")
    assert ApiKey.objects.get(user=staff).max_priority_allowed == "normal"


def test_the_admin_edits_a_users_tier(db, web_redis) -> None:
    admin, _ = make_user("root", is_staff=True, is_superuser=True)
    plain, _ = make_user("plain")
    c = APIClient()
    c.force_login(admin)
    assert c.get("/admin/accounts/prioritytier/add/").status_code == 200
    r = c.post("/admin/accounts/prioritytier/add/", {"user": plain.pk, "max_priority": "low"})
    assert r.status_code == 302, r.content
    assert PriorityTier.objects.get(user=plain).max_priority == "low"
    page = c.get("/admin/accounts/prioritytier/")
    assert page.status_code == 200 and b"plain" in page.content
    keys = c.get("/admin/accounts/apikey/")  # each key's "may use": its owner's tier
    assert keys.status_code == 200 and b"May use" in keys.content


def test_the_migration_keeps_every_keys_tier(db) -> None:
    """Keys set per key before the tier moved to the user keep what they may use after it."""
    step = importlib.import_module("onepiece_platform.accounts.migrations.0003_prioritytier").tiers_from_keys
    raised, raised_key = make_user("raised")
    other = ApiKey.issue(raised)[0]  # no setting of its own: normal, as before
    lowered, _ = make_user("lowered")
    mixed, mixed_key = make_user("mixed")
    ApiKey.issue(mixed)  # one key left as it was, one lowered: the user keeps the default
    ApiKey.objects.filter(prefix=raised_key.split("_")[1]).update(max_priority="high")
    ApiKey.objects.filter(user=lowered).update(max_priority="low")
    ApiKey.objects.filter(prefix=mixed_key.split("_")[1]).update(max_priority="low")
    before = {k.pk: k.max_priority or ("high" if k.user.is_staff else "normal") for k in ApiKey.objects.all()}
    step(django_apps, None)
    assert dict(PriorityTier.objects.values_list("user__username", "max_priority")) == {"raised": "high",
                                                                                       "lowered": "low"}
    assert {k.pk: k.max_priority_allowed for k in ApiKey.objects.select_related("user")} == before
    assert ApiKey.objects.get(pk=other.pk).max_priority == "normal"  # pinned below its owner's new tier


@pytest.mark.parametrize("tier", ["low", "normal", "high"])
def test_the_listed_tier_of_a_key_is_what_it_may_use(alice, tier) -> None:
    user, key_client, _ = alice
    PriorityTier.objects.create(user=user, max_priority=tier)
    assert [k["max_priority"] for k in key_client.get("/api/v1/keys").json()] == [tier]
