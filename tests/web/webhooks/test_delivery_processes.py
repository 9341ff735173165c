"""The delivery worker as ``onepiece up`` runs it (``manage.py deliver_webhooks``, a process of its own)
under faults: the receiver down while the worker is SIGKILLed mid-send and restarted (SQLite, as on one
machine), and two workers at once over jobs finishing concurrently (PostgreSQL, ``SKIP LOCKED``).

Settings: tests/fixtures/process_settings.py, with retries after 0.2 s and leases of a few
seconds, so the faults play out within seconds.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import standardwebhooks

from engine.embedded import free_port
from tests.fixtures import REPO_ROOT
from tests.fixtures.postgres import PostgresServer
from tests.fixtures.web import WEB_DB
from tests.web.webhooks.receiver import Receiver

pytestmark = pytest.mark.timeout(180)

SETUP = """
import json
from django.core.management import call_command
call_command("migrate", verbosity=0)
from django.contrib.auth import get_user_model
from onepiece_platform.accounts.models import ApiKey
from onepiece_platform.webhooks.models import WebhookEndpoint
from onepiece_platform.webhooks.events import EVENT_TYPES
from onepiece_platform.webhooks.signing import new_secret
user = get_user_model().objects.create_user("hooks", password="pw-hooks-1234")
key, _ = ApiKey.issue(user, "hooks")
e = WebhookEndpoint.objects.create(api_key=key, url="{url}", events=list(EVENT_TYPES), secret=new_secret())
print(json.dumps({{"secret": e.secret}}))
"""

# each job is finished twice by racing threads (a replayed terminal event): the ledger lets one through
FINISH = """
import json, uuid
from concurrent.futures import ThreadPoolExecutor
from django.db import connection
from onepiece_platform.accounts.models import ApiKey
from onepiece_platform.jobs import ledger
from onepiece_platform.jobs.models import Job
key = ApiKey.objects.get(name="hooks")
uids = [uuid.uuid4().hex for _ in range({n})]
Job.objects.bulk_create([Job(uid=u, owner_id=key.user_id, workflow="sd-t2i", api_key=key, params={{}}) for u in uids])
def finish(uid):
    try:
        return ledger.finish(uid, "completed")
    finally:
        connection.close()
with ThreadPoolExecutor({threads}) as pool:
    done = list(pool.map(finish, uids + uids))
print(json.dumps({{"finished": sum(done)}}))
"""


class Deployment:
    """The database (SQLite file or PostgreSQL), set-up scripts and delivery workers, all real processes."""

    def __init__(self, tmp: Path, redis_url: str, db: dict[str, str], webhook_settings: dict[str, Any]) -> None:
        self.logs = tmp / "logs"
        self.logs.mkdir()
        self.env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.fixtures.process_settings",
                    "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "platform"), str(REPO_ROOT)]),
                    "ONEPIECE_STATE_DIR": str(tmp), "ONEPIECE_REDIS_URL": redis_url,
                    "ONEPIECE_TEST_SETTINGS": json.dumps(webhook_settings), **db}
        self.workers: list[subprocess.Popen[bytes]] = []

    def script(self, code: str) -> dict[str, Any]:
        out = subprocess.run([sys.executable, str(REPO_ROOT / "manage.py"), "shell", "-c", code], env=self.env,
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.strip().splitlines()[-1])

    def start_worker(self, *args: str) -> subprocess.Popen[bytes]:
        with open(self.logs / f"worker-{len(self.workers)}.log", "ab") as log:
            p = subprocess.Popen([sys.executable, str(REPO_ROOT / "manage.py"), "deliver_webhooks", *args],
                                 env=self.env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        self.workers.append(p)
        return p

    def log_text(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.logs.glob("*.log")))

    def stop(self) -> None:
        for p in self.workers:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.workers:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


def _wait(what: str, ok: Callable[[], bool], timeout: float, dep: Deployment) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}\n{dep.log_text()[-4000:]}"
        time.sleep(0.1)


def _redis_url(redis_server: Any) -> str:
    return redis_server.url.rsplit("/", 1)[0] + f"/{WEB_DB}"


@pytest.fixture
def sqlite_deployment(tmp_path: Path, redis_server: Any) -> Iterator[tuple[Deployment, Path]]:
    db = tmp_path / "db.sqlite3"
    dep = Deployment(tmp_path, _redis_url(redis_server), {"ONEPIECE_SQLITE_PATH": str(db)},
                     {"WEBHOOK_RETRY_DELAYS_S": [0.2], "WEBHOOK_RETRY_JITTER": 0.0, "WEBHOOK_TIMEOUT_S": 1.0,
                      "WEBHOOK_LEASE_S": 3.0, "WEBHOOK_POLL_S": 0.1})
    yield dep, db
    dep.stop()


def _sqlite_rows(db: Path) -> list[tuple[str, str, int]]:
    with sqlite3.connect(db, timeout=30) as conn:
        return conn.execute("SELECT msg_id, state, attempt_count FROM webhooks_webhookdelivery").fetchall()


def test_receiver_down_and_worker_killed_mid_send_nothing_lost(sqlite_deployment: tuple[Deployment, Path]) -> None:
    dep, db = sqlite_deployment
    n = 12
    receiver = Receiver(free_port())  # not started: the receiver is down
    secret = dep.script(SETUP.format(url=receiver.url))["secret"]
    assert dep.script(FINISH.format(n=n, threads=4))["finished"] == n
    first = dep.start_worker()
    try:
        # the receiver is down: every delivery fails (connection refused) and is retried, none lost
        _wait("two failed attempts of every delivery",
              lambda: len(rows := _sqlite_rows(db)) == n and all(a >= 2 and s == "pending" for _, s, a in rows),
              30, dep)
        # it comes back, holding the first request it gets: the worker is SIGKILLed in the middle of sending
        receiver.answer("hang").start()
        hung = receiver.wait_for(1)[0]
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        receiver.release()
        pending = {m for m, s, _ in _sqlite_rows(db) if s == "pending"}
        assert hung.webhook_id in pending  # claimed by the dead worker, not recorded
        second = dep.start_worker()
        # the dead worker's claim runs out (its lease) and the restarted worker sends it: same webhook-id
        _wait("every delivery delivered", lambda: all(s == "delivered" for _, s, _ in _sqlite_rows(db)), 30, dep)
        second.send_signal(signal.SIGTERM)
        assert second.wait(15) == 0
    finally:
        receiver.stop()
    rows = _sqlite_rows(db)
    assert len(rows) == n and {m for m, _, _ in rows} == {r.webhook_id for r in receiver.received}
    ok = Counter(r.webhook_id for r in receiver.received if r.answered == 200)
    assert set(ok) == {m for m, _, _ in rows}  # at least once each
    # more than once only for what the killed worker had in flight (sent, not yet recorded)
    assert sum(ok.values()) - n <= 8
    assert [r.answered for r in receiver.received if r.webhook_id == hung.webhook_id][:1] == [None]
    for r in receiver.received:  # every attempt signed for its own time, each verifies
        standardwebhooks.Webhook(secret).verify(r.body, r.headers)
    assert "database is locked" not in dep.log_text()


@pytest.fixture
def pg_deployment(tmp_path: Path, redis_server: Any,
                  postgres_server: PostgresServer) -> Iterator[tuple[Deployment, PostgresServer]]:
    dep = Deployment(tmp_path, _redis_url(redis_server), {"ONEPIECE_TEST_PG_PORT": str(postgres_server.port)},
                     {"WEBHOOK_RETRY_DELAYS_S": [0.2], "WEBHOOK_RETRY_JITTER": 0.5, "WEBHOOK_TIMEOUT_S": 2.0,
                      "WEBHOOK_LEASE_S": 30.0, "WEBHOOK_POLL_S": 0.1})
    yield dep, postgres_server
    dep.stop()


def test_two_workers_on_postgresql_deliver_every_event_once(pg_deployment: tuple[Deployment, PostgresServer],
                                                            ) -> None:
    """60 jobs finished by 8 racing threads (each twice) while two workers claim from the same outbox: one
    event per job, each delivered with exactly one 2xx, a 5xx now and then retried."""
    import psycopg

    dep, pg = pg_deployment
    n = 60
    receiver = Receiver().answer(*([200, 200, 500, 200, 503] * 6)).start()
    try:
        secret = dep.script(SETUP.format(url=receiver.url))["secret"]
        logs = [dep.logs / f"worker-{len(dep.workers) + k}.log" for k in range(2)]
        workers = [dep.start_worker("--concurrency", "4") for _ in range(2)]
        # both running before the events exist: under load one worker's start (Django's imports) can take
        # as long as the other needs to deliver all 60 (a CI run saw one worker send every one)
        _wait("both workers running", lambda: all(
            "webhook delivery worker running" in log.read_text(errors="replace") for log in logs), 60, dep)
        assert dep.script(FINISH.format(n=n, threads=8))["finished"] == n

        def states() -> list[tuple[str, str]]:
            with psycopg.connect(pg.dsn()) as conn:
                return conn.execute("SELECT msg_id, state FROM webhooks_webhookdelivery").fetchall()

        _wait("every delivery delivered", lambda: len(s := states()) == n and all(x == "delivered" for _, x in s),
              60, dep)
        for w in workers:
            assert w.poll() is None, dep.log_text()
        with psycopg.connect(pg.dsn()) as conn:
            ok_attempts = conn.execute(
                "SELECT d.msg_id, count(*) FROM webhooks_webhookattempt a JOIN webhooks_webhookdelivery d "
                "ON a.delivery_id = d.id WHERE a.status_code BETWEEN 200 AND 299 GROUP BY d.msg_id").fetchall()
            per_job = conn.execute("SELECT count(DISTINCT job_id), count(*) FROM webhooks_webhookdelivery").fetchone()
            senders = {w for (w,) in conn.execute("SELECT DISTINCT worker FROM webhooks_webhookattempt")}
    finally:
        receiver.stop()
    assert per_job == (n, n)  # one event per job, though every job was finished twice
    assert senders == {f"{os.uname().nodename}:{w.pid}" for w in workers}  # both workers took their share
    ok = Counter(r.webhook_id for r in receiver.received if r.answered == 200)
    assert len(ok) == n and set(ok.values()) == {1}, ok.most_common(3)  # none delivered twice
    assert dict(ok_attempts) == dict.fromkeys(ok, 1)
    assert any(r.answered in (500, 503) for r in receiver.received)  # retries happened, and were counted
    for r in receiver.received:
        standardwebhooks.Webhook(secret).verify(r.body, r.headers)
