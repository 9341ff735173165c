"""The embedded S3 server (engine.embedded.s3): a real Swift s3api, its secret kept private and across restarts."""

from __future__ import annotations

import stat

import pytest

from engine.embedded.s3 import SwiftS3Server
from engine.embedded.services import ServiceError
from engine.store.objects import ObjectStore


def test_restart_keeps_credentials_port_and_objects(tmp_path) -> None:
    server = SwiftS3Server(tmp_path / "s3").start()
    try:
        store = ObjectStore.from_url(server.url)
        ref = store.put("results/u1", b"kept across restarts")
        url = server.url
        signed = store.presign_get("results/u1", 300)
    finally:
        server.stop()
    assert server.proc is not None and server.proc.poll() is not None
    creds = tmp_path / "s3" / "s3-credentials.json"
    assert stat.S_IMODE(creds.stat().st_mode) == 0o600
    assert server.secret_key not in " ".join(server._argv("python"))  # never on a command line

    again = SwiftS3Server(tmp_path / "s3", port=server.port).start()
    try:
        assert again.url == url  # clients' URLs stay valid ...
        store = ObjectStore.from_url(again.url)
        assert store.head("results/u1") == ref and store.get("results/u1") == b"kept across restarts"
        import urllib.request

        with urllib.request.urlopen(signed.url, timeout=10) as r:  # ... and so do the URLs it signed
            assert r.read() == b"kept across restarts"
        store.close()
    finally:
        again.stop()


def test_another_folder_has_another_secret(tmp_path) -> None:
    a, b = SwiftS3Server(tmp_path / "a"), SwiftS3Server(tmp_path / "b")
    assert a.secret_key != b.secret_key and len(a.secret_key) >= 32


def test_missing_swift_says_how_to_get_it(tmp_path, monkeypatch) -> None:
    import importlib.util
    import sys

    monkeypatch.delenv("ONEPIECE_S3_PYTHON", raising=False)
    monkeypatch.setattr(sys, "prefix", str(tmp_path))  # a virtual environment without its s3-venv
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "swift" else real(name, *a))
    with pytest.raises(ServiceError, match="quickstart installs it"):
        SwiftS3Server(tmp_path / "s3").start()


def test_swift_runs_in_its_own_environment(tmp_path, monkeypatch) -> None:
    """Not the project's: with eventlet importable there, futurist (under etcd3gw) imports it in every engine
    process. The project's environment has neither; the server's interpreter is <venv>/s3-venv's."""
    import importlib.util
    import sys
    from pathlib import Path

    monkeypatch.delenv("ONEPIECE_S3_PYTHON", raising=False)
    assert importlib.util.find_spec("eventlet") is None and importlib.util.find_spec("swift") is None
    assert SwiftS3Server(tmp_path / "s3")._resolve() == str(Path(sys.prefix) / "s3-venv" / "bin" / "python")


@pytest.mark.parametrize("headers,path", [
    ({"X-Auth-Token": "AUTH_tk" + "0" * 32}, "/v1/AUTH_onepiece/onepiece-outputs/results/u1"),  # a made-up token
    ({"X-Storage-Token": "AUTH_tk" + "0" * 32}, "/v1/AUTH_onepiece"),
    ({"X-Auth-User": "onepiece:engine", "X-Auth-Key": "a guess"}, "/auth/v1.0"),
    ({}, "/v1/AUTH_onepiece/onepiece-outputs/results/u1"),  # no token at all
])
def test_swift_own_auth_is_refused_with_a_401(s3_server, headers: dict[str, str], path: str) -> None:
    """The store is reached through its S3 layer only: Swift's token API answers 401 (a made-up token was a
    500: tempauth looked it up in a memcache the embedded store does not run), never an object."""
    import urllib.error
    import urllib.request

    store = ObjectStore.from_url(s3_server.url)
    store.ensure_bucket()
    store.put("results/u1", b"not for Swift tokens")
    req = urllib.request.Request(s3_server.endpoint + path, headers=headers)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=10)
    assert e.value.code == 401 and b"not for Swift tokens" not in e.value.read()
    assert store.get("results/u1") == b"not for Swift tokens"  # S3 requests are served as before
    store.close()

