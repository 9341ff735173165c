"""Ending a child process: a signal to shut down cleanly, a bounded wait, then a kill (what an operator does)."""

from __future__ import annotations

import signal
import subprocess
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
