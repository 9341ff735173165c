"""``onepiece up --object-store``: none by default, a URL checked before anything starts, or an embedded
Swift s3api server supervised like Redis (real servers; tests/e2e/test_up_object_store.py drives it whole)."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path

import pytest

from engine.embedded import ServiceError, free_port
from engine.embedded.supervisor import Supervisor
from engine.store.objects import ObjectStore
from onepiece_launcher.up import _start_object_store


def _start(choice: str | None, tmp_path: Path, stack: ExitStack) -> tuple[str, Supervisor, list[str]]:
    said: list[str] = []
    sup = Supervisor(tmp_path, said.append)
    return _start_object_store(choice, stack, sup, tmp_path, "127.0.0.1"), sup, said


def test_none_is_redis_only(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("ONEPIECE_OBJECT_STORE", "http://127.0.0.1:1/b")  # the flag wins
    with ExitStack() as stack:
        url, sup, _ = _start("none", tmp_path, stack)
    assert url == "none" and sup.children == {}
    assert "object store: none (outputs in Redis)" in capsys.readouterr().out


def test_default_is_the_embedded_store(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("ONEPIECE_OBJECT_STORE", raising=False)
    with ExitStack() as stack:
        url, sup, _ = _start(None, tmp_path, stack)
        assert list(sup.children) == ["s3"] and url.endswith("/onepiece-outputs")


def test_a_url_is_checked_and_its_bucket_made(tmp_path: Path, s3_server, monkeypatch) -> None:
    url = s3_server.url.rsplit("/", 1)[0] + "/made-by-up"
    monkeypatch.setenv("ONEPIECE_OBJECT_STORE", url)  # the environment's, when no flag is given
    with ExitStack() as stack:
        got, sup, _ = _start(None, tmp_path, stack)
    assert got == url and sup.children == {}
    store = ObjectStore.from_url(url)
    store.put("x", b"1")  # the bucket exists now
    store.close()


@pytest.mark.parametrize("bad", ["ftp://h/b", "http://127.0.0.1:1", "unreachable"])
def test_a_bad_or_unreachable_store_is_refused_before_anything_starts(tmp_path: Path, bad: str) -> None:
    if bad == "unreachable":
        bad = f"http://k:s@127.0.0.1:{free_port()}/b"
    with ExitStack() as stack, pytest.raises(ServiceError, match="--object-store"):
        _start(bad, tmp_path, stack)


def test_embedded_is_a_supervised_swift(tmp_path: Path) -> None:
    with ExitStack() as stack:
        url, sup, _ = _start("embedded", tmp_path, stack)
        child = sup.children["s3"]
        assert child.proc.poll() is None
        store = ObjectStore.from_url(url)
        assert store.put("y", b"2").size == 1 and store.get("y") == b"2"
        store.close()
    assert child.proc.poll() is not None  # stopped with the launcher
    assert (tmp_path / "s3" / "s3-credentials.json").exists()


def test_the_embedded_store_on_loopback_is_the_public_endpoint(monkeypatch) -> None:
    """Result URLs are presigned GETs from the embedded store on loopback (reachable on this machine); a
    store given by URL, or an explicit ONEPIECE_OBJECT_STORE_PUBLIC_URL, is the operator's to declare."""
    from onepiece_launcher.up import _public_store_env

    monkeypatch.delenv("ONEPIECE_OBJECT_STORE_PUBLIC_URL", raising=False)
    monkeypatch.delenv("ONEPIECE_OBJECT_STORE", raising=False)
    url = "http://onepiece%3Aengine:s3cret@127.0.0.1:40127/onepiece-outputs"
    assert _public_store_env(None, url) == {"ONEPIECE_OBJECT_STORE_PUBLIC_URL": "http://127.0.0.1:40127"}
    assert _public_store_env("embedded", url.replace("127.0.0.1", "10.0.0.5")) == {}  # bound beyond loopback
    assert _public_store_env("http://k:s@127.0.0.1:9000/b", "http://k:s@127.0.0.1:9000/b") == {}
    monkeypatch.setenv("ONEPIECE_OBJECT_STORE_PUBLIC_URL", "https://s3.example.net")
    assert _public_store_env("embedded", url) == {}  # already set: passed on as it is
