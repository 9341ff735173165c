"""One ``onepiece up`` per state folder: an exclusive lock on ``<state>/lock`` for as long as it runs.

A second ``onepiece up`` on the same folder would start its own redis and etcd
over the first one's data directories and fail in ways that do not say why
("etcd did not become ready within 20.0s"). The lock is ``flock(2)`` on a file
in the folder: the kernel drops it when the last descriptor of that open file
closes, however its holders exit (Ctrl-C, a crash, SIGKILL), so a stale lock
never blocks the next run. The launcher's children inherit the descriptor
(:mod:`engine.embedded.children`): while anything the last ``onepiece up``
started still runs, the folder stays locked and the refusal names those
processes. The file names the launcher's pid for the message.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from types import TracebackType

from engine.embedded.services import ServiceError

LOCK_FILE = "lock"


class StateInUse(ServiceError):
    """Another process holds the state folder's lock; the message names it and what to do."""


class StateLock:
    """``with StateLock(state):`` holds ``<state>/lock`` or raises :class:`StateInUse` at once (never waits)."""

    def __init__(self, state: Path) -> None:
        self.state = Path(state)
        self.path = self.state / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> StateLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            recorded = os.read(fd, 64).decode(errors="replace").strip()
            os.close(fd)
            raise StateInUse(self._refusal(recorded)) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    @property
    def fd(self) -> int | None:
        """The lock's descriptor while held (children given it hold the lock with this process)."""
        return self._fd

    def _refusal(self, recorded: str) -> str:
        holders = holders_of(self.path)
        launcher = int(recorded) if recorded.isdigit() else None
        if launcher is not None and launcher not in holders and holders:
            # the launcher is gone (killed), what it started still runs and holds the folder
            named = ", ".join(f"{pid} ({cmd})" for pid, cmd in sorted(holders.items()))
            return (f"the state folder {self.state} is still held by processes an earlier onepiece up "
                    f"(pid {launcher}) started and left when it was killed: {named}. They were sent SIGTERM "
                    f"when it died and normally stop within seconds; if they do not, stop them "
                    f"(kill {' '.join(str(p) for p in sorted(holders))}) and run onepiece up again")
        return (f"another onepiece up (pid {recorded or 'unknown'}) is already running with the state folder "
                f"{self.state}; stop it first (Ctrl-C in its terminal), or give this one another --state-dir")

    def release(self) -> None:
        """Close this process's descriptor. No ``LOCK_UN``: the lock belongs to the open file, which
        children may share (:mod:`engine.embedded.children`), and unlocking would free the folder under
        a child still running; the kernel frees it when the last descriptor closes."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> StateLock:
        return self.acquire()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()


def holders_of(path: Path) -> dict[int, str]:
    """The processes with ``path`` open, by pid, with their command lines (shortened): those whose
    ``/proc/<pid>/fd`` this user may read (all of them for root, its own processes otherwise)."""
    target = os.path.realpath(path)
    found: dict[int, str] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            for fd in os.scandir(f"/proc/{entry.name}/fd"):
                if os.readlink(fd.path) == target:
                    with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                        argv = f.read().split(b"\0")
                    found[int(entry.name)] = " ".join(a.decode(errors="replace") for a in argv if a)[:80]
                    break
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found
