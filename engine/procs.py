"""Child processes: ending one (a signal, a bounded wait, then a kill, as an operator does), and running a
set of benchmark replicas released at the same instant."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any


def stop(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = 60.0,
         kill_timeout: float = 10.0) -> None:
    """Send ``sig`` to ``proc`` if it still runs and wait ``timeout`` seconds for it to exit; one that has not
    is killed (SIGKILL) and waited for ``kill_timeout`` more."""
    if proc.poll() is None:
        proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(kill_timeout)


@contextmanager
def released_together(procs: Sequence[Any], ready: Any, go: Any, timeout: float = 300.0) -> Iterator[float]:
    """Start the ``multiprocessing`` processes ``procs``, take one message per process from the ``ready``
    queue (each has loaded its model), then set ``go`` so that all start at once: yields when that was
    (``time.perf_counter``), so that loading is never timed. Afterwards each is joined, killed if stuck."""
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=timeout)
        t0 = time.perf_counter()
        go.set()
        yield t0
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
