"""Run the ledger reconciler until SIGINT/SIGTERM (one per deployment is enough; more are harmless)."""

from __future__ import annotations

import threading
from typing import Any

from onepiece_platform.engine_link.reconciler import Reconciler
from onepiece_platform.loop_command import LoopCommand


class Command(LoopCommand):
    help = "Move ledger rows to their engine states from the event stream; fail jobs the engine lost."
    running = "reconciler running"

    def add_arguments(self, parser: Any) -> None:
        super().add_arguments(parser)
        parser.add_argument("--sweep-every", type=float, default=10.0, metavar="SECONDS",
                            help="how often every unfinished job is checked against the engine, which finishes "
                            "those whose events were lost (default 10)")

    def worker(self) -> Reconciler:
        return Reconciler()

    def run_once(self, worker: Reconciler, opts: dict[str, Any]) -> str:
        """One sweep and one batch of events."""
        n = worker.sweep()
        m = worker.caught_up + worker.step(block=False)
        return f"swept {n} finished, applied {m} events"

    def run_loop(self, worker: Reconciler, stop: threading.Event, opts: dict[str, Any]) -> None:
        worker.run(stop, opts["sweep_every"])
