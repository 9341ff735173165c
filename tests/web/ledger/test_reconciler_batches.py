"""A reconciler SIGKILLed in the middle of a batch loses nothing and applies nothing twice.

Real processes: PostgreSQL, redis-server and ``manage.py reconcile``. The stream holds every event of six
jobs; the test holds the row lock of the fourth job, so the reconciler's batch (one transaction over all
the events it read) stops at that job's first event with the first three jobs' events applied inside
it, not committed. PostgreSQL shows that state from outside: the reconciler's backend waits for a lock
and has written (it has a transaction id) while the rows and the cursor are unchanged. The reconciler is
SIGKILLed there; nothing of the batch is visible afterwards; a new reconciler starts at the old cursor and
every event is applied exactly once: every job completed with each stage run started and finished, the
cursor's counts equal to the stream's length, nothing held, nothing dead-lettered, the quota counters
holding the ledger's charges once.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.embedded import RedisServer
from engine.store import JobStore, keys
from tests.fixtures import REPO_ROOT
from tests.web.ledger.conftest import Platform

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(300)]

JOBS, LOCKED = 6, 3  # the fourth job's row is locked while the batch runs
STAGES = ("text_encode", "denoise", "vae_decode", "image_encode")
APP = "batch-reconciler"  # its PostgreSQL connections' application_name


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer("redis-server", tmp_path / "redis").start()
    yield server
    server.stop()


def _setup(p: Platform) -> tuple[int, list[str]]:
    """A user and JOBS queued jobs with their quota reservations (as the platform writes them before it
    calls the engine)."""
    out = p.run_manage("shell", "-c", f"""
import json, uuid
from django.contrib.auth import get_user_model
from onepiece_platform.jobs.models import Job
from onepiece_platform.quotas import counters
from onepiece_platform.quotas.models import Limits
u = get_user_model().objects.create_user("batch", password="pw")
uids = [uuid.uuid4().hex for _ in range({JOBS})]
limits = Limits(max_concurrent_jobs=100, gpu_seconds_per_day=1e9, max_pixels=1 << 30, max_frames=1000,
                max_steps=1000)
for uid in uids:
    day = counters.reserve(u.pk, uid, 1.0, limits)  # what the platform's submit reserves
    Job.objects.create(uid=uid, owner=u, workflow="sd-t2i", params={{}}, cost_estimate_gpu_s=1.0, quota_day=day)
print("SETUP " + json.dumps({{"user": u.pk, "uids": uids}}))
""")
    doc = json.loads(out.split("SETUP ", 1)[1])
    return int(doc["user"]), list(doc["uids"])


def _write_stream(store: JobStore, uids: list[str]) -> int:
    """Every event of every job, job after job; returns how many. The terminal event goes on the stream
    only (the status hash stays in progress), so the reconciler's sweep finishes nothing: the stream is
    its only way to the ledger."""
    for uid in uids:
        store.accept(uid, "sd-t2i", 1.0)
        for stage in STAGES:
            store.event(uid, keys.STAGE_STARTED, stage, 0, state=keys.IN_PROGRESS)
            store.event(uid, keys.STAGE_FINISHED, stage, 50)
        store.r.xadd(keys.EVENTS, {"uid": uid, "type": keys.COMPLETED, "stage": STAGES[-1], "progress": 100,
                                   "ts": time.time(), "detail": "", "attempt": 1})
    return int(store.r.xlen(keys.EVENTS))


def _until(what: str, check: Any, timeout: float = 60) -> Any:
    """Poll ``check()`` until it is truthy (a state of another process, read, never slept for)."""
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)
    return got


def _cursor(conn: Any) -> tuple[str, int, int, int]:
    row = conn.execute("SELECT last_id, applied, held, dead FROM engine_link_streamcursor "
                       "WHERE name = 'events'").fetchone()
    return tuple(row) if row else ("0-0", 0, 0, 0)  # type: ignore[return-value]


def _states(conn: Any, uids: list[str]) -> list[str]:
    rows = dict(conn.execute("SELECT uid, state FROM jobs_job WHERE uid = ANY(%s)", [uids]).fetchall())
    return [rows[u] for u in uids]


def _waiting_reconciler(conn: Any) -> tuple[int, Any] | None:
    """(pid, transaction id) of the reconciler's backend if it is waiting for a lock."""
    return conn.execute("SELECT pid, backend_xid FROM pg_stat_activity WHERE application_name = %s "
                        "AND wait_event_type = 'Lock'", [APP]).fetchone()


def test_sigkill_mid_batch_loses_nothing_and_applies_nothing_twice(
        postgres_server: Any, redis: RedisServer, tmp_path: Path) -> None:
    import psycopg

    env = {k: v for k, v in os.environ.items() if not k.startswith("ONEPIECE_") and k != "DJANGO_SETTINGS_MODULE"}
    env.update(ONEPIECE_STATE_DIR=str(tmp_path / "state"), ONEPIECE_REDIS_URL=redis.url,
               ONEPIECE_ENGINE_CLIENT="onepiece_platform.engine_link.local.LocalEngineClient",
               ONEPIECE_TEST_PG_PORT=str(postgres_server.port), ONEPIECE_TEST_APP_NAME=APP,
               DJANGO_SETTINGS_MODULE="tests.fixtures.process_settings", DJANGO_SECRET_KEY=secrets.token_hex(32),
               # one batch for the whole stream, however slow this host is today: the lock must stop it midway
               ONEPIECE_TEST_SETTINGS=json.dumps({"RECONCILER_BATCH": 500, "RECONCILER_BATCH_S": 600.0}),
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT / "platform"), str(REPO_ROOT)]))
    p = Platform(tmp_path / "state", env)
    store = JobStore.from_url(redis.url, ttl=600)
    try:
        p.run_manage("migrate", "--noinput", "-v", "0")
        user, uids = _setup(p)
        events = _write_stream(store, uids)
        assert events == JOBS * (2 + 2 * len(STAGES))
        with psycopg.connect(postgres_server.dsn(), autocommit=True) as watch, \
                psycopg.connect(postgres_server.dsn()) as locker:
            locker.execute("SELECT 1 FROM jobs_job WHERE uid = %s FOR UPDATE", [uids[LOCKED]])
            p.start_reconciler()
            # the batch reached the locked job: it waits for the lock, and has written before it
            pid, xid = _until("the reconciler waits for the locked row mid-batch", lambda: _waiting_reconciler(watch))
            assert xid is not None  # a transaction id: it wrote before it waited (the first jobs' events)
            # ... all of it uncommitted: the first jobs' rows and the cursor, seen from outside, have not moved
            assert _states(watch, uids) == ["queued"] * JOBS
            assert _cursor(watch)[1:] == (0, 0, 0)
            p.kill_reconciler()
            # its backend is orphaned, waiting still; it is what a lost client becomes (cut, rolled back)
            watch.execute("SELECT pg_terminate_backend(%s)", [pid])
            _until("the killed reconciler's backend is gone", lambda: not watch.execute(
                "SELECT 1 FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone())
            locker.rollback()
            assert _states(watch, uids) == ["queued"] * JOBS  # nothing of the killed batch committed
            assert _cursor(watch)[1:] == (0, 0, 0)

            p.start_reconciler()
            last = store.r.xrevrange(keys.EVENTS, count=1)[0][0].decode()
            _until("the new reconciler passed the last event", lambda: _cursor(watch)[0] == last)
            # every event applied once: the counts committed with the cursor equal the stream's length
            assert _cursor(watch) == (last, events, 0, 0)
            assert _states(watch, uids) == ["completed"] * JOBS
            runs = watch.execute("SELECT j.uid, r.stage, r.attempt, r.started, r.finished FROM jobs_stagerun r "
                                 "JOIN jobs_job j ON j.id = r.job_id").fetchall()
            assert sorted((u, s, a) for u, s, a, _, _ in runs) == sorted((u, s, 1) for u in uids for s in STAGES)
            assert all(started is not None and finished is not None for *_, started, finished in runs)
            assert watch.execute("SELECT count(*) FROM engine_link_heldevent").fetchone() == (0,)
            assert watch.execute("SELECT count(*) FROM engine_link_deadletter").fetchone() == (0,)
            charged = watch.execute("SELECT sum(cost_measured_gpu_s), min(charge_version), max(charge_version), "
                                    "bool_and(charge_settled = charge_version) FROM jobs_job").fetchone()
        assert charged[1] == charged[2] == 1 and charged[3], charged  # one charge per job, settled
        usage = p.run_manage("shell", "-c", f"from onepiece_platform.quotas import counters; "
                             f"print('USAGE', *counters.usage({user}))").split("USAGE ", 1)[1].split()
        # every slot freed once, the quota charged the ledger's measured cost (not the estimates), once
        assert int(usage[0]) == 0 and float(usage[1]) == pytest.approx(charged[0], abs=1e-6), (usage, charged)
        assert p.reconciler is not None and p.reconciler.poll() is None, p.log_text()
    finally:
        store.close()
        p.stop()
