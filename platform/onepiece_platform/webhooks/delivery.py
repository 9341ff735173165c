"""The delivery worker: claims due outbox rows, sends them, records every attempt.

At least once, never lost:

* **claim** (one transaction): due pending rows are selected (``FOR UPDATE SKIP LOCKED`` on
  PostgreSQL, so concurrent workers take different rows; SQLite's immediate transaction has one
  writer at a time) and their ``next_attempt_at`` is pushed ``WEBHOOK_LEASE_S`` ahead with a fresh
  ``claim_token``. A worker that dies after this leaves the row due again when the lease runs out,
  and another worker (or itself, restarted) sends it: same ``webhook-id``, same body.
* **send** (no database): signed now, ``webhook-timestamp`` this attempt's time; the lease is longer
  than ``WEBHOOK_TIMEOUT_S`` (a system check says so), so a row is never sent by two workers at once
  unless one of them stalls past its lease.
* **record** (one transaction): the attempt's row, and then a 2xx marks the delivery ``delivered``;
  anything else schedules the next attempt (while the claim is still ours) after the backoff below,
  or marks it ``failed`` once ``give_up_at`` (creation + ``WEBHOOK_MAX_AGE_S``, 24 h) has passed. A
  worker killed between the receiver's 2xx and this commit sends the row again later: receivers
  de-duplicate by ``webhook-id``, as Standard Webhooks asks.

Backoff: ``WEBHOOK_RETRY_DELAYS_S`` after the 1st, 2nd, ... failed attempt (the last delay repeats),
each stretched by a random 0 to ``WEBHOOK_RETRY_JITTER`` (so receivers that come back are not hit by
every retry at once), never past ``give_up_at``: the last attempt is made at the 24 h mark. Defaults:
5 s, 30 s, 2 min, 10 min, 30 min, 1 h, 2 h, 4 h, 8 h, 8 h, then the final attempt at 24 h (12 in all).

A row the worker cannot handle is logged and left pending (its lease makes it due again), never
dropped. :meth:`Deliverer.run` is a loop that never dies: a failed tick is logged and retried.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from django.db import connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from onepiece_platform import conf
from onepiece_platform.webhooks import sender, signing
from onepiece_platform.webhooks.models import (
    DELIVERED,
    FAILED,
    PENDING,
    REQUEST,
    WebhookAttempt,
    WebhookDelivery,
)

log = logging.getLogger(__name__)


def worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"[:100]


@dataclass(frozen=True)
class Claimed:
    """What sending a claimed row needs, read in the claim's transaction (the send touches no database)."""

    pk: int
    msg_id: str
    body: str
    url: str
    secret: str
    token: str
    number: int  # this attempt's number (1 for the first)


def backoff_s(failed_attempts: int, rng: Callable[[], float] = random.random) -> float:
    """Seconds to wait after the ``failed_attempts``-th failed attempt (1-based), jitter included."""
    delays = [float(d) for d in conf.get("WEBHOOK_RETRY_DELAYS_S")] or [60.0]
    base = delays[min(max(failed_attempts, 1), len(delays)) - 1]
    return base * (1.0 + float(conf.get("WEBHOOK_RETRY_JITTER")) * rng())


class Deliverer:
    """The core steps (claim, attempt, record), used by the loop in :meth:`run` and directly by tests."""

    def __init__(self, clock: Callable[[], dt.datetime] = timezone.now,
                 post: Callable[[str, bytes, dict[str, str], float], sender.Outcome] = sender.post) -> None:
        self.clock = clock
        self.post = post

    # -- claim ------------------------------------------------------------------------------------------------
    def _due(self) -> Q:
        # a disabled endpoint's own deliveries wait (until re-enabled or given up); per-request URLs still go
        return Q(state=PENDING, next_attempt_at__lte=self.clock()) & (Q(target=REQUEST) | Q(endpoint__enabled=True))

    def has_due(self) -> bool:
        """A plain read, outside any transaction: an idle worker never takes SQLite's write lock."""
        return WebhookDelivery.objects.filter(self._due()).exists()

    def claim(self, limit: int) -> list[Claimed]:
        if limit <= 0:
            return []
        lease = dt.timedelta(seconds=float(conf.get("WEBHOOK_LEASE_S")))
        token = secrets.token_hex(8)
        with transaction.atomic():
            rows = list(WebhookDelivery.objects.select_for_update(skip_locked=True, of=("self",))
                        .select_related("endpoint").filter(self._due())
                        .order_by("next_attempt_at", "id")[:limit])
            if not rows:
                return []
            WebhookDelivery.objects.filter(pk__in=[r.pk for r in rows]).update(
                next_attempt_at=self.clock() + lease, claim_token=token)
        return [Claimed(r.pk, r.msg_id, r.body, r.destination, r.endpoint.secret, token, r.attempt_count + 1)
                for r in rows]

    # -- send -------------------------------------------------------------------------------------------------
    def attempt(self, c: Claimed) -> tuple[dt.datetime, sender.Outcome]:
        """Sign and POST once; never raises (a failure is an outcome with its error)."""
        started = self.clock()
        try:
            headers = signing.headers(c.secret, c.msg_id, int(time.time()), c.body)
            outcome = self.post(c.url, c.body.encode(), headers, float(conf.get("WEBHOOK_TIMEOUT_S")))
        except Exception as exc:  # a bug or a secret that cannot be used: recorded, retried, never dropped
            log.exception("webhook %s: the attempt failed before it was sent", c.msg_id)
            outcome = sender.Outcome(None, 0, f"not sent: {exc.__class__.__name__}: {exc}")
        return started, outcome

    # -- record -----------------------------------------------------------------------------------------------
    def record(self, c: Claimed, started: dt.datetime, outcome: sender.Outcome) -> str:
        """Store the attempt and move the delivery on; returns its state as this worker left it."""
        now = self.clock()
        with transaction.atomic():
            WebhookAttempt.objects.create(delivery_id=c.pk, number=c.number, at=started, url=c.url[:2000],
                                          address=outcome.address[:64], status_code=outcome.status,
                                          latency_ms=max(0, outcome.latency_ms), error=outcome.error[:500],
                                          worker=worker_name())
            mine = WebhookDelivery.objects.filter(pk=c.pk, state=PENDING)
            common = {"attempt_count": F("attempt_count") + 1, "last_status": outcome.status,
                      "last_error": outcome.error[:500]}
            if outcome.ok:  # delivered, whoever holds the claim now
                mine.update(state=DELIVERED, delivered_at=now, claim_token="", **common)
                return DELIVERED
            row = mine.select_for_update().filter(claim_token=c.token).values("give_up_at").first()
            if row is None:  # another worker claimed it after our lease ran out: it decides what is next
                mine.update(**common)
                return PENDING
            if now >= row["give_up_at"]:
                mine.update(state=FAILED, claim_token="", **common)
                log.warning("webhook %s failed for good after %d attempts: %s", c.msg_id, c.number, outcome.error)
                return FAILED
            at = min(now + dt.timedelta(seconds=backoff_s(c.number)), row["give_up_at"])
            mine.update(next_attempt_at=at, claim_token="", **common)
            return PENDING

    def give_up_held(self) -> int:
        """Fail the deliveries that waited for a disabled endpoint past ``give_up_at``."""
        return WebhookDelivery.objects.filter(state=PENDING, endpoint__enabled=False, give_up_at__lte=self.clock()
                                              ).exclude(target=REQUEST).update(
            state=FAILED, last_error="the endpoint stayed disabled until the delivery's time ran out")

    # -- loops ------------------------------------------------------------------------------------------------
    def run_once(self, limit: int = 100) -> list[str]:
        """Claim what is due and send it here, one by one; the states the rows were left in. At most as many
        rows as can be sent, one after the other, within one claim's lease (so no other worker takes a row
        this one still holds)."""
        fits = int(float(conf.get("WEBHOOK_LEASE_S")) // max(0.001, float(conf.get("WEBHOOK_TIMEOUT_S")))) - 1
        return [self.record(c, *self.attempt(c)) for c in self.claim(max(1, min(limit, fits)))]

    def run(self, stop: threading.Event, concurrency: int | None = None) -> None:
        """Until ``stop`` is set: keep up to ``concurrency`` attempts in flight on a thread pool (database work
        stays on this thread), look for due rows every ``WEBHOOK_POLL_S`` when there is nothing to do."""
        n = max(1, int(concurrency or conf.get("WEBHOOK_CONCURRENCY")))
        poll = float(conf.get("WEBHOOK_POLL_S"))
        inflight: dict[Future[tuple[dt.datetime, sender.Outcome]], Claimed] = {}
        next_give_up = 0.0
        with ThreadPoolExecutor(n, thread_name_prefix="webhook-send") as pool:
            while not stop.is_set() or inflight:
                try:
                    for f in [f for f in inflight if f.done()]:
                        c = inflight.pop(f)
                        try:
                            self.record(c, *f.result())
                        except Exception:  # the row stays pending; its lease makes it due again
                            log.exception("webhook %s: could not record the attempt; it will be sent again",
                                          c.msg_id)
                            self._reset_connection()
                    if not stop.is_set() and len(inflight) < n and self.has_due():
                        for c in self.claim(n - len(inflight)):
                            inflight[pool.submit(self.attempt, c)] = c
                    if not stop.is_set() and time.monotonic() >= next_give_up:
                        self.give_up_held()
                        next_give_up = time.monotonic() + 60.0
                except Exception:  # the database away, or a bug: logged, and the next tick tries again
                    log.exception("webhook delivery tick failed")
                    self._reset_connection()
                    stop.wait(poll)
                if inflight:
                    wait(list(inflight), timeout=poll, return_when=FIRST_COMPLETED)
                else:
                    stop.wait(poll)

    @staticmethod
    def _reset_connection() -> None:
        try:
            connection.close_if_unusable_or_obsolete()
        except Exception:
            pass
