"""Run the webhook delivery worker until SIGINT/SIGTERM (any number may run at once: claims do not
overlap; a killed one's claims are sent again by the others, or by it once restarted)."""

from __future__ import annotations

import signal
import threading
from typing import Any

from django.core.management.base import BaseCommand

from onepiece_platform import conf
from onepiece_platform.webhooks.delivery import Deliverer


class Command(BaseCommand):
    help = "Send the completion webhooks in the outbox: signed, retried with backoff for up to 24 h."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--once", action="store_true", help="send what is due now, one by one, then exit")
        parser.add_argument("--concurrency", type=int, default=None,
                            help=f"attempts in flight (default WEBHOOK_CONCURRENCY, {conf.get('WEBHOOK_CONCURRENCY')})")

    def handle(self, *args: Any, **opts: Any) -> None:
        d = Deliverer()
        if opts["once"]:
            states = d.run_once()
            self.stdout.write(f"attempted {len(states)}: {states.count('delivered')} delivered")
            return
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        self.stdout.write("webhook delivery worker running", ending="\n")
        self.stdout.flush()
        d.run(stop, opts["concurrency"])
