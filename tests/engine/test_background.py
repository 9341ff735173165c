"""engine.background: a named daemon loop that stops when asked."""

from __future__ import annotations

import time

import pytest

from engine.background import Background


def test_runs_until_stopped_as_a_named_daemon() -> None:
    ticks: list[int] = []

    def loop(step: int) -> None:
        while not bg.stopping.wait(0.01):
            ticks.append(step)

    bg = Background("onepiece-test-loop", loop, 1)
    bg.start()
    assert bg.alive and bg._thread is not None and bg._thread.daemon and bg._thread.name == "onepiece-test-loop"
    while not ticks:
        time.sleep(0.005)
    bg.stop()
    assert not bg.alive and set(ticks) == {1}


def test_engine_threads_carry_the_engine_prefix() -> None:
    with pytest.raises(ValueError, match="onepiece"):
        Background("worker", lambda: None)
