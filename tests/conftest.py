"""Fixtures shared by every test: real services on free loopback ports, leak checks."""

from __future__ import annotations

import os
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.embedded import EtcdServer, RedisServer

REPO_ROOT = Path(__file__).resolve().parents[1]

# The Proxy's shared secret for this run (engine.proxy.auth): every Proxy a fixture starts inherits it,
# every client sends it (the test settings read the same variable).
PROXY_TOKEN = os.environ.setdefault("ONEPIECE_PROXY_TOKEN", secrets.token_urlsafe(24))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A real redis-server for the whole test run."""
    server = RedisServer("redis-server", tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """A real single-member etcd for the whole test run."""
    server = EtcdServer("etcd", tmp_path_factory.mktemp("etcd")).start()
    yield server
    server.stop()


def _onepiece_shm() -> set[str]:
    """This test run's segments: tests name them ``test-<pid>-...`` (the ring_name fixture does).

    Segments of other processes on the host (a benchmark, another test run) are not ours to judge.
    """
    prefix = f"onepiece-test-{os.getpid()}-"
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}
    except FileNotFoundError:
        return set()


@pytest.fixture(autouse=True)
def no_leaks() -> Iterator[None]:
    """Fail a test that leaves threads or OnePiece shared-memory segments behind."""
    threads_before = set(threading.enumerate())
    shm_before = _onepiece_shm()
    yield
    leaked_shm = _onepiece_shm() - shm_before
    deadline_threads = [
        t for t in set(threading.enumerate()) - threads_before
        if t.is_alive() and not t.daemon and t.name.startswith("onepiece")
    ]
    for t in deadline_threads:
        t.join(2.0)
    leaked_threads = [t.name for t in deadline_threads if t.is_alive()]
    assert not leaked_shm, f"test leaked shared-memory segments: {sorted(leaked_shm)}"
    assert not leaked_threads, f"test leaked threads: {leaked_threads}"
