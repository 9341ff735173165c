"""The reconciler: every accepted job reaches exactly one terminal state, across restarts."""

from __future__ import annotations

import datetime as dt

import pytest

from engine.store import keys
from onepiece_platform.engine_link.models import StreamCursor
from onepiece_platform.engine_link.reconciler import Reconciler
from onepiece_platform.engine_link.resubmit import LOST
from onepiece_platform.jobs.models import Job
from tests.fixtures.web import sd_body

pytestmark = pytest.mark.django_db


def _submit(c, n: int) -> list[str]:
    return [c.post("/api/v1/jobs", sd_body(seed=i), format="json").json()["uid"] for i in range(n)]


def test_events_move_rows_and_terminal_happens_once(alice, store) -> None:
    _, c, _ = alice
    a, b = _submit(c, 2)
    store.event(a, keys.STAGE_STARTED, "text_encode", 0, state=keys.IN_PROGRESS)
    store.event(a, keys.STAGE_FINISHED, "text_encode", 10)
    store.event(a, keys.PROGRESS, "denoise", 55, state=keys.IN_PROGRESS)
    store.finish(a, "sd-t2i", keys.COMPLETED, "image_encode", result=b"x")
    store.finish(b, "sd-t2i", keys.FAILED, "denoise", detail="CUDA out of memory")
    r = Reconciler(block_ms=0)
    assert r.step() == 7  # 2 accepted + 3 progress + 2 terminal
    ja, jb = Job.objects.get(uid=a), Job.objects.get(uid=b)
    assert (ja.state, ja.progress, jb.state, jb.detail) == ("completed", 100, "failed", "CUDA out of memory")
    assert "started" in ja.stage_times["text_encode"] and "finished" in ja.stage_times["text_encode"]
    finished_at = ja.finished_at
    # a restarted web process re-reading the whole stream changes nothing
    StreamCursor.objects.all().delete()
    assert Reconciler(block_ms=0).step() == 7
    assert Job.objects.get(uid=a).finished_at == finished_at
    assert r.step() == 0


def test_cursor_survives_a_restart(alice, store) -> None:
    _, c, _ = alice
    (a,) = _submit(c, 1)
    Reconciler(block_ms=0).step()
    store.finish(a, "sd-t2i", keys.CANCELLED, "denoise", detail="cancelled")
    assert Reconciler(block_ms=0).step() == 1  # the new process starts at the stored cursor
    assert Job.objects.get(uid=a).state == "cancelled"


def test_redis_restart_lost_jobs_are_failed_with_a_reason(alice, store, settings) -> None:
    settings.ONEPIECE = {**settings.ONEPIECE, "RESUBMIT_MAX": 0}  # never submitted again (see test_redis_outage)
    _, c, _ = alice
    a, b = _submit(c, 2)
    store.finish(b, "sd-t2i", keys.COMPLETED, "image_encode", result=b"x")
    store.r.flushdb()  # stream, status hashes and results are gone; b's completion was never read
    Job.objects.update(created_at=dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5))
    r = Reconciler(block_ms=0)
    assert r.step() == 0
    assert r.sweep() == 2
    for uid in (a, b):
        j = Job.objects.get(uid=uid)
        assert j.state == "failed" and j.detail == LOST
    assert not Job.objects.filter(state__in=["queued", "in_progress"]).exists()


def test_sweep_picks_up_terminal_states_the_stream_lost(alice, store) -> None:
    _, c, _ = alice
    (a,) = _submit(c, 1)
    store.finish(a, "sd-t2i", keys.EXPIRED, "denoise", detail="deadline passed")
    store.r.delete(keys.EVENTS)  # trimmed away
    assert Reconciler(block_ms=0).sweep() == 1
    assert Job.objects.get(uid=a).state == "expired"


def test_a_sweep_applies_the_stream_before_it_finishes_a_job(alice, store) -> None:
    """A restarted reconciler sweeps first: a job that finished in the engine meanwhile is finished from its
    events, in order, so the ledger never shows it terminal without its stage runs (as the list route,
    which reads the ledger as it is, would otherwise for a moment: tests/e2e/test_up.py)."""
    _, c, _ = alice
    (a,) = _submit(c, 1)
    for stage in ("text_encode", "denoise", "vae_decode", "image_encode"):
        store.event(a, keys.STAGE_STARTED, stage, 0, state=keys.IN_PROGRESS)
        store.event(a, keys.STAGE_FINISHED, stage, 90)
    store.finish(a, "sd-t2i", keys.COMPLETED, "image_encode", result=b"png")
    r = Reconciler(block_ms=0)
    assert r.sweep() == 1
    assert r.caught_up == 10  # its acceptance, eight stage events and terminal event, read before it finished
    job = Job.objects.get(uid=a)
    assert job.state == "completed"
    assert set(job.stage_times) == {"text_encode", "denoise", "vae_decode", "image_encode"}
    assert all("finished" in t for t in job.stage_times.values())


def test_young_unknown_jobs_are_left_alone(alice, store) -> None:
    _, c, _ = alice
    (a,) = _submit(c, 1)
    store.r.flushdb()
    assert Reconciler(block_ms=0).sweep() == 0  # may still be on its way in; decided after LOST_AFTER_S
    assert Job.objects.get(uid=a).state == "queued"


def test_run_loop_survives_redis_errors(web_redis, settings, db) -> None:
    import threading

    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    from onepiece_platform import redis_conn

    redis_conn.close_all()
    stop = threading.Event()
    t = threading.Thread(target=Reconciler(block_ms=10).run, args=(stop, 0.01), name="reconciler-test")
    t.start()
    stop.wait(0.3)
    assert t.is_alive()
    stop.set()
    t.join(5)
    assert not t.is_alive()


def test_reconcile_command_once(alice, store) -> None:
    from io import StringIO

    from django.core.management import call_command

    _, c, _ = alice
    (a,) = _submit(c, 1)
    store.finish(a, "sd-t2i", keys.FAILED, "denoise", detail="worker died twice")
    out = StringIO()
    call_command("reconcile", "--once", stdout=out)
    assert Job.objects.get(uid=a).state == "failed" and "swept 1 finished" in out.getvalue()


# -- nothing skipped: stage runs, late events, held and dead-lettered events ----------------------------------
def _stream_counts() -> dict[str, int]:
    c = StreamCursor.objects.get(name="events")
    return {"applied": c.applied, "retried": c.retried, "held": c.held, "dead": c.dead}


def test_every_stage_run_is_recorded_per_attempt_and_charged(alice, store) -> None:
    from onepiece_platform.jobs.models import StageRun
    from onepiece_platform.quotas import counters

    user, c, _ = alice
    (a,) = _submit(c, 1)
    for stage in ("text_encode", "denoise"):
        store.event(a, keys.STAGE_STARTED, stage, 0, state=keys.IN_PROGRESS)
        store.event(a, keys.STAGE_FINISHED, stage, 50)
    # the node holding the job was lost: it starts again, and its stages run again as attempt 2
    store.r.hincrby(keys.job_key(a), "attempts", 1)
    for stage in ("text_encode", "denoise", "vae_decode", "image_encode"):
        store.event(a, keys.STAGE_STARTED, stage, 0, state=keys.IN_PROGRESS)
        store.event(a, keys.STAGE_FINISHED, stage, 90)
    store.finish(a, "sd-t2i", keys.COMPLETED, "image_encode", result=b"png")
    Reconciler(block_ms=0).step()
    runs = StageRun.objects.filter(job__uid=a)
    assert sorted((r.stage, r.attempt) for r in runs) == sorted(
        [("text_encode", 1), ("denoise", 1), ("text_encode", 2), ("denoise", 2), ("vae_decode", 2),
         ("image_encode", 2)])
    d = c.get(f"/api/v1/jobs/{a}").json()
    assert d["cost_measured_gpu_s"] == pytest.approx(sum(r.device_s for r in runs))
    assert d["cost_measured_gpu_s"] == pytest.approx(sum(r["device_s"] for r in d["stage_runs"]))
    assert {s: t["attempt"] for s, t in d["stage_times"].items()} == {
        "text_encode": 2, "denoise": 2, "vae_decode": 2, "image_encode": 2}
    assert counters.usage(user.pk) == (0, pytest.approx(d["cost_measured_gpu_s"]))


def test_a_stage_time_after_the_terminal_transition_is_recorded_and_corrects_the_charge(alice, store) -> None:
    """A status read finishes the row before the reconciler reads the stream: the stage times that arrive
    afterwards still go on record, and the quota is charged their sum, once."""
    from onepiece_platform.quotas import counters

    user, c, _ = alice
    (a,) = _submit(c, 1)
    estimate = c.get(f"/api/v1/jobs/{a}").json()["cost_estimate_gpu_s"]
    store.event(a, keys.STAGE_STARTED, "text_encode", 0, state=keys.IN_PROGRESS)
    store.event(a, keys.STAGE_FINISHED, "text_encode", 10)
    store.finish(a, "sd-t2i", keys.COMPLETED, "text_encode", result=b"png")
    assert c.get(f"/api/v1/jobs/{a}").json()["state"] == "completed"  # finished by the read, no stage run yet
    assert counters.usage(user.pk) == (0, pytest.approx(estimate))  # the estimate while nothing is measured
    r = Reconciler(block_ms=0)
    r.step()
    d = c.get(f"/api/v1/jobs/{a}").json()
    measured = d["stage_times"]["text_encode"]["device_s"]
    assert d["cost_measured_gpu_s"] == pytest.approx(measured, abs=1e-6)
    assert counters.usage(user.pk) == (0, pytest.approx(measured, abs=1e-6))
    StreamCursor.objects.all().delete()  # a restarted reconciler re-reads everything: nothing is charged twice
    Reconciler(block_ms=0).step()
    assert counters.usage(user.pk) == (0, pytest.approx(measured, abs=1e-6))


def test_events_of_an_unknown_job_are_held_then_applied_or_dead_lettered(alice, store, settings) -> None:
    from onepiece_platform.engine_link.models import DeadLetter, HeldEvent

    _, c, _ = alice
    settings.ONEPIECE = {**settings.ONEPIECE, "HOLD_UNKNOWN_S": 0.0}
    (a,) = _submit(c, 1)
    job = Job.objects.get(uid=a)
    job_uid, ghost = a, "f" * 32
    r = Reconciler(block_ms=0)
    settings.ONEPIECE = {**settings.ONEPIECE, "HOLD_UNKNOWN_S": 3600.0}
    r.step()  # the job's acceptance, while its row is known
    Job.objects.filter(pk=job.pk).update(uid="0" * 32)  # the row is not known under its UID for a while
    store.event(job_uid, keys.STAGE_STARTED, "text_encode", 0, state=keys.IN_PROGRESS)
    # a job the platform never submitted, whose acceptance this reconciler did not see (it started later)
    store.event(ghost, keys.STAGE_STARTED, "text_encode", 0, state=keys.IN_PROGRESS)
    r.step()
    assert sorted(HeldEvent.objects.values_list("uid", flat=True)) == sorted([job_uid, ghost])
    Job.objects.filter(pk=job.pk).update(uid=job_uid)  # now it is
    settings.ONEPIECE = {**settings.ONEPIECE, "HOLD_UNKNOWN_S": 0.0}
    r.step()
    assert not HeldEvent.objects.exists()
    assert Job.objects.get(pk=job.pk).stage_times["text_encode"]["started"] > 0
    (dead,) = DeadLetter.objects.all()
    assert (dead.uid, dead.reason) == (ghost, DeadLetter.UNKNOWN_JOB) and "no job" in dead.detail
    # applied: the job's accepted event and its held stage event; the ghost's stage event was held, then
    # dead-lettered
    assert _stream_counts() == {"applied": 2, "retried": 0, "held": 2, "dead": 1}


def test_a_malformed_event_is_dead_lettered_and_the_stream_goes_on(alice, store) -> None:
    from onepiece_platform.engine_link.models import DeadLetter

    _, c, _ = alice
    (a,) = _submit(c, 1)
    store.r.xadd(keys.EVENTS, {"uid": a, "type": "teleported", "ts": "1"})
    store.r.xadd(keys.EVENTS, {"uid": a, "type": keys.STAGE_STARTED, "stage": "denoise", "ts": "not-a-time"})
    store.finish(a, "sd-t2i", keys.FAILED, "denoise", detail="x")
    assert Reconciler(block_ms=0).step() == 4
    assert Job.objects.get(uid=a).state == "failed"
    assert sorted(DeadLetter.objects.values_list("reason", flat=True)) == ["malformed", "malformed"]
    assert _stream_counts()["dead"] == 2



def test_events_of_a_job_accepted_outside_the_platform_are_passed_over(alice, store) -> None:
    """A direct Proxy client's job (a benchmark): its acceptance finds no row, so its later events are
    passed over at once: nothing held, nothing dead-lettered, while the platform's own job is applied."""
    from onepiece_platform.engine_link.models import DeadLetter, HeldEvent

    _, c, _ = alice
    (mine,) = _submit(c, 1)
    foreign = "e" * 32
    store.accept(foreign, "sd-t2i", 1.0)
    for uid in (foreign, mine):
        store.event(uid, keys.STAGE_STARTED, "text_encode", 0, state=keys.IN_PROGRESS)
        store.event(uid, keys.STAGE_FINISHED, "text_encode", 10)
    store.finish(foreign, "sd-t2i", keys.FAILED, "denoise", detail="x")
    r = Reconciler(block_ms=0)
    r.step()
    assert not HeldEvent.objects.exists() and not DeadLetter.objects.exists()
    assert Job.objects.get(uid=mine).stage_times["text_encode"]["finished"] > 0
    store.event(foreign, keys.STAGE_FINISHED, "denoise", 50)  # a timeline event after its end
    r.step()
    assert not HeldEvent.objects.exists() and not DeadLetter.objects.exists()


def test_events_are_applied_in_batches_one_cursor_move_each(alice, store) -> None:
    """One transaction per batch, not per event: the cursor (and its counts) move once per batch, and every
    event is still counted once."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    _, c, _ = alice
    uids = _submit(c, 3)
    for uid in uids:
        store.event(uid, keys.STAGE_STARTED, "text_encode", 0, state=keys.IN_PROGRESS)
        store.event(uid, keys.STAGE_FINISHED, "text_encode", 10)

    def cursor_moves(r: Reconciler) -> int:
        with CaptureQueriesContext(connection) as q:
            assert r.step() == 9  # 3 accepted + 6 stage events
        return sum(1 for x in q.captured_queries
                   if x["sql"].startswith("UPDATE") and "streamcursor" in x["sql"].lower())

    assert cursor_moves(Reconciler(block_ms=0)) == 1
    assert _stream_counts() == {"applied": 9, "retried": 0, "held": 0, "dead": 0}
    StreamCursor.objects.all().delete()  # read again in batches of 4: three of them
    assert cursor_moves(Reconciler(block_ms=0, batch=4)) == 3
    assert _stream_counts() == {"applied": 9, "retried": 0, "held": 0, "dead": 0}
    assert all("finished" in Job.objects.get(uid=u).stage_times["text_encode"] for u in uids)


def test_a_batch_pushes_each_job_once_and_writes_only_the_progress_that_counts(alice, store) -> None:
    """A job's events in one batch: its websocket group gets one push, after the commit, with the job as
    it stands then; progress events that a later event of the job supersedes are counted applied and not
    written (the later one sets state, stage and progress); the last progress of a still running job is."""
    import asyncio

    from channels.layers import get_channel_layer

    from onepiece_platform.engine_link import reconciler
    from onepiece_platform.jobs.push import group_name

    _, c, _ = alice
    done, running = _submit(c, 2)
    layer = get_channel_layer()

    async def listen() -> dict[str, str]:
        channels = {}
        for uid in (done, running):
            channels[uid] = await layer.new_channel()
            await layer.group_add(group_name(uid), channels[uid])
        return channels

    channels = asyncio.run(listen())
    for uid in (done, running):
        store.event(uid, keys.STAGE_STARTED, "denoise", 10, state=keys.IN_PROGRESS)
        for k in (1, 2, 3):
            store.event(uid, keys.PROGRESS, "denoise", 10 + 20 * k, detail=f"step {k}/3", state=keys.IN_PROGRESS)
    store.event(done, keys.STAGE_FINISHED, "denoise", 80, detail="0.100s")
    store.finish(done, "sd-t2i", keys.COMPLETED, "image_encode", result=b"x")
    entries = store.read_entries("0", None, 100)
    skipped = reconciler._superseded_progress(entries)
    assert len(skipped) == 5  # done's three, running's first two
    writes: list[str] = []
    real = reconciler.ledger.apply_event
    reconciler.ledger.apply_event = lambda **ev: writes.append(ev["type_"]) or real(**ev)
    try:
        assert Reconciler(block_ms=0).step() == len(entries)
    finally:
        reconciler.ledger.apply_event = real
    assert writes.count(keys.PROGRESS) == 1  # running's last
    # done's denoise run: its start written with its end (one write); running's, still open, on its own
    assert writes.count(keys.STAGE_STARTED) == 1 and writes.count(keys.STAGE_FINISHED) == 1
    assert StreamCursor.objects.get(name="events").applied == len(entries)
    run = Job.objects.get(uid=done).stage_runs.get(stage="denoise")
    started = next(float(f["ts"]) for _, f in entries if f["uid"] == done and f["type"] == keys.STAGE_STARTED)
    assert run.started == started and run.finished is not None and Job.objects.get(uid=done).started_at

    async def received(channel: str) -> list[dict]:
        got = []
        while True:
            try:
                got.append(await asyncio.wait_for(layer.receive(channel), 0.5))
            except TimeoutError:
                return got

    pushes = {uid: asyncio.run(received(ch)) for uid, ch in channels.items()}
    assert [m["job"]["state"] for m in pushes[done]] == ["completed"], pushes[done]
    assert [(m["job"]["state"], m["job"]["progress"]) for m in pushes[running]] == [("in_progress", 70)]
    assert Job.objects.get(uid=running).progress == 70 and Job.objects.get(uid=done).progress == 100


def test_a_batch_cut_by_its_time_limit_writes_what_a_whole_batch_writes(alice, store) -> None:
    """With a batch time limit that stops every batch after one event, a stage run's start and end fall in
    different batches (the start is written on its own at its batch's end): the ledger ends as it does when
    one batch holds everything, and a job's progress never goes back."""
    _, c, _ = alice
    cut, whole = _submit(c, 2)

    def events(uid: str) -> None:
        for stage, p in (("text_encode", 0), ("denoise", 20)):
            store.event(uid, keys.STAGE_STARTED, stage, p, state=keys.IN_PROGRESS)
            store.event(uid, keys.PROGRESS, stage, p + 5, detail="step 1/2", state=keys.IN_PROGRESS)
            store.event(uid, keys.STAGE_FINISHED, stage, p + 10, detail="0.010s")

    Reconciler(block_ms=0).step(block=False)  # the two acceptances
    events(cut)
    seen: list[tuple[int, int]] = []
    r = Reconciler(block_ms=0, batch_s=0.0)
    batch = r._batch

    def each(entries: list) -> int:
        n = batch(entries)
        seen.append((n, Job.objects.get(uid=cut).progress))
        return n

    r._batch = each
    assert r.step(block=False) == 6
    assert [n for n, _ in seen] == [1] * 6, seen  # one event a batch
    assert [p for _, p in seen] == sorted(p for _, p in seen), seen  # the progress only went forward
    events(whole)
    assert Reconciler(block_ms=0).step(block=False) == 6  # all six in one batch

    def ledger(uid: str) -> list[tuple]:
        job = Job.objects.get(uid=uid)
        return [(job.state, job.progress, job.stage, job.started_at is not None)] + [
            (run.stage, run.started is not None, run.finished is not None) for run in job.stage_runs.order_by("stage")]

    assert ledger(cut) == ledger(whole) == [("in_progress", 30, "denoise", True), ("denoise", True, True),
                                            ("text_encode", True, True)]


STAGES = ("text_encode", "denoise", "vae_decode", "image_encode")


def _whole_life(store, uid: str) -> None:
    """An sd-t2i job's events after its acceptance: each stage's start and end (three progress events in
    denoise), then its completion."""
    p = 0
    for s in STAGES:
        store.event(uid, keys.STAGE_STARTED, s, p, state=keys.IN_PROGRESS)
        if s == "denoise":
            for k in (1, 2, 3):
                store.event(uid, keys.PROGRESS, s, p + 5 * k, detail=f"step {k}/3", state=keys.IN_PROGRESS)
        p += 20
        store.event(uid, keys.STAGE_FINISHED, s, p, detail="0.010s batch=2")
    store.finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=b"x")


def _writes(queries: list[dict]) -> dict[str, int]:
    """INSERT/UPDATE statements per table of the captured queries."""
    out: dict[str, int] = {}
    for q in queries:
        words = q["sql"].split()
        if words[0] in ("INSERT", "UPDATE"):
            table = words[2] if words[0] == "INSERT" else words[1]
            key = f"{words[0]} {table.strip(chr(34))}"
            out[key] = out.get(key, 0) + 1
    return out


def test_a_jobs_life_in_one_batch_writes_each_stage_run_once_and_its_row_per_visible_change(alice, store) -> None:
    """One write per stage run (its start and end in one INSERT) and one per change a client sees (the
    job's start, its completion, its charge), not a dozen: a stage's end that a later event of the job
    supersedes is written on its run only, and the later event moves the row."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    _, c, _ = alice
    (uid,) = _submit(c, 1)
    _whole_life(store, uid)
    with CaptureQueriesContext(connection) as ctx:
        assert Reconciler(block_ms=0).step() > 0
    writes = _writes(ctx.captured_queries)
    assert writes.get("INSERT jobs_stagerun") == 4 and "UPDATE jobs_stagerun" not in writes, writes
    # the job's start, its completion, its charge and the charge's settling with the quota counters
    assert writes.get("UPDATE jobs_job") == 4, writes
    job = Job.objects.get(uid=uid)
    assert job.state == "completed" and job.progress == 100 and job.started_at is not None
    assert [(r.stage, r.batch_size, round(r.device_s, 6) >= 0) for r in job.stage_runs.order_by("started")] == \
        [(s, 2, True) for s in STAGES]
    assert job.cost_measured_gpu_s == pytest.approx(sum(r.device_s for r in job.stage_runs.all()))


def test_a_foreign_jobs_events_cost_one_lookup(alice, store) -> None:
    """A job sent to the Proxy directly (the platform did not submit it) is looked up once, at its
    acceptance; its other events are counted applied without a query (they were one failed lookup each)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    uid = "f" * 32
    store.accept(uid, "sd-t2i", 1.0)
    _whole_life(store, uid)
    with CaptureQueriesContext(connection) as ctx:
        n = Reconciler(block_ms=0).step()
    assert n == 13
    lookups = [q for q in ctx.captured_queries if 'FROM "jobs_job"' in q["sql"]]
    assert len(lookups) == 1, [q["sql"][:80] for q in lookups]
    assert StreamCursor.objects.get(name="events").applied == 13 and not Job.objects.filter(uid=uid).exists()


def test_events_the_stream_dropped_before_they_were_read_are_said_counted_and_swept_at_once(
        alice, store, caplog) -> None:
    """The engine's stream is capped (``events_maxlen``): a reconciler stopped or behind by more than the cap
    finds its cursor and what followed it gone. It used to read on from the oldest event left as if nothing
    were missing, and the sweep (every 10 s) caught the jobs' ends. Now it says so, counts it, and sweeps at
    once."""
    _, c, _ = alice
    a, b = _submit(c, 2)
    r = Reconciler(block_ms=0)
    assert r.step() == 2 and not r.sweep_due  # the acceptances; no gap: the control
    store.event(a, keys.STAGE_STARTED, "text_encode", 0, state=keys.IN_PROGRESS)
    store.finish(a, "sd-t2i", keys.COMPLETED, "image_encode", result=b"x")
    store.r.xtrim(keys.EVENTS, maxlen=0, approximate=False)  # the cap reached while the reconciler was away
    store.event(b, keys.STAGE_STARTED, "text_encode", 0, state=keys.IN_PROGRESS)
    with caplog.at_level("ERROR", logger="onepiece_platform.engine_link.reconciler"):
        assert r.step() == 1
    assert "no longer holds the reconciler's cursor" in caplog.text and r.sweep_due
    assert StreamCursor.objects.get().gaps == 1
    from onepiece_platform.ops.metrics import LedgerCollector

    [gaps] = [f for f in LedgerCollector().collect() if f.name == "onepiece_ledger_stream_gaps"]
    assert [s.value for s in gaps.samples] == [1]
    assert Job.objects.get(uid=a).state == "queued"  # its events are gone: the sweep must finish it
    assert r.sweep() == 1 and Job.objects.get(uid=a).state == "completed"
    # reading on past the gap is no new gap
    store.event(b, keys.PROGRESS, "text_encode", 50, state=keys.IN_PROGRESS)
    r.sweep_due = False
    assert r.step() == 1 and not r.sweep_due and StreamCursor.objects.get().gaps == 1


def test_a_gap_makes_the_loop_sweep_at_once_not_at_its_next_tick(alice, store) -> None:
    """run() sweeps first, then every ``sweep_every_s`` (an hour here): a gap found by a step brings the next
    sweep forward to the moment the reader has caught up. The loop runs in this thread (the test database's
    connection), stopped by the second sweep, or after 40 steps without one."""
    import threading

    _, c, _ = alice
    (a,) = _submit(c, 1)
    r = Reconciler(block_ms=20)
    assert r.step(block=False) == 1
    store.finish(a, "sd-t2i", keys.COMPLETED, "image_encode", result=b"x")
    store.r.xtrim(keys.EVENTS, maxlen=0, approximate=False)
    _submit(c, 1)  # an event after the gap
    stop, sweeps, steps = threading.Event(), [], []
    real_sweep, real_step = r.sweep, r.step

    def sweep() -> int:
        sweeps.append(Job.objects.get(uid=a).state)
        n = real_sweep()
        if len(sweeps) == 2:
            stop.set()
        return n

    def step(block: bool = True) -> int:
        steps.append(1)
        if len(steps) >= 40:
            stop.set()
        return real_step(block)

    r.sweep, r.step = sweep, step  # type: ignore[method-assign]
    r.run(stop, 3600.0)
    # the sweep at start (which finds the job completed in the engine), then the gap's, long before its hour
    assert sweeps == ["queued", "completed"] and len(steps) < 40, (sweeps, len(steps))
    assert Job.objects.get(uid=a).state == "completed"
    assert StreamCursor.objects.get().gaps == 1
