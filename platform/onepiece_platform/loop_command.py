"""The base of the management commands that run a worker loop: ``--once`` for one round, else until
SIGINT/SIGTERM (``reconcile``, ``deliver_webhooks``)."""

from __future__ import annotations

import signal
import threading
from typing import Any

from django.core.management.base import BaseCommand


class LoopCommand(BaseCommand):
    """Makes the worker (:meth:`worker`), then with ``--once`` runs one round (:meth:`run_once`) and
    writes its summary; otherwise writes ``running`` and runs :meth:`run_loop` until SIGINT or SIGTERM
    sets the event it is given. ``--once``'s help is the first line of :meth:`run_once`'s docstring
    (what one round does is said once, where it is done)."""

    running = "running"

    def add_arguments(self, parser: Any) -> None:
        once = ((self.run_once.__doc__ or "").strip() or "one round").splitlines()[0].rstrip(".")
        parser.add_argument("--once", action="store_true", help=f"{once[0].lower()}{once[1:]}, then exit")

    def worker(self) -> Any:
        """The object that does the work (a reconciler, a deliverer)."""
        raise NotImplementedError

    def run_once(self, worker: Any, opts: dict[str, Any]) -> str:
        """One round; returns the line to write."""
        raise NotImplementedError

    def run_loop(self, worker: Any, stop: threading.Event, opts: dict[str, Any]) -> None:
        """Run until ``stop`` is set."""
        raise NotImplementedError

    def handle(self, *args: Any, **opts: Any) -> None:
        worker = self.worker()
        if opts["once"]:
            self.stdout.write(self.run_once(worker, opts))
            return
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        self.stdout.write(self.running, ending="\n")
        self.stdout.flush()
        self.run_loop(worker, stop, opts)
