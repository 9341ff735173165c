"""etcd with authentication on (issue 16): only the engine user, only the engine's keys, tokens renewed
behind the callers' backs, passwords never shown, and ``onepiece etcd-auth`` idempotent."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from etcd3gw.exceptions import Etcd3Exception

from engine.coord import EtcdAuthError, etcd_client
from engine.coord.auth import auth_enabled, ensure_auth
from engine.embedded import EtcdServer

REPO = Path(__file__).resolve().parents[3]
PASSWORD = "pa:ss@/word%"  # reserved characters: they travel percent-encoded in the URL


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer("etcd", tmp_path / "etcd", password=PASSWORD, root_password="root-pw").start()
    yield server
    server.stop()


def test_only_the_engine_user_gets_in_and_only_to_the_engine_keys(secured: EtcdServer) -> None:
    assert auth_enabled(secured.plain_url)
    client = etcd_client(secured.url)
    client.put("/onepiece/routes/x", "1")
    lease = client.lease(5)
    client.put("/onepiece/nodes/n", "up", lease=lease)
    assert lease.refresh() > 0 and client.get("/onepiece/routes/x") == [b"1"]
    assert len(client.get_prefix("/onepiece/")) == 2
    with pytest.raises(Etcd3Exception, match="Forbidden"):  # outside the engine's prefix
        client.put("/elsewhere", "1")
    with pytest.raises(Etcd3Exception, match="Forbidden"):
        client.get("/onepiecex")
    with pytest.raises(Etcd3Exception):  # anonymous: refused before any key is looked at
        etcd_client(secured.plain_url).get("/onepiece/routes/x")
    with pytest.raises(EtcdAuthError, match="refused user 'onepiece'"):
        etcd_client(secured.url.replace("pa%3Ass", "guess")).get("/onepiece/routes/x")
    # the password is nowhere a log line or an error could show it
    shown = f"{client!r} {client.endpoints} {client.url}"
    assert "ss@/word" not in shown and "pa%3Ass" not in shown


def test_revoked_tokens_are_renewed_under_concurrent_callers_and_a_rotated_password_locks_out(
        secured: EtcdServer) -> None:
    client = etcd_client(secured.url)
    errors: list[BaseException] = []

    def writer(i: int) -> None:
        try:
            for j in range(40):
                client.put(f"/onepiece/t/{i}/{j}", str(j))
        except BaseException as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    session = client.clients[0].session
    tokens = set()
    for _ in range(3):  # the same password set again: etcd drops every token the user holds
        ensure_auth(secured.plain_url, "root-pw", PASSWORD)
        tokens.add(session._token)
    for t in threads:
        t.join(60)
    assert not errors, errors[:3]
    assert len(client.get_prefix("/onepiece/t/")) == 6 * 40  # nothing lost across the renewals
    client.get("/onepiece/t/0/0")
    assert len(tokens | {session._token}) >= 2  # it did authenticate again
    # rotation: the old password stops working as soon as its tokens are dropped
    ensure_auth(secured.plain_url, "root-pw", "new-password")
    with pytest.raises(EtcdAuthError):
        client.get("/onepiece/t/0/0")
    renamed = secured.url.replace("pa%3Ass%40%2Fword%25", "new-password")
    assert etcd_client(renamed).get("/onepiece/t/0/0") == [b"0"]


def test_the_etcd_auth_command_enables_once_then_updates(tmp_path: Path) -> None:
    plain = EtcdServer("etcd", tmp_path / "etcd").start()
    try:
        env = {**os.environ, "ETCD_ROOT_PASSWORD": "r00t", "ETCD_ONEPIECE_PASSWORD": "engine-pw"}

        def run(**extra: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "engine.cli", "etcd-auth", "--etcd-url", plain.url],
                                  env={**env, **extra}, cwd=REPO, capture_output=True, text=True, timeout=60)

        assert not auth_enabled(plain.url)
        first = run()
        assert first.returncode == 0 and "authentication enabled" in first.stdout, first
        assert auth_enabled(plain.url)
        again = run()
        assert again.returncode == 0 and "already on" in again.stdout, again
        wrong_root = run(ETCD_ROOT_PASSWORD="not-root")
        assert wrong_root.returncode == 1 and "authenticate as root failed" in wrong_root.stdout, wrong_root
        missing = run(ETCD_ONEPIECE_PASSWORD="")
        assert missing.returncode == 2 and "ETCD_ONEPIECE_PASSWORD" in missing.stdout
        assert "engine-pw" not in first.stdout + again.stdout + wrong_root.stdout
        engine = etcd_client(plain.url.replace("http://", "http://onepiece:engine-pw@"))
        engine.put("/onepiece/ok", "1")
        assert engine.get("/onepiece/ok") == [b"1"]
    finally:
        plain.stop()


def test_a_client_started_before_auth_is_on_keeps_working_across_the_switch(tmp_path: Path) -> None:
    """A deployment's processes may start before `onepiece etcd-auth` has run (nothing orders a Kubernetes
    Job before the Deployments): they work without a token, then authenticate once etcd asks for one."""
    plain = EtcdServer("etcd", tmp_path / "etcd").start()
    try:
        early = etcd_client(plain.url.replace("http://", "http://onepiece:engine-pw@"))
        early.put("/onepiece/before", "1")
        assert early.get("/onepiece/before") == [b"1"]
        ensure_auth(plain.url, "r00t", "engine-pw")
        early.put("/onepiece/after", "2")  # the same client: "user name is empty", then a token
        assert early.get("/onepiece/after") == [b"2"]
        with pytest.raises(Etcd3Exception):
            etcd_client(plain.url).get("/onepiece/after")
        assert "engine-pw" not in repr(early.clients[0].session.__dict__.get("_token"))
    finally:
        plain.stop()


def test_a_custom_root_is_the_engine_users_prefix_and_a_stale_root_password_is_reset(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONEPIECE_ETCD_ROOT", "/staging")
    plain = EtcdServer("etcd", tmp_path / "etcd").start()
    try:
        anon = etcd_client(plain.url)
        # an aborted earlier run left a root user with another password, auth still off
        import requests

        requests.post(plain.url + "/v3/auth/user/add", json={"name": "root", "password": "old"}, timeout=5)
        assert ensure_auth(plain.url, "new-root", "engine-pw")  # enabled now
        assert not ensure_auth(plain.url, "new-root", "engine-pw")  # root's password is the new one
        engine = etcd_client(plain.url.replace("http://", "http://onepiece:engine-pw@"))
        engine.put("/staging/routes/x", "1")
        assert engine.get("/staging/routes/x") == [b"1"]
        with pytest.raises(Etcd3Exception, match="Forbidden"):
            engine.put("/onepiece/routes/x", "1")
        with pytest.raises(Etcd3Exception):
            anon.get("/staging/routes/x")
    finally:
        plain.stop()
