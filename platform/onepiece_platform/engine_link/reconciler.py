"""Moves ledger rows along the engine's event stream, and sweeps what the stream cannot tell.

Two inputs, one set of idempotent transitions (:mod:`onepiece_platform.jobs.ledger`):

* ``step``: events from ``onepiece:events`` after the cursor stored in the
  database, in batches. The cursor never passes an event that was not dealt
  with: every event of a batch is applied, held or dead-lettered (each in a
  savepoint of its own, so one event's error undoes only that event) in one
  transaction with the cursor's move to the batch's last event and the
  batch's counters. A reconciler killed at any instant resumes at the first
  event of the batch that did not commit (and re-applying an event whose side
  effects outside the database ran is harmless: transitions happen once,
  quota settlements are idempotent). One transaction per batch instead of one
  per event: the commit and the cursor's update were most of the reconciler's
  CPU under load (``onepiece bench e2e``'s ``control_plane_breakdown``). A
  transient error (a locked or lost database, Redis away while settling)
  rolls the batch back and is retried with backoff, the cursor standing
  still; an event that can never apply goes to :class:`DeadLetter` with its
  reason: malformed fields, or an error that is not transient;
* held events: an event for a UID the ledger does not know yet is parked in
  :class:`HeldEvent` and retried every tick, and dead-lettered as
  ``unknown_job`` after ``HOLD_UNKNOWN_S`` (the platform names its jobs before
  the engine sees them, so this is a job the platform never submitted, or one
  whose submission it gave up on);
* ``sweep``: every non-terminal row is checked against the engine's status.
  It catches what the stream lost: events trimmed away (a step that finds
  the stream no longer holds its cursor says so, counts it in
  ``StreamCursor.gaps`` and sweeps at once), or Redis restarted
  (stream, status hashes and results gone). A job the engine no longer knows,
  older than ``LOST_AFTER_S`` (plus ``PROXY_TIMEOUT_S`` while its submission
  is still in flight), is submitted again under its UID from what the ledger
  kept (:mod:`onepiece_platform.engine_link.resubmit`, ``RESUBMIT_MAX`` times),
  then reported ``failed`` with that reason, so no job is ever left pending. Finished jobs whose charge the quota counters were
  not told (Redis was away) are settled again.

``run`` is a control loop that never dies: each tick catches and logs.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import redis.exceptions
from django.db import InterfaceError, OperationalError, connection, transaction
from django.db.models import F
from django.utils import timezone

from engine.store import keys
from onepiece_platform import conf
from onepiece_platform.engine_link.client import EngineClient, get_engine
from onepiece_platform.engine_link.models import DeadLetter, HeldEvent, StreamCursor
from onepiece_platform.engine_link.resubmit import again
from onepiece_platform.jobs import ledger, push
from onepiece_platform.jobs.models import NON_TERMINAL, TERMINAL, Job

log = logging.getLogger(__name__)
CURSOR = "events"

# errors that say "not now", never "never": the same event is tried again
TRANSIENT: tuple[type[BaseException], ...] = (
    OperationalError, InterfaceError, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
    redis.exceptions.BusyLoadingError,
)


class Malformed(ValueError):
    """An event whose fields cannot be read."""


def _superseded_progress(entries: list[tuple[str, dict[str, str]]]) -> set[str]:
    """The entry ids of progress events followed, in ``entries``, by another event of the same job that
    sets its progress (any known type but ``accepted``)."""
    later: set[str] = set()
    out: set[str] = set()
    for entry_id, fields in reversed(entries):
        uid, type_ = fields.get("uid", ""), fields.get("type", "")
        if type_ == keys.PROGRESS and uid in later:
            out.add(entry_id)
        if type_ in keys.EVENT_TYPES and type_ != keys.ACCEPTED:
            later.add(uid)
    return out


def _superseded_moves(entries: list[tuple[str, dict[str, str]]]) -> set[str]:
    """The entry ids of stage timeline events followed, in ``entries``, by another event of the same job that
    sets its state, stage and progress (any known type but ``accepted``): each is written on its stage run
    only (``timeline_only``), and the later one moves the job's row, so the row is written once per batch."""
    later: set[str] = set()
    out: set[str] = set()
    for entry_id, fields in reversed(entries):
        uid, type_ = fields.get("uid", ""), fields.get("type", "")
        if type_ in ledger.TIMELINE and uid in later:
            out.add(entry_id)
        if type_ in keys.EVENT_TYPES and type_ != keys.ACCEPTED:
            later.add(uid)
    return out


def _merged_starts(entries: list[tuple[str, dict[str, str]]]) -> dict[str, str]:
    """stage_started entry id -> the id of the stage_finished of the same run (job, stage, attempt) later in
    ``entries``: the two are written as one (the run's start and end in one row write)."""
    open_: dict[tuple[str, str, str], str] = {}
    out: dict[str, str] = {}
    for entry_id, fields in entries:
        run = (fields.get("uid", ""), fields.get("stage", ""), fields.get("attempt", "1") or "1")
        if fields.get("type") == keys.STAGE_STARTED and run[1]:
            try:
                parse(fields)
            except Malformed:
                continue  # dead-lettered on its own
            open_[run] = entry_id
        elif fields.get("type") == keys.STAGE_FINISHED and run in open_:
            out[open_.pop(run)] = entry_id
    return out


def parse(fields: dict[str, str]) -> dict[str, Any]:
    """The event's fields as :func:`ledger.apply_event` takes them; raises :class:`Malformed`."""
    uid, type_ = fields.get("uid", ""), fields.get("type", "")
    if not uid or len(uid) > 64:
        raise Malformed(f"no usable uid: {uid!r}")
    if type_ not in keys.EVENT_TYPES:
        raise Malformed(f"unknown event type {type_!r}")
    try:
        ev = {"uid": uid, "type_": type_, "stage": fields.get("stage", ""),
              "progress": int(float(fields.get("progress", 0) or 0)), "ts": float(fields["ts"]),
              "detail": fields.get("detail", ""), "attempt": int(fields.get("attempt", 1) or 1)}
    except (KeyError, ValueError) as exc:
        raise Malformed(f"unreadable field: {exc!r}") from None
    if type_ == keys.COMPLETED and fields.get("output"):
        try:
            ev["output"] = ledger.parse_output(fields["output"])
        except ValueError as exc:  # the completion still applies; the output goes unrecorded, and says why
            log.warning("completed event of %s: unreadable output %r: %s", uid, fields["output"][:200], exc)
    return ev


FOREIGN_REMEMBERED = 100_000  # UIDs of foreign jobs kept (a bounded memory, oldest forgotten)


class Reconciler:
    def __init__(self, engine: EngineClient | None = None, block_ms: int = 1000, count: int = 500,
                 max_backoff_s: float = 5.0, batch: int | None = None, linger_ms: float | None = None,
                 batch_s: float | None = None) -> None:
        self.engine = engine or get_engine()
        self.block_ms = block_ms
        self.count = count
        # events per transaction at most, and the time one may take: enough to spread the commit and the
        # cursor's update over many events, short enough that the web process's writes do not notice
        # (settings RECONCILER_BATCH, RECONCILER_BATCH_S, RECONCILER_LINGER_MS)
        self.batch = max(1, int(batch if batch is not None else conf.get("RECONCILER_BATCH")))
        self.batch_s = float(batch_s if batch_s is not None else conf.get("RECONCILER_BATCH_S"))
        linger = float(linger_ms if linger_ms is not None else conf.get("RECONCILER_LINGER_MS"))
        # a blocking reader (the loop) lets a batch fill; a one-shot step (block_ms 0) waits for nothing
        self.linger_s = linger / 1e3 if block_ms else 0.0
        self.max_backoff_s = max_backoff_s
        self.stop = threading.Event()  # set by run()'s caller: a transient retry gives up, the cursor stays
        self.unsaved_retries = 0  # transient failures not yet added to the cursor's count
        # UIDs whose acceptance this reconciler saw with no ledger row: jobs the platform never submitted
        # (the platform writes its row, UID and all, before it calls the engine), such as direct Proxy
        # clients (`onepiece bench e2e`). Their later events are passed over when they find no row (a row
        # that did appear would still be found): holding each of them for HOLD_UNKNOWN_S cost most of a core
        # under such load, and a dead letter per event. (Skipping the query for them too lost a platform
        # job under PostgreSQL, in the ledger load test: its acceptance was read before its row committed.)
        self._foreign: OrderedDict[str, None] = OrderedDict()
        self.caught_up = 0  # stream events a sweep read before it finished jobs (sweep)
        # the stream no longer held the cursor (_check_gap): counted with the next cursor move, and once the
        # reader has caught up (gap_seen), run() sweeps at once (sweep_due); never from within a sweep
        self.unsaved_gaps, self.gap_seen, self.sweep_due, self.sweeping = 0, False, False, False
        self._gap_at: str | None = None  # the cursor a gap was found at (found once)

    # -- the stream ---------------------------------------------------------------------------------
    def step(self, block: bool = True) -> int:
        """Deal with held events, then the next batch from the stream; returns how many stream events.
        ``block=False``: read only what is there now (no wait for more, no linger)."""
        cursor: dict[str, str] = {}

        def read_cursor(_: int) -> None:
            StreamCursor.objects.get_or_create(name=CURSOR)
            cursor["last_id"] = StreamCursor.objects.values_list("last_id", flat=True).get(name=CURSOR)

        if not self._until_done(read_cursor):
            return 0
        self.retry_held()
        last_id = cursor["last_id"]
        from engine.store import JobStore
        from onepiece_platform.redis_conn import get_redis

        store = JobStore(get_redis())
        self._check_gap(store, last_id)  # before the read: a trim after it would flag what was read
        entries = store.read_entries(last_id, (self.block_ms or None) if block else None, self.count)
        if self.gap_seen and len(entries) < self.count and not self.sweeping:
            self.gap_seen, self.sweep_due = False, True  # caught up: run() sweeps now, not at its next tick
        if not entries:
            return 0
        if block and len(entries) < min(self.batch, self.count) and self.linger_s and \
                not self.stop.wait(self.linger_s):
            # under load events come a few at a time: a moment's wait makes one transaction of many
            entries += store.read_entries(entries[-1][0], None, self.count - len(entries))
        done = 0
        while done < len(entries):
            took: dict[str, int] = {}
            rest = entries[done:done + self.batch]
            if not self._until_done(lambda _, r=rest, t=took: t.update(n=self._batch(r))):
                break  # stopping: the cursor is at the last batch that committed
            done += took["n"]
        return len(entries)

    def _check_gap(self, store: Any, last_id: str) -> None:
        """The stream no longer holds the cursor: its cap trimmed it away (this reconciler was stopped or behind
        by more than the cap) or Redis restarted, so events after it may be gone unread. Said once per cursor,
        counted with the next batch's cursor move (``StreamCursor.gaps``, exact across kills as the other
        counts), and swept once the reader has caught up (a sweep meanwhile could let the cap trim it again),
        at once rather than at the next tick: the sweep brings the jobs to the engine's state; their stage runs
        and progress are lost to the ledger. Never passed over in silence."""
        if last_id == self._gap_at:
            return
        first = store.lost_after(last_id)
        if first is None:
            return
        log.error("the engine's event stream no longer holds the reconciler's cursor %s (its oldest event is %s: "
                  "trimmed by its cap, or Redis restarted); events after the cursor may be lost: sweeping once "
                  "caught up, and their stage runs and progress are not in the ledger", last_id, first)
        self._gap_at, self.unsaved_gaps, self.gap_seen = last_id, self.unsaved_gaps + 1, True

    def _until_done(self, attempt: Callable[[int], None]) -> bool:
        """Call ``attempt(tries so far)`` until it raises no transient error; False if stopped first.
        Each failure is counted, and saved with the next cursor update that commits."""
        tries, delay = 0, 0.05
        while True:
            try:
                attempt(tries)
                return True
            except TRANSIENT as exc:
                tries += 1
                self.unsaved_retries += 1
                log.warning("transient error, trying again in %.2fs (try %d), the cursor unmoved: %s", delay, tries, exc)
                try:
                    connection.close_if_unusable_or_obsolete()
                except Exception:  # closing a broken connection may itself fail; the next query reconnects
                    pass
                if self.stop.wait(delay):
                    return False
                delay = min(delay * 2, self.max_backoff_s)

    def _batch(self, entries: list[tuple[str, dict[str, str]]]) -> int:
        """The first events of ``entries`` (all, or as many as fit in ``batch_s``) applied, held or
        dead-lettered, with the cursor's move past the last of them and their counts, in one transaction:
        all of them or none. Returns how many.

        What a client sees is pushed once per job per batch, after the commit (jobs.push.deferred), and a
        progress event that a later event of its job in the batch supersedes is not written: the later
        one sets the job's state, stage and progress (every event of a stage's end or a new stage carries
        them), so it is counted as applied by that one. A stage run's start and end in one batch are one
        write: its stage_started is applied with its stage_finished (or on its own at the batch's end, when
        the time limit leaves its finish to the next batch: on the run only, if a later event of its job
        already moved the job on)."""
        counts = {"retried": self.unsaved_retries, "gaps": self.unsaved_gaps, "applied": 0, "held": 0, "dead": 0}
        started = time.monotonic()
        n = 0
        superseded = _superseded_progress(entries)
        moved_later = _superseded_moves(entries)  # written on their stage runs only
        merged = _merged_starts(entries)  # stage_started id -> its stage_finished id, both in this batch
        start_of = {fin: start for start, fin in merged.items()}
        pending: dict[str, list[Any]] = {}  # skipped stage_started id -> [fields, a later event of its job applied]
        with push.deferred() as noted:
            with transaction.atomic():
                for entry_id, fields in entries:
                    if entry_id in superseded:
                        outcome = "applied"
                    elif entry_id in merged:
                        pending[entry_id], outcome = [fields, False], "applied"  # written with its finish
                    else:
                        start = start_of.get(entry_id)
                        held = pending.pop(start)[0] if start is not None else None
                        outcome = self._outcome(entry_id, fields, started=held, timeline_only=entry_id in moved_later)
                        if held is not None and outcome != "applied":
                            # held (an unknown job) or dead: undone, and the two go on as two, in their order
                            HeldEvent.objects.filter(entry_id=entry_id).delete()
                            DeadLetter.objects.filter(entry_id=entry_id).delete()
                            counts[self._outcome(start, held)] += 1
                            counts["applied"] -= 1
                            outcome = self._outcome(entry_id, fields)
                        for p in pending.values():
                            p[1] = p[1] or p[0].get("uid") == fields.get("uid")
                    counts[outcome] += 1
                    n += 1
                    if time.monotonic() - started >= self.batch_s:
                        break  # on SQLite the batch holds the write lock: the web process's writes wait for it
                for start, (fields, followed) in pending.items():  # its finish is in the next batch
                    outcome = self._outcome(start, fields, timeline_only=followed)
                    if outcome != "applied":
                        counts[outcome] += 1
                        counts["applied"] -= 1
                StreamCursor.objects.filter(name=CURSOR).update(
                    last_id=entries[n - 1][0], updated_at=timezone.now(),
                    **{k: F(k) + v for k, v in counts.items() if v})
        push.push_noted(noted)
        self.unsaved_retries = self.unsaved_gaps = 0
        return n

    def _outcome(self, entry_id: str, fields: dict[str, str], started: dict[str, str] | None = None,
                 timeline_only: bool = False) -> str:
        """One stream event inside the batch's transaction: applied, held or dead (the count it adds to).
        ``started``: the fields of the stage_started event a stage_finished is written with;
        ``timeline_only``: see :func:`ledger.apply_event`."""
        try:
            ev = parse(fields)
        except Malformed as exc:
            self._dead(entry_id, fields.get("uid", ""), fields, DeadLetter.MALFORMED, str(exc))
            return "dead"
        if started is not None:
            ev["started_ts"] = parse(started)["ts"]  # parsed when the two were paired (_merged_starts)
        if timeline_only:
            ev["timeline_only"] = True
        if ev["uid"] in self._foreign and ev["type_"] != keys.ACCEPTED:
            return "applied"  # a job the platform did not submit (its acceptance said so): no query for it
        return self._apply(entry_id, ev, fields)

    def _apply(self, entry_id: str, ev: dict[str, Any], fields: dict[str, str]) -> str:
        """Apply in a savepoint; returns the outcome counted: applied, held or dead."""
        try:
            with transaction.atomic():
                ledger.apply_event(**ev)
            return "applied"
        except Job.DoesNotExist:
            if ev["type_"] == keys.ACCEPTED:
                # the Proxy's acceptance of a job the platform did not submit tells nothing, and says that
                # the job's other events will not find a row either
                self._foreign[ev["uid"]] = None
                if len(self._foreign) > FOREIGN_REMEMBERED:
                    self._foreign.popitem(last=False)
                return "applied"
            if ev["uid"] in self._foreign:  # a job the platform did not submit: nothing for the ledger
                return "applied"  # (remembered past its end: timeline events may follow the terminal one)
            HeldEvent.objects.get_or_create(entry_id=entry_id, defaults={"uid": ev["uid"], "fields": fields})
            return "held"
        except TRANSIENT:
            raise
        except Exception as exc:  # a bug or bad data: never stall the stream behind it
            log.exception("event %s cannot apply; dead-lettered", entry_id)
            self._dead(entry_id, ev["uid"], fields, DeadLetter.FAILED, f"{type(exc).__name__}: {exc}")
            return "dead"

    @staticmethod
    def _dead(entry_id: str, uid: str, fields: dict[str, str], reason: str, detail: str) -> None:
        DeadLetter.objects.get_or_create(entry_id=entry_id, defaults={"uid": uid[:64], "fields": fields,
                                                                      "reason": reason, "detail": detail[:5000]})

    # -- held events ----------------------------------------------------------------------------------
    def retry_held(self) -> int:
        """Try the held events again; returns how many were applied. Older than the grace: dead-lettered."""
        done = 0
        expire_before = timezone.now() - dt.timedelta(seconds=float(conf.get("HOLD_UNKNOWN_S")))
        for held in list(HeldEvent.objects.all()[:self.count]):
            outcome: dict[str, str] = {}

            def attempt(_: int, h: HeldEvent = held, out: dict[str, str] = outcome) -> None:
                with transaction.atomic():
                    if not HeldEvent.objects.filter(pk=h.pk).exists():
                        return  # another reconciler dealt with it
                    ev = parse(h.fields)
                    if Job.objects.filter(uid=ev["uid"]).exists():
                        result = self._apply(h.entry_id, ev, h.fields)
                    elif h.held_at < expire_before:
                        self._dead(h.entry_id, h.uid, h.fields, DeadLetter.UNKNOWN_JOB,
                                   f"no job {h.uid} in the ledger after {conf.get('HOLD_UNKNOWN_S')}s")
                        result = "dead"
                    else:
                        return
                    HeldEvent.objects.filter(pk=h.pk).delete()
                    n = self.unsaved_retries
                    StreamCursor.objects.filter(name=CURSOR).update(
                        **{result: F(result) + 1}, **({"retried": F("retried") + n} if n else {}))
                    out["result"] = result
                self.unsaved_retries = 0

            if not self._until_done(attempt):
                break
            done += outcome.get("result") == "applied"
        return done

    # -- the sweep ------------------------------------------------------------------------------------
    def sweep(self) -> int:
        """Check every unfinished job against the engine; returns how many of them it found finished (or
        lost) there and brought to their terminal state in the ledger, from their events or here."""
        self.sweeping = True
        try:
            return self._sweep()
        finally:
            self.sweeping = False

    def _sweep(self) -> int:
        finished = 0
        now = timezone.now()
        lost_before = now - dt.timedelta(seconds=float(conf.get("LOST_AFTER_S")))
        # a row still being submitted is the web process's until its call to the engine has timed out
        abandoned_before = lost_before - dt.timedelta(seconds=float(conf.get("PROXY_TIMEOUT_S")))
        ended = []  # (job, the engine's status): finished in the engine, not yet in the ledger
        for job in Job.objects.filter(state__in=NON_TERMINAL, uid__isnull=False):
            st = self.engine.status(job.uid)
            if st is None:
                cutoff = abandoned_before if job.submitting else lost_before
                verdict = again(job, self.engine) if job.created_at < cutoff else None
                if verdict is not None and ledger.finish(job.uid, *verdict):
                    finished += 1
            elif st.state in keys.TERMINAL:
                ended.append((job, st))
        if ended:
            # their events are most likely in the stream still (a restarted reconciler sweeps first): applied
            # in order, each job's stage runs land before its terminal state, so no reader of the ledger sees
            # a finished job without them; the sweep finishes only those whose events never came
            self.caught_up += self._catch_up()
            for job, st in ended:
                # counted whether its own terminal event or this call finished it
                finished += ledger.finish(job.uid, st.state, st.detail, st.stage or None) or \
                    Job.objects.filter(pk=job.pk, state__in=TERMINAL).exists()
        for job in Job.objects.filter(state__in=TERMINAL, charge_settled__lt=F("charge_version"))[:1000]:
            ledger.settle(job)
        return finished

    def _catch_up(self, limit: int = 20) -> int:
        """Apply what the stream holds now, up to ``limit`` reads (the rest waits for the loop); returns
        how many events."""
        n = 0
        for _ in range(limit):
            if self.stop.is_set():
                break
            n += (got := self.step(block=False))
            if got < self.count:
                break
        return n

    def run(self, stop: threading.Event, sweep_every_s: float = 10.0) -> None:
        """Loop until ``stop`` is set; a sweep first (catches up after a restart), then every ``sweep_every_s``."""
        self.stop = stop
        next_sweep = 0.0
        while not stop.is_set():
            try:
                if time.monotonic() >= next_sweep or self.sweep_due:
                    self.sweep_due = False
                    self.sweep()
                    next_sweep = time.monotonic() + sweep_every_s
                self.step()
            except TRANSIENT as exc:  # the database, Redis or the proxy briefly away: retry next tick
                self.unsaved_retries += 1  # counted with the next event that commits
                log.warning("reconciler tick failed, trying again: %s", exc)
                try:
                    connection.close_if_unusable_or_obsolete()
                except Exception:
                    pass
                stop.wait(1.0)
            except Exception:  # a bug: logged in full, and retried next tick
                log.exception("reconciler tick failed")
                try:
                    connection.close_if_unusable_or_obsolete()
                except Exception:
                    pass
                stop.wait(1.0)
