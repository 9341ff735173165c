"""API keys: shown once, stored hashed, Bearer only, revocable, expiring; failed attempts rate-limited."""

from __future__ import annotations

import datetime as dt

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from onepiece_platform.accounts.models import ApiKey, hash_secret
from tests.fixtures.web import client_for, make_user

pytestmark = pytest.mark.django_db


def _session(user) -> APIClient:
    c = APIClient()
    c.force_login(user)
    return c


def test_key_is_shown_once_and_stored_hashed(alice) -> None:
    user, _, _ = alice
    c = _session(user)
    r = c.post("/api/v1/keys", {"name": "ci"}, format="json")
    assert r.status_code == 201
    raw = r.json()["key"]
    prefix, secret = raw.split("_", 2)[1:]
    row = ApiKey.objects.get(prefix=prefix)
    assert row.secret_hash == hash_secret(secret) and secret not in row.secret_hash
    listed = c.get("/api/v1/keys").json()
    assert all("key" not in k for k in listed) and {k["prefix"] for k in listed} >= {prefix}
    assert client_for(raw).get("/api/v1/workflows").status_code == 200


def test_bearer_only(alice) -> None:
    _, _, key = alice
    for header in (f"Token {key}", key, f"Basic {key}"):
        c = APIClient()
        c.credentials(HTTP_AUTHORIZATION=header)
        assert c.get("/api/v1/workflows").status_code == 401
    assert APIClient().get("/api/v1/workflows", {"api_key": key}).status_code == 401
    r = APIClient().get("/api/v1/workflows")
    assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Bearer")


def test_wrong_secret_revoked_and_expired_keys_are_refused(alice) -> None:
    user, c, key = alice
    prefix = key.split("_")[1]
    assert client_for(f"op_{prefix}_wrong").get("/api/v1/workflows").status_code == 401
    row = ApiKey.objects.get(prefix=prefix)
    assert c.delete(f"/api/v1/keys/{row.pk}").status_code == 200
    assert c.get("/api/v1/workflows").status_code == 401
    row2, raw2 = ApiKey.issue(user, expires_at=timezone.now() + dt.timedelta(seconds=60))
    assert client_for(raw2).get("/api/v1/workflows").status_code == 200
    ApiKey.objects.filter(pk=row2.pk).update(expires_at=timezone.now() - dt.timedelta(seconds=1))
    assert client_for(raw2).get("/api/v1/workflows").status_code == 401


def test_another_users_key_is_404_to_revoke(alice, bob) -> None:
    _, _, bob_key = bob
    row = ApiKey.objects.get(prefix=bob_key.split("_")[1])
    assert alice[1].delete(f"/api/v1/keys/{row.pk}").status_code == 404
    assert ApiKey.objects.get(pk=row.pk).revoked_at is None


def test_expiry_in_the_past_is_400(alice) -> None:
    r = _session(alice[0]).post("/api/v1/keys", {"expires_at": "2000-01-01T00:00:00Z"}, format="json")
    assert r.status_code == 400 and r.json()["field"] == "expires_at"


def test_failed_authentication_is_rate_limited(settings, web_redis) -> None:
    settings.ONEPIECE = {**settings.ONEPIECE, "AUTH_FAILURES_LIMIT": 3, "AUTH_FAILURES_WINDOW_S": 30}
    _, good = make_user("carol")
    bad = client_for("op_nothere_nothing")
    assert [bad.get("/api/v1/workflows").status_code for _ in range(3)] == [401] * 3
    r = bad.get("/api/v1/workflows")
    assert r.status_code == 429 and 1 <= int(r.headers["Retry-After"]) <= 30
    # the guesser is locked out; a valid key from the same address (a shared NAT) is not
    assert client_for(good).get("/api/v1/workflows").status_code == 200
    assert bad.get("/api/v1/workflows").status_code == 429


def test_ensure_demo_user_is_idempotent(db, web_redis, tmp_path) -> None:
    from io import StringIO

    from django.core.management import call_command

    outs = []
    for _ in range(2):
        out = StringIO()
        call_command("ensure_demo_user", key_file=str(tmp_path / "k"), stdout=out)
        outs.append(out.getvalue().strip())
    assert outs[0] == outs[1] and outs[0].startswith("api key: op_")
    assert ApiKey.objects.filter(user__username="demo").count() == 1
    assert client_for(outs[0].split(": ", 1)[1]).get("/api/v1/workflows").status_code == 200
    assert (tmp_path / "k").stat().st_mode & 0o777 == 0o600


def test_behind_a_proxy_failures_count_per_forwarded_client(settings, web_redis) -> None:
    settings.ONEPIECE = {**settings.ONEPIECE, "AUTH_FAILURES_LIMIT": 2, "TRUSTED_PROXY_HOPS": 1}
    _, good = make_user("dave")
    bad = client_for("op_nothere_nothing")
    for _ in range(3):  # the attacker forges a left-hand entry; the proxy's own entry is what counts
        bad.get("/api/v1/workflows", HTTP_X_FORWARDED_FOR="1.2.3.4, 10.0.0.66")
    assert bad.get("/api/v1/workflows", HTTP_X_FORWARDED_FOR="9.9.9.9, 10.0.0.66").status_code == 429
    # another client behind the same ingress is not locked out
    assert client_for(good).get("/api/v1/workflows", HTTP_X_FORWARDED_FOR="10.0.0.77").status_code == 200
