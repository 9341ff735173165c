"""Run the webhook delivery worker until SIGINT/SIGTERM (any number may run at once: claims do not
overlap; a killed one's claims are sent again by the others, or by it once restarted). It also uploads
outputs to the clients' ``output_upload_url``s (:mod:`onepiece_platform.webhooks.uploads`), on a thread of
its own, under the same egress policy."""

from __future__ import annotations

import threading
from typing import Any

from onepiece_platform import conf
from onepiece_platform.loop_command import LoopCommand
from onepiece_platform.webhooks.delivery import Deliverer
from onepiece_platform.webhooks.uploads import Uploader


class Command(LoopCommand):
    help = ("Send the completion webhooks in the outbox (signed, retried with backoff for up to 24 h) and upload "
            "outputs to the clients' output_upload_url.")
    running = "webhook delivery worker running"

    def add_arguments(self, parser: Any) -> None:
        super().add_arguments(parser)
        parser.add_argument("--concurrency", type=int, default=None,
                            help=f"attempts in flight (default WEBHOOK_CONCURRENCY, {conf.get('WEBHOOK_CONCURRENCY')})")

    def worker(self) -> Deliverer:
        return Deliverer()

    def run_once(self, worker: Deliverer, opts: dict[str, Any]) -> str:
        """Send what is due now, one by one (webhooks, then output uploads)."""
        states = worker.run_once()
        uploads = Uploader().run_once()
        return (f"attempted {len(states)}: {states.count('delivered')} delivered; "
                f"uploads attempted {len(uploads)}: {uploads.count('uploaded')} uploaded")

    def run_loop(self, worker: Deliverer, stop: threading.Event, opts: dict[str, Any]) -> None:
        uploads = threading.Thread(target=Uploader().run, args=(stop,), name="output-uploads", daemon=True)
        uploads.start()
        try:
            worker.run(stop, opts["concurrency"])
        finally:
            stop.set()
            uploads.join(float(conf.get("OUTPUT_UPLOAD_TIMEOUT_S")) + 5)
