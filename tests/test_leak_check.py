"""The leak check judges engine threads by name: a daemon thread left running is a leak too."""

from __future__ import annotations

import threading

from tests.fixtures.leaks import engine_threads, leaked_threads


def test_a_leaked_daemon_engine_thread_is_caught() -> None:
    before = engine_threads()
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="onepiece-routes", daemon=True)
    t.start()
    try:
        assert leaked_threads(before, grace_s=0.05) == ["onepiece-routes"]
    finally:
        stop.set()
        t.join(5)
    assert leaked_threads(before, grace_s=0.05) == []


def test_other_threads_are_not_judged() -> None:
    before = engine_threads()
    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="asyncio_0", daemon=True)
    t.start()
    try:
        assert leaked_threads(before, grace_s=0.05) == []
    finally:
        stop.set()
        t.join(5)
