"""One ``onepiece up`` per state folder: an exclusive lock on ``<state>/lock`` for as long as it runs.

A second ``onepiece up`` on the same folder would start its own redis and etcd
over the first one's data directories and fail in ways that do not say why
("etcd did not become ready within 20.0s"). The lock is ``flock(2)`` on a file
in the folder: the kernel drops it when the holder exits, however it exits
(Ctrl-C, a crash, SIGKILL), so a stale lock never blocks the next run, and
children do not inherit it (Python opens files non-inheritable). The file
names the holder's pid for the message.
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
            holder = os.read(fd, 64).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StateInUse(f"another onepiece up (pid {holder}) is already running with the state folder "
                             f"{self.state}; stop it first (Ctrl-C in its terminal), or give this one another "
                             "--state-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> StateLock:
        return self.acquire()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
