"""One named daemon thread with a stop flag: the engine's background loops (route refresh, elections,
the Node Manager's ticks, Collaboration services) start and stop the same way.

Every engine thread is a daemon (a stuck one must not keep its process alive) named ``onepiece-...``
(the test suite's leak check finds a thread left running by that name).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Background:
    """Runs ``target(*args)`` in a daemon thread named ``name`` from :meth:`start` until :meth:`stop`;
    the target watches :attr:`stopping` and returns once it is set."""

    def __init__(self, name: str, target: Callable[..., Any], *args: Any) -> None:
        if not name.startswith("onepiece"):
            raise ValueError(f"engine threads are named onepiece-...; got {name!r}")
        self.name = name
        self.stopping = threading.Event()
        self._target, self._args = target, args
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._target, args=self._args, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the loop to end and wait up to ``timeout`` seconds for it."""
        self.stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()
