"""Run the ledger reconciler until SIGINT/SIGTERM (one per deployment is enough; more are harmless)."""

from __future__ import annotations

import signal
import threading
from typing import Any

from django.core.management.base import BaseCommand

from onepiece_platform.engine_link.reconciler import Reconciler


class Command(BaseCommand):
    help = "Move ledger rows to their engine states from the event stream; fail jobs the engine lost."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--once", action="store_true", help="one sweep and one batch of events, then exit")
        parser.add_argument("--sweep-every", type=float, default=10.0)

    def handle(self, *args: Any, **opts: Any) -> None:
        r = Reconciler()
        if opts["once"]:
            n = r.sweep()
            m = r.step()
            self.stdout.write(f"swept {n} finished, applied {m} events")
            return
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        self.stdout.write("reconciler running")
        r.run(stop, opts["sweep_every"])
