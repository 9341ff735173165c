"""The reconciler: every accepted job reaches exactly one terminal state, across restarts."""

from __future__ import annotations

import datetime as dt

import pytest

from engine.store import keys
from onepiece_platform.engine_link.models import StreamCursor
from onepiece_platform.engine_link.reconciler import LOST, Reconciler
from onepiece_platform.jobs.models import Job
from tests.web.conftest import sd_body

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
