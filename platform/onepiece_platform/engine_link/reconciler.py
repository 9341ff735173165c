"""Moves ledger rows along the engine's event stream, and sweeps what the stream cannot tell.

Two inputs, one set of idempotent transitions (:mod:`onepiece_platform.jobs.ledger`):

* ``step``: events from ``onepiece:events`` after the cursor stored in the
  database, so a restarted web process resumes where it stopped (re-reading
  an event is harmless: terminal transitions happen once, progress is
  overwritten);
* ``sweep``: every non-terminal row is checked against the engine's status.
  It catches what the stream lost: events trimmed away, or Redis restarted
  (stream, status hashes and results gone). A job the engine no longer knows,
  older than ``LOST_AFTER_S``, is reported ``failed`` with that reason, so no
  job is ever left pending.

``run`` is a control loop that never dies: each tick catches and logs.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time

from django.utils import timezone

from engine.store import keys
from onepiece_platform import conf
from onepiece_platform.engine_link.client import EngineClient, get_engine
from onepiece_platform.engine_link.models import StreamCursor
from onepiece_platform.jobs import ledger
from onepiece_platform.jobs.models import NON_TERMINAL, Job
from onepiece_platform.redis_conn import get_redis

log = logging.getLogger(__name__)
CURSOR = "events"
LOST = "lost: the engine no longer knows this job (its result store was restarted or the job expired)"


class Reconciler:
    def __init__(self, engine: EngineClient | None = None, block_ms: int = 1000, count: int = 500) -> None:
        self.engine = engine or get_engine()
        self.block_ms = block_ms
        self.count = count

    def step(self) -> int:
        """Apply the next batch of events; returns how many were read."""
        cursor, _ = StreamCursor.objects.get_or_create(name=CURSOR)
        resp = get_redis().xread({keys.EVENTS: cursor.last_id}, count=self.count, block=self.block_ms or None)
        if not resp:
            return 0
        entries = resp[0][1]
        for entry_id, raw in entries:
            f = {k.decode(): v.decode() for k, v in raw.items()}
            try:
                ledger.apply_event(f.get("uid", ""), f.get("type", ""), f.get("stage", ""),
                                   int(float(f.get("progress", 0) or 0)), float(f.get("ts", 0) or 0),
                                   f.get("detail", ""))
            except Exception:  # one bad event must not stall the stream
                log.exception("could not apply event %s", entry_id)
            cursor.last_id = entry_id.decode()
        cursor.save(update_fields=["last_id", "updated_at"])
        return len(entries)

    def sweep(self) -> int:
        """Check every unfinished job against the engine; returns how many were finished here."""
        finished = 0
        lost_before = timezone.now() - dt.timedelta(seconds=float(conf.get("LOST_AFTER_S")))
        for job in Job.objects.filter(state__in=NON_TERMINAL, uid__isnull=False).only("uid", "created_at"):
            st = self.engine.status(job.uid)
            if st is None:
                if job.created_at < lost_before and ledger.finish(job.uid, "failed", LOST):
                    finished += 1
            elif st.state in keys.TERMINAL:
                finished += ledger.finish(job.uid, st.state, st.detail, st.stage or None)
        return finished

    def run(self, stop: threading.Event, sweep_every_s: float = 10.0) -> None:
        """Loop until ``stop`` is set; a sweep first (catches up after a restart), then every ``sweep_every_s``."""
        next_sweep = 0.0
        while not stop.is_set():
            try:
                if time.monotonic() >= next_sweep:
                    self.sweep()
                    next_sweep = time.monotonic() + sweep_every_s
                self.step()
            except Exception:  # Redis or the proxy briefly away: retry next tick
                log.exception("reconciler tick failed")
                stop.wait(1.0)
