"""Stage workers below the control plane: a lower CPU priority (a higher niceness) for every worker.

Why: on a host whose cores the stage workers keep busy, the Proxy, the reconciler and the web process
share those cores with them. A refusal is decided without I/O in well under a millisecond of CPU, so
its latency under load is the Proxy's wait for a core; with the workers at the same priority that wait
is a scheduler slice behind a denoise step (the p99 refusals of ``benchmarks/e2e.md``). With the workers
``N`` nice levels below, CFS weights them about 1.25^N times lighter (N = 10: ~9x), so a woken Proxy
runs almost at once, while the workers still take every cycle the control plane leaves idle: throughput
does not change when nothing else wants the CPU.

The increment (``--worker-nice N`` on ``onepiece node``, ``ONEPIECE_WORKER_NICE``, default 10, 0: off)
is relative to the node's own niceness, and is applied by the worker itself, first thing at start-up,
before any import starts a thread: Linux niceness is per thread, and a thread inherits its creator's,
so every thread the worker starts later (torch's and OpenMP's pools, its route refresher) runs at it.
Because each start applies it, a restarted worker gets it too. Nothing here raises a priority (that
needs privileges, and the control plane must stay above), and a host that refuses the change (EPERM,
a seccomp profile) leaves the worker at the node's priority with one warning: never a crash.
"""

from __future__ import annotations

import logging
import os

DEFAULT = 10
MAX = 19  # the lowest priority Linux has: a larger increment is clamped to it


def parse_nice(value: str | int | None) -> int:
    """The increment from an option or the environment: an integer 0..19 (``None``: the default)."""
    if value is None:
        return DEFAULT
    try:
        n = int(str(value).strip())
    except ValueError:
        n = -1
    if not 0 <= n <= MAX:
        raise ValueError(f"worker nice must be an integer 0..{MAX} (0: off), not {value!r}")
    return n


def niceness(pid: int = 0) -> int | None:
    """A process's niceness (its main thread's; 0: this process), or None when it is gone."""
    try:
        return os.getpriority(os.PRIO_PROCESS, pid)
    except OSError:  # exited, or another user's process on a hardened host
        return None


def expected(base: int, increment: int) -> int:
    """The niceness a worker started by a process at ``base`` should reach."""
    return min(MAX, base + max(0, increment))


def lower(increment: int, log: logging.Logger) -> int:
    """Lower this process's priority by ``increment`` nice levels (never raise it); its niceness after.
    Call it before the process starts any thread. A refusal is logged once and leaves it as it was."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if increment <= 0:
        return current
    try:
        return os.nice(increment)
    except OSError as exc:  # EPERM under some sandboxes: run at the node's priority rather than not at all
        log.warning("cannot lower this worker's CPU priority by %d (%s); it runs at niceness %d, beside the "
                    "control plane", increment, exc, current)
        return current
