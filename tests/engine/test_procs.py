"""engine.procs.stop: a child that honours the signal exits by it; one that ignores it is killed after the wait."""

from __future__ import annotations

import signal
import subprocess
import sys

from engine import procs

# the child says "ready" once its handler is set, so the signal cannot arrive before it
_IGNORES = "import signal, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); sys.stdin.read()"


def test_a_child_that_honours_the_signal_exits_by_it() -> None:
    with subprocess.Popen([sys.executable, "-c", "import sys; print('ready', flush=True); sys.stdin.read()"],
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
