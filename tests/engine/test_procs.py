"""engine.procs: stop ends a child that honours the signal by it and kills one that ignores it after the wait;
released_together starts replicas at one instant, after every one is ready, and joins them afterwards."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from typing import Any

from engine import procs

# the child says "ready" once its handler is set, so the signal cannot arrive before it
_IGNORES = "import signal, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); sys.stdin.read()"


def test_a_child_that_honours_the_signal_exits_by_it() -> None:
    # the child restores Python's SIGINT handler itself: a test run started in the background (CI under
    # nohup, `&` in a script) hands its children SIGINT ignored, and Python then installs no handler
    honours = ("import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
               "print('ready', flush=True); sys.stdin.read()")
    with subprocess.Popen([sys.executable, "-c", honours],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as p:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        procs.stop(p, signal.SIGINT, timeout=30)
    assert p.returncode != 0 and p.returncode != -signal.SIGKILL  # ended by the SIGINT (KeyboardInterrupt)


def test_a_child_that_ignores_the_signal_is_killed_after_the_wait() -> None:
    with subprocess.Popen([sys.executable, "-c", _IGNORES], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          text=True) as p:
        assert p.stdout is not None and p.stdout.readline() == "ready\n"
        procs.stop(p, timeout=0.5)
    assert p.returncode == -signal.SIGKILL
    procs.stop(p)  # an ended process: nothing to do, no error


def _replica(ready: Any, go: Any, out: Any) -> None:
    ready.put(os.getpid())
    go.wait()
    out.put(time.perf_counter())


def test_replicas_are_released_together_after_every_one_is_ready() -> None:
    ctx = mp.get_context("spawn")
    ready, out, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    replicas = [ctx.Process(target=_replica, args=(ready, go, out), daemon=True) for _ in range(2)]
    with procs.released_together(replicas, ready, go, timeout=60) as t0:
        started = [out.get(timeout=60) for _ in replicas]
        assert go.is_set() and all(t >= t0 for t in started)  # none began before the release
    assert all(p.exitcode == 0 for p in replicas)  # joined afterwards
