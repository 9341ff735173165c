"""Uploading a job's output to the client's own bucket: the request's ``output_upload_url`` (a presigned PUT).

Why here, in the webhook delivery worker, and not in the engine's last stage: the URL is the client's choice,
as a webhook's is, and the platform calls it from inside its network. One egress policy, enforced in one
place, holds for both (:mod:`~onepiece_platform.webhooks.ssrf` and :mod:`~onepiece_platform.webhooks.sender`):
public addresses only unless ``WEBHOOK_ALLOW_PRIVATE`` (production refuses private, loopback and link-local;
``onepiece up``'s local settings allow them), https only with ``WEBHOOK_REQUIRE_HTTPS``, the address vetted
before every attempt and connected to directly (no second DNS lookup), no redirect followed. The engine's
stages get no network path to the outside, and a stage's time is not spent on a client's slow bucket; the
upload starts when the job is completed, from the object store (streamed) or from Redis (an inline output).

Rows (:class:`~onepiece_platform.jobs.models.OutputUpload`) are written with the job at submission; an
upload is due once its job completed. Claimed like webhook deliveries (one transaction pushes
``next_attempt_at`` by ``OUTPUT_UPLOAD_LEASE_S`` with a fresh ``claim_token``; a worker that dies leaves it due
again), sent with no database work, then recorded:

* a 2xx: ``uploaded``; without ``keep_output`` the output is then deleted from our store (and Redis), and
  the job's result routes answer 410 naming where it went;
* refused by the policy, a redirect (3xx), a 4xx other than 408, 425 and 429, an output over
  ``OUTPUT_UPLOAD_MAX_BYTES`` or one that is gone: ``failed`` at once (retrying cannot change it);
* anything else (no answer, a timeout, a 5xx, 408, 425, 429): retried after ``OUTPUT_UPLOAD_RETRY_DELAYS_S``
  with the webhooks' jitter, ``failed`` after ``OUTPUT_UPLOAD_ATTEMPTS``.

The job itself stays ``completed`` whatever the upload does: its output exists (in our store until the
retention ends); ``output_upload.state`` says whether the client's copy does.
"""

from __future__ import annotations

import datetime as dt
import logging
import random
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from onepiece_platform import conf
from onepiece_platform.jobs.models import (
    COMPLETED,
    NON_TERMINAL,
    UPLOAD_FAILED,
    UPLOAD_PENDING,
    UPLOAD_SKIPPED,
    UPLOADED,
    Job,
    OutputUpload,
)
from onepiece_platform.webhooks import sender

log = logging.getLogger(__name__)
RETRIED_4XX = (408, 425, 429)


@dataclass(frozen=True)
class Claimed:
    """What one attempt needs, read in the claim's transaction (the attempt touches no database)."""

    pk: int
    uid: str
    url: str
    keep_output: bool
    ref: Any  # engine.store.objects.ObjectRef of a stored output; None: inline in Redis
    content_type: str
    token: str
    number: int
    gone: str = ""  # why the output can no longer be sent (jobs.models.Job.output_gone)


def backoff_s(failed_attempts: int, rng: Callable[[], float] = random.random) -> float:
    """Seconds to wait after the ``failed_attempts``-th failed attempt (1-based), jitter included."""
    delays = [float(d) for d in conf.get("OUTPUT_UPLOAD_RETRY_DELAYS_S")] or [60.0]
    base = delays[min(max(failed_attempts, 1), len(delays)) - 1]
    return base * (1.0 + float(conf.get("WEBHOOK_RETRY_JITTER")) * rng())


def permanent(outcome: sender.Outcome) -> bool:
    """A failure retrying cannot change: the policy refused the URL, a redirect, a 4xx that is the request's
    own fault (not 408, 425, 429), an output too large or gone."""
    if outcome.error.startswith(("refused:", "not sent:")):
        return True
    return outcome.status is not None and 300 <= outcome.status < 500 and outcome.status not in RETRIED_4XX


class Uploader:
    """Claim, attempt, record (as :class:`~onepiece_platform.webhooks.delivery.Deliverer`), and the loop."""

    def __init__(self, clock: Callable[[], dt.datetime] = timezone.now,
                 send: Callable[..., sender.Outcome] = sender.send) -> None:
        self.clock = clock
        self.send = send

    def _due(self) -> Q:
        return Q(state=UPLOAD_PENDING, next_attempt_at__lte=self.clock(), job__state=COMPLETED)

    def claim(self) -> Claimed | None:
        """The next due upload, claimed for ``OUTPUT_UPLOAD_LEASE_S`` (one at a time: an upload may be large)."""
        from onepiece_platform.jobs.result_urls import stored_ref

        lease = dt.timedelta(seconds=float(conf.get("OUTPUT_UPLOAD_LEASE_S")))
        token = secrets.token_hex(8)
        with transaction.atomic():
            row = (OutputUpload.objects.select_for_update(skip_locked=True, of=("self",)).select_related("job")
                   .filter(self._due()).order_by("next_attempt_at", "id").first())
            if row is None:
                return None
            OutputUpload.objects.filter(pk=row.pk).update(next_attempt_at=self.clock() + lease, claim_token=token)
        job = row.job
        gone = job.output_gone()
        ref = stored_ref(job) if not gone else None
        return Claimed(row.pk, job.uid or "", row.url, row.keep_output, ref,
                       job.output_content_type or (ref.content_type if ref is not None else ""), token,
                       row.attempt_count + 1, gone)

    def attempt(self, c: Claimed) -> sender.Outcome:
        """PUT the output to the client's URL once; never raises."""
        try:
            return self._put(c)
        except Exception as exc:  # the store or Redis away, or a bug: recorded and retried, never dropped
            log.exception("output upload of %s: the attempt failed before it was sent", c.uid)
            return sender.Outcome(None, 0, f"{exc.__class__.__name__}: {exc}")

    def _put(self, c: Claimed) -> sender.Outcome:
        from onepiece_platform.engine_link.client import get_engine
        from onepiece_platform.engine_link.objects import get_object_store

        limit = int(conf.get("OUTPUT_UPLOAD_MAX_BYTES"))
        timeout = float(conf.get("OUTPUT_UPLOAD_TIMEOUT_S"))
        ctype = c.content_type or "application/octet-stream"
        if c.gone:
            return sender.Outcome(None, 0, f"not sent: {c.gone}")
        if c.ref is not None:
            if c.ref.size > limit:
                return sender.Outcome(None, 0, f"not sent: the output's {c.ref.size} bytes are over the limit "
                                               f"of {limit}")
            opened = get_object_store().open(c.ref)
            if opened is None:
                return sender.Outcome(None, 0, "not sent: the output is no longer stored")
            try:
                headers = {"Content-Length": str(opened.length), "Content-Type": ctype}
                return self.send("PUT", c.url, opened.body, headers, timeout)
            finally:
                opened.body.close()
        data = get_engine().result(c.uid)
        if data is None:
            return sender.Outcome(None, 0, "not sent: the output expired or was lost")
        if len(data) > limit:
            return sender.Outcome(None, 0, f"not sent: the output's {len(data)} bytes are over the limit of {limit}")
        return self.send("PUT", c.url, data, {"Content-Length": str(len(data)), "Content-Type": ctype}, timeout)

    def record(self, c: Claimed, outcome: sender.Outcome) -> str:
        """Store the attempt's result and move the upload on; returns the state this worker left it in."""
        now = self.clock()
        common = {"attempt_count": F("attempt_count") + 1, "last_status": outcome.status,
                  "last_error": outcome.error[:500], "claim_token": ""}
        pending = OutputUpload.objects.filter(pk=c.pk, state=UPLOAD_PENDING)
        if outcome.ok:  # uploaded, whoever holds the claim now
            if pending.update(state=UPLOADED, uploaded_at=now, **common) and not c.keep_output:
                self._drop_ours(c.uid)
            return UPLOADED
        mine = pending.filter(claim_token=c.token)  # else another worker claimed it after our lease ran out
        if permanent(outcome) or c.number >= int(conf.get("OUTPUT_UPLOAD_ATTEMPTS")):
            if mine.update(state=UPLOAD_FAILED, **common):
                log.warning("output upload of %s failed after %d attempts: %s", c.uid, c.number, outcome.error)
                return UPLOAD_FAILED
            return UPLOAD_PENDING
        mine.update(next_attempt_at=now + dt.timedelta(seconds=backoff_s(c.number)), **common)
        return UPLOAD_PENDING

    def _drop_ours(self, uid: str) -> None:
        """The client has the output and did not ask us to keep it: our copy goes (store and Redis)."""
        from onepiece_platform.engine_link.objects import job_store

        try:
            job_store().drop_results([uid])
        except Exception:  # kept until the retention clean-up (onepiece.expire_outputs) deletes it
            log.warning("could not delete the uploaded output of %s; the retention clean-up will", uid,
                        exc_info=True)
            return
        Job.objects.filter(uid=uid, output_purged_at__isnull=True).update(output_purged_at=timezone.now())

    def skip_unfinished(self) -> int:
        """Uploads of jobs that ended without an output (failed, cancelled, expired) will never be due."""
        return OutputUpload.objects.filter(state=UPLOAD_PENDING).exclude(
            job__state__in=(COMPLETED, *NON_TERMINAL)).update(
            state=UPLOAD_SKIPPED, last_error="the job ended without an output")

    def run_once(self, limit: int = 100) -> list[str]:
        """Upload what is due now, one by one; the states the uploads were left in."""
        self.skip_unfinished()
        states = []
        while len(states) < limit and (c := self.claim()) is not None:
            states.append(self.record(c, self.attempt(c)))
        return states

    def run(self, stop: threading.Event) -> None:
        """Until ``stop`` is set: upload what is due, look again every ``WEBHOOK_POLL_S`` when idle; a failed
        round is logged and retried."""
        from django.db import connection

        poll = float(conf.get("WEBHOOK_POLL_S"))
        try:
            while not stop.is_set():
                try:
                    if self.run_once(limit=1):
                        continue
                except Exception:  # the database away, or a bug: logged, and the next round tries again
                    log.exception("output upload round failed")
                    connection.close_if_unusable_or_obsolete()
                stop.wait(poll)
        finally:
            connection.close()  # this thread's own connection
