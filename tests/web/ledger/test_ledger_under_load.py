"""The ledger loses nothing under load, on SQLite (``onepiece up``'s default) and on PostgreSQL.

Real processes only: a one-node engine (both workflows, tiny models), the web
platform served by uvicorn as ``onepiece up`` serves it and ``manage.py
reconcile``, PostgreSQL from Debian's package. Through HTTP, 16 submitters
send both workflows while status readers poll jobs and websocket subscribers
follow them; meanwhile the reconciler is SIGKILLed and restarted (and, on
PostgreSQL, its database connection is cut). Then every completed job must
have a started and finished run of every stage of its workflow, its measured
cost must be their sum, the quota counters must hold exactly the ledger's
charges and no running job, and no log line may say "database is locked".
Then Redis is restarted under a few jobs: the counters are re-seeded from the
ledger and no job stays pending.

The counts of each run (jobs, events, retries, dead letters) are printed and
written to test-artifacts/ledger-counts-<database>.json.
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import re
import secrets
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engine.embedded import EtcdServer, RedisServer
from engine.store import keys
from tests.fixtures import REPO_ROOT
from tests.fixtures.runtime import Cluster, NodeRun, engine
from tests.web.ledger.conftest import Platform

pytestmark = [pytest.mark.slow, pytest.mark.models, pytest.mark.timeout(900)]

SD_JOBS, WAN_JOBS = 150, 50  # phase one: >= 200 jobs of both workflows
SUBMITTERS, READERS, SUBSCRIBERS = 16, 3, 3
USERS = 4
ROUTES = {"sd-t2i": ["text_encode", "denoise", "vae_decode", "image_encode"]}
ARTIFACTS = REPO_ROOT / "test-artifacts"


def _png() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 64), (200, 30, 30)).save(buf, "PNG")
    return base64.b64encode(buf.getvalue()).decode()


def _bodies() -> list[dict[str, Any]]:
    sd = [{"workflow": "sd-t2i", "params": {"prompt": "a cat", "height": 64, "width": 64, "num_inference_steps": 2,
                                            "seed": i}} for i in range(SD_JOBS)]
    png = _png()
    wan = [{"workflow": "wan2.1-i2v", "params": {"prompt": "a dog", "height": 64, "width": 64, "num_frames": 5,
                                                 "num_inference_steps": 2, "seed": i},
            "inputs": {"image": png}} for i in range(WAN_JOBS)]
    bodies = sd + wan
    random.Random(15).shuffle(bodies)
    return bodies


# -- the engine, shared by both databases ---------------------------------------------------------------------
@dataclass
class Stack:
    redis: RedisServer  # replaced when a test restarts it
    etcd: EtcdServer
    cluster: Cluster


@pytest.fixture(scope="module")
def stack(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[Stack]:
    """Its own Redis (the test restarts it) and etcd, and ``onepiece node`` + ``onepiece proxy``."""
    from engine.worker.config import default_assignment
    from engine.workflow import get_workflow

    for wf in ("sd-t2i", "wan2.1-i2v"):
        ROUTES[wf] = get_workflow(wf).route()
    tmp = tmp_path_factory.mktemp("ledger-stack")
    s = Stack(RedisServer("redis-server", tmp / "redis").start(), EtcdServer("etcd", tmp / "etcd").start(),
              None)  # type: ignore[arg-type]
    try:
        from onepiece_launcher.up import DEFAULT_WORKFLOWS

        assignment = default_assignment({k: str(tiny_models[k]) for k in DEFAULT_WORKFLOWS}, device="cpu")
        with engine(s.redis.url, s.etcd.url, [NodeRun("ledger-node", assignment)], tmp / "engine",
                    f"test-{os.getpid()}-ledger-") as (s.cluster, _procs):
            yield s
    finally:
        s.etcd.stop()
        s.redis.stop()


def _restart_redis(redis: RedisServer) -> RedisServer:
    redis.stop()
    return RedisServer("redis-server", redis.data_dir, port=redis.port).start()


# -- HTTP and websocket clients ---------------------------------------------------------------------------------
def _call(url: str, method: str = "GET", body: Any = None, key: str = "", timeout: float = 30
          ) -> tuple[int, Any, dict[str, str]]:
    data = json.dumps(body).encode() if body is not None else None
    headers = {"Content-Type": "application/json"} if data else {}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status, hdrs = r.read(), r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        raw, status, hdrs = e.read(), e.code, dict(e.headers)
    try:
        return status, json.loads(raw), hdrs
    except ValueError:
        return status, raw, hdrs


def _metrics(url: str) -> dict[str, float]:
    status, raw, _ = _call(url + "/metrics")
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    out: dict[str, float] = {}
    for m in re.finditer(r'^(onepiece_ledger_\w+?)(?:\{(\w+)="(\w+)"\})? ([0-9.e+-]+)$', text, re.M):
        out[m.group(1) + (f":{m.group(3)}" if m.group(3) else "")] = float(m.group(4))
    return out


def _setup_users(p: Platform) -> list[dict[str, Any]]:
    """Users with API keys, generous quotas and a browser session each (for the websockets)."""
    script = f"""
import json
from django.contrib.auth import get_user_model
from django.contrib.sessions.backends.db import SessionStore
from onepiece_platform.accounts.models import ApiKey
from onepiece_platform.quotas.models import Quota
out = []
for i in range({USERS}):
    u = get_user_model().objects.create_user(f"load{{i}}", password="pw")
    Quota.objects.create(user=u, max_concurrent_jobs=1000, gpu_seconds_per_day=1e9)
    _, key = ApiKey.issue(u, "load")
    s = SessionStore()
    s["_auth_user_id"], s["_auth_user_backend"] = str(u.pk), "django.contrib.auth.backends.ModelBackend"
    s["_auth_user_hash"] = u.get_session_auth_hash()
    s.create()
    out.append({{"id": u.pk, "key": key, "session": s.session_key}})
print("USERS " + json.dumps(out))
"""
    out = p.run_manage("shell", "-c", script)
    return list(json.loads(out.split("USERS ", 1)[1]))


class Load:
    """Submitters, status readers and websocket subscribers, all at once, against the web process."""

    def __init__(self, url: str, users: list[dict[str, Any]], bodies: list[dict[str, Any]]) -> None:
        self.url, self.users, self.bodies = url, users, bodies
        self.lock = threading.Lock()
        self.next = 0
        self.jobs: dict[str, dict[str, Any]] = {}  # uid -> {user, workflow}
        self.refusals = 0
        self.errors: list[str] = []
        self.reads = 0
        self.ws_updates = 0
        self.ws_terminal = 0
        self.done = threading.Event()
        self.stop = threading.Event()

    def _take(self) -> dict[str, Any] | None:
        with self.lock:
            if self.next >= len(self.bodies):
                return None
            self.next += 1
            return self.bodies[self.next - 1]

    def submitter(self, n: int) -> None:
        user = self.users[n % len(self.users)]
        while (body := self._take()) is not None:
            while True:
                try:
                    status, doc, headers = _call(self.url + "/api/v1/jobs", "POST", body, user["key"])
                except OSError as exc:
                    self.errors.append(f"submit: {exc}")
                    break
                if status == 202:
                    with self.lock:
                        self.jobs[doc["uid"]] = {"user": user, "workflow": body["workflow"]}
                    break
                if status in (429, 503):  # the engine or the quota says later: later it is
                    with self.lock:
                        self.refusals += 1
                    time.sleep(min(0.5, float(headers.get("Retry-After", 1))))
                    continue
                self.errors.append(f"submit answered {status}: {doc}")
                break

    def _some_job(self) -> tuple[str, dict[str, Any]] | None:
        with self.lock:
            if not self.jobs:
                return None
            uid = random.choice(list(self.jobs)[-40:])
            return uid, self.jobs[uid]

    def _picks(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """One of the recent jobs at a time until the run stops (none yet: the first submissions are due)."""
        while not self.stop.is_set():
            got = self._some_job()
            if got is None:
                time.sleep(0.05)
                continue
            yield got

    def reader(self) -> None:
        for uid, job in self._picks():
            try:
                status, doc, _ = _call(f"{self.url}/api/v1/jobs/{uid}", key=job["user"]["key"])
                if status != 200:
                    self.errors.append(f"read {uid} answered {status}: {doc}")
                status, doc, _ = _call(f"{self.url}/api/v1/jobs?page_size=20", key=job["user"]["key"])
                if status != 200:
                    self.errors.append(f"list answered {status}: {doc}")
                self.reads += 2
            except OSError as exc:
                self.errors.append(f"read: {exc}")
            time.sleep(0.02)

    def subscriber(self) -> None:
        from websockets.sync.client import connect

        host = self.url.split("://", 1)[1]
        for uid, job in self._picks():
            try:
                with connect(f"ws://{host}/ws/jobs/{uid}", origin=self.url,  # type: ignore[arg-type]
                             additional_headers={"Cookie": f"sessionid={job['user']['session']}"},
                             open_timeout=10) as ws:
                    deadline = time.monotonic() + 20
                    while time.monotonic() < deadline and not self.stop.is_set():
                        try:
                            msg = json.loads(ws.recv(timeout=1))
                        except TimeoutError:
                            continue
                        if msg.get("type") != "job":  # the job's ETA (and other kinds) between its states
                            continue
                        self.ws_updates += 1
                        if msg["job"]["state"] in ("completed", "failed", "cancelled", "expired"):
                            self.ws_terminal += 1
                            break
            except Exception as exc:  # counted: a subscriber must never be refused
                self.errors.append(f"websocket {uid}: {type(exc).__name__}: {exc}")

    def threads(self) -> list[threading.Thread]:
        # daemons: a failed check must not leave the test process waiting for them
        ts = [threading.Thread(target=self.submitter, args=(i,), name=f"ledger-submit-{i}", daemon=True)
              for i in range(SUBMITTERS)]
        ts += [threading.Thread(target=self.reader, name=f"ledger-read-{i}", daemon=True) for i in range(READERS)]
        ts += [threading.Thread(target=self.subscriber, name=f"ledger-ws-{i}", daemon=True)
               for i in range(SUBSCRIBERS)]
        return ts


def _wait_all_finished(url: str, users: list[dict[str, Any]], want: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        pending, seen = 0, 0
        for u in users:
            for state in ("queued", "in_progress"):
                _, doc, _ = _call(f"{url}/api/v1/jobs?state={state}&page_size=1", key=u["key"])
                pending += doc["count"]
            _, doc, _ = _call(f"{url}/api/v1/jobs?page_size=1", key=u["key"])
            seen += doc["count"]
        if pending == 0 and seen >= want:
            return
        assert time.monotonic() < deadline, f"{pending} jobs still pending after {timeout}s ({seen}/{want} seen)"
        time.sleep(0.5)


def _events_of(redis_url: str, uid: str) -> list[dict[str, str]]:
    import redis as redis_lib

    r = redis_lib.Redis.from_url(redis_url)
    try:
        return [{k.decode(): v.decode() for k, v in f.items()} | {"id": i.decode()}
                for i, f in r.xrange(keys.EVENTS) if f[b"uid"].decode() == uid]
    finally:
        r.close()


def _wait_drained(url: str, redis_url: str, timeout: float) -> None:
    """Until the reconciler has dealt with the whole stream (a row may be finished earlier, by a status read
    or the sweep, while its stage events are still ahead of the reconciler's cursor)."""
    import redis as redis_lib

    r = redis_lib.Redis.from_url(redis_url)
    deadline = time.monotonic() + timeout
    try:
        while True:
            m = _metrics(url)
            done = sum(m.get(f"onepiece_ledger_events_total:{k}", 0) for k in ("applied", "held", "dead"))
            last = r.xrevrange(keys.EVENTS, count=1)
            if done >= r.xlen(keys.EVENTS) and m.get("onepiece_ledger_held_events", 0) == 0:
                return
            assert time.monotonic() < deadline, (done, r.xlen(keys.EVENTS), last, m)
            time.sleep(0.5)
    finally:
        r.close()


def _check_job(url: str, uid: str, job: dict[str, Any], redis_url: str) -> tuple[float, int]:
    """Every stage started and finished, measured cost = their sum; returns (charge, stage runs)."""
    status, doc, _ = _call(f"{url}/api/v1/jobs/{uid}", key=job["user"]["key"])
    assert status == 200, doc
    assert doc["state"] == "completed", (doc["state"], doc["detail"], doc, _events_of(redis_url, uid))
    runs = doc["stage_runs"]
    for stage in ROUTES[job["workflow"]]:
        mine = [r for r in runs if r["stage"] == stage]
        assert mine and all(r["started"] is not None and r["finished"] is not None for r in mine), (
            stage, doc, _events_of(redis_url, uid), _metrics(url))
        assert stage in doc["stage_times"] and {"started", "finished"} <= set(doc["stage_times"][stage]), doc
    total = sum(r["device_s"] for r in runs if r["device_s"] is not None)
    assert doc["cost_measured_gpu_s"] == pytest.approx(total, abs=1e-5), doc
    assert doc["cost_estimate_gpu_s"] > 0
    return float(doc["cost_measured_gpu_s"]), len(runs)


def _check_stream(redis_url: str, jobs: dict[str, dict[str, Any]]) -> int:
    """The engine's side: every stage of every job wrote stage_started then stage_finished, the last stage
    included, all before the terminal event. Returns the stream's length."""
    import redis as redis_lib

    r = redis_lib.Redis.from_url(redis_url)
    entries = r.xrange(keys.EVENTS)
    r.close()
    seen: dict[str, list[tuple[str, str]]] = {}
    for _id, f in entries:
        seen.setdefault(f[b"uid"].decode(), []).append((f[b"type"].decode(), f[b"stage"].decode()))
    for uid, job in jobs.items():
        events = seen[uid]
        terminal = [i for i, (t, _) in enumerate(events) if t == "completed"]
        assert len(terminal) == 1, events
        for stage in ROUTES[job["workflow"]]:
            started = [i for i, e in enumerate(events) if e == ("stage_started", stage)]
            finished = [i for i, e in enumerate(events) if e == ("stage_finished", stage)]
            assert len(started) == len(finished) == 1 and started[0] < finished[0] < terminal[0], (stage, events)
    return len(entries)


def _counters(redis_url: str, user_id: int) -> tuple[int, float]:
    import datetime as dt

    import redis as redis_lib

    from onepiece_platform.quotas import counters

    r = redis_lib.Redis.from_url(redis_url)
    day = dt.datetime.now(dt.UTC).strftime("%Y%m%d")
    running, spent = r.mget(*counters._keys(user_id, day)[:2])  # the user's running count and the day's GPU s
    r.close()
    return int(running or 0), float(spent or 0.0)


def _ledger_charges(p: Platform) -> dict[int, float]:
    """user id -> the ledger's charge of today (measured, else the estimate), read by the platform itself."""
    out = p.run_manage("shell", "-c", """
import json
from django.db.models import Sum
from django.db.models.functions import Coalesce
from onepiece_platform.jobs.models import Job
from onepiece_platform.quotas import counters
rows = Job.objects.filter(quota_day=counters.today()).values("owner_id").annotate(
    s=Sum(Coalesce("cost_measured_gpu_s", "cost_estimate_gpu_s")))
print("CHARGES " + json.dumps({r["owner_id"]: r["s"] for r in rows}))
""")
    return {int(k): float(v) for k, v in json.loads(out.split("CHARGES ", 1)[1]).items()}


def _counters_match(p: Platform, redis_url: str, users: list[dict[str, Any]], timeout: float = 20) -> None:
    """The quota counters hold no running job and exactly the ledger's charges. A settlement that met Redis
    away is repeated by the reconciler's sweep (every 2 s here), hence the wait."""
    deadline = time.monotonic() + timeout
    while True:
        charges = _ledger_charges(p)
        got = {u["id"]: _counters(redis_url, u["id"]) for u in users}
        bad = {uid: (running, spent, charges.get(uid, 0.0)) for uid, (running, spent) in got.items()
               if running != 0 or abs(spent - charges.get(uid, 0.0)) > 1e-4}
        if not bad:
            return
        if time.monotonic() > deadline:
            out = p.run_manage("shell", "-c", """
from onepiece_platform.jobs.models import Job
for j in Job.objects.order_by("created_at"):
    print(j.owner_id, j.uid, j.state, j.cost_estimate_gpu_s, j.cost_measured_gpu_s, j.charge_version,
          j.charge_settled, j.quota_day, j.created_at.time(), j.finished_at and j.finished_at.time())
""")
            import redis as redis_lib

            from onepiece_platform.quotas import counters

            r = redis_lib.Redis.from_url(redis_url)
            records = {k.decode(): r.hgetall(k) for k in r.scan_iter(counters._job_prefix() + "*")}
            r.close()
            raise AssertionError(f"counters differ from the ledger: {bad}\nledger:\n{out[-6000:]}\n"
                                 f"records: {records}")
        time.sleep(1)


def _cut_reconciler_connection(pg_dsn: str, timeout: float = 60) -> int:
    """Wait for the reconciler's database connection (it reconnects after the last cut), then cut it."""
    import psycopg

    deadline = time.monotonic() + timeout
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        while True:
            rows = conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                "WHERE application_name = 'ledger-reconciler'").fetchall()
            if rows:
                return len(rows)
            assert time.monotonic() < deadline, "the reconciler never connected"
            time.sleep(0.05)


@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
def test_every_event_applied_every_stage_timed_every_charge_exact(
        database: str, stack: Stack, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    import redis as redis_lib

    redis, etcd, cluster = stack.redis, stack.etcd, stack.cluster
    r = redis_lib.Redis.from_url(redis.url)
    r.flushdb()  # the other database's run left its stream and counters
    r.close()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONEPIECE_") and k != "DJANGO_SETTINGS_MODULE"}
    env.update(ONEPIECE_STATE_DIR=str(tmp_path / "state"), ONEPIECE_REDIS_URL=redis.url, ONEPIECE_ETCD_URL=etcd.url,
               ONEPIECE_PROXY_URL=cluster.proxy, ONEPIECE_PROXY_TOKEN=os.environ["ONEPIECE_PROXY_TOKEN"],
               ONEPIECE_SQLITE_PATH=str(tmp_path / "state" / "db.sqlite3"),
               DJANGO_SETTINGS_MODULE="tests.fixtures.process_settings", DJANGO_SECRET_KEY=secrets.token_hex(32),
               # short grace periods: a fault's consequences are decided within the test's time
               ONEPIECE_TEST_SETTINGS=json.dumps({"LOST_AFTER_S": 6.0, "HOLD_UNKNOWN_S": 5.0}),
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT / "platform"), str(REPO_ROOT)]))
    pg_dsn = ""
    if database == "postgresql":
        pg = request.getfixturevalue("postgres_server")
        pg_dsn = pg.dsn()
        env["ONEPIECE_TEST_PG_PORT"] = str(pg.port)
    p = Platform(tmp_path / "state", env)
    load: Load | None = None
    try:
        p.run_manage("migrate", "--noinput", "-v", "0")
        users = _setup_users(p)
        p.start_web()
        rec_env = {"ONEPIECE_TEST_APP_NAME": "ledger-reconciler"}  # its PostgreSQL connections are told apart
        p.start_reconciler(rec_env)

        # -- phase one: the load, with the reconciler killed mid-batch and its connection cut ------------------
        load = Load(p.url, users, _bodies())
        threads = load.threads()
        for t in threads:
            t.start()
        kills = cuts = 0
        while len(load.jobs) < len(load.bodies) // 3 and any(t.is_alive() for t in threads[:SUBMITTERS]):
            time.sleep(0.1)
        deadline = time.monotonic() + 120
        while (applied_before := _metrics(p.url).get("onepiece_ledger_events_total:applied", 0)) < 100:
            assert time.monotonic() < deadline, "the reconciler applies nothing"  # it is busy: kill it mid-batch
            time.sleep(0.1)
        p.kill_reconciler()  # SIGKILL: whatever batch it was in, its transaction of the moment is lost
        kills += 1
        time.sleep(1.0)
        p.start_reconciler(rec_env)
        if pg_dsn:  # while the restarted reconciler catches up
            for _ in range(5):  # a lost connection: retried with backoff, the cursor standing still
                cuts += _cut_reconciler_connection(pg_dsn)
                time.sleep(0.3)
        for t in threads[:SUBMITTERS]:
            t.join(300)
        assert not load.errors, load.errors[:10]
        _wait_all_finished(p.url, users, len(load.bodies), timeout=240)
        _wait_drained(p.url, redis.url, timeout=120)
        load.stop.set()
        for t in threads[SUBMITTERS:]:
            t.join(30)
        assert not load.errors, load.errors[:10]
        assert len(load.jobs) == len(load.bodies)

        stage_runs = 0
        for uid, job in load.jobs.items():
            stage_runs += _check_job(p.url, uid, job, redis.url)[1]
        _counters_match(p, redis.url, users)  # exact: no charge lost, none counted twice (the kill replayed events)
        stream_events = _check_stream(redis.url, load.jobs)
        m = _metrics(p.url)
        assert m["onepiece_ledger_events_total:applied"] > applied_before > 0
        # every event of the stream was applied (held ones too), none skipped. (A replay is counted again only
        # when a connection is cut while its COMMIT is acknowledged, so at least, not exactly.)
        assert m["onepiece_ledger_events_total:applied"] >= stream_events
        assert m["onepiece_ledger_dead_letters:malformed"] == 0 and m["onepiece_ledger_dead_letters:failed"] == 0
        assert m["onepiece_ledger_dead_letters:unknown_job"] == 0
        phase_one = dict(m)

        # -- phase two: Redis restarted under a few jobs ------------------------------------------------------------
        u = users[0]
        before = [_call(p.url + "/api/v1/jobs", "POST", b, u["key"]) for b in _bodies()[:6]]
        in_flight = [doc["uid"] for status, doc, _ in before if status == 202]
        time.sleep(0.3)
        redis = stack.redis = _restart_redis(redis)
        deadline = time.monotonic() + 30
        after: list[str] = []
        later = [b for b in _bodies() if b["workflow"] == "sd-t2i"][:3]
        while len(after) < len(later):  # the first submissions after the restart seed the counters from the ledger
            status, doc, _ = _call(p.url + "/api/v1/jobs", "POST", later[len(after)], u["key"])
            if status == 202:
                after.append(doc["uid"])
            else:
                assert status in (429, 503), (status, doc)
                assert time.monotonic() < deadline, (status, doc)
                time.sleep(0.5)
        _wait_all_finished(p.url, users, len(load.bodies) + len(in_flight) + len(after), timeout=90)
        _wait_drained(p.url, redis.url, timeout=60)
        states = {uid: _call(f"{p.url}/api/v1/jobs/{uid}", key=u["key"])[1]["state"] for uid in in_flight + after}
        assert all(s in ("completed", "failed") for s in states.values()), states
        for uid in after:  # submitted after the restart: nothing was lost for them
            _check_job(p.url, uid, {"user": u, "workflow": "sd-t2i"}, redis.url)
        _counters_match(p, redis.url, [u])  # re-seeded from the ledger (by u's next submission), then settled exactly
        m = _metrics(p.url)

        logs = p.log_text()
        assert "database is locked" not in logs
        counts = {
            "database": database,
            "jobs": len(load.jobs),
            "jobs_by_workflow": {wf: sum(1 for j in load.jobs.values() if j["workflow"] == wf) for wf in ROUTES},
            "stage_runs": stage_runs,
            "stream_events": stream_events,
            "events_applied": int(phase_one["onepiece_ledger_events_total:applied"]),
            "events_retried": int(phase_one["onepiece_ledger_events_total:retried"]),
            "events_held": int(phase_one["onepiece_ledger_events_total:held"]),
            "dead_letters": int(sum(v for k, v in phase_one.items() if k.startswith("onepiece_ledger_dead_letters:"))),
            "reconciler_sigkills": kills,
            "db_connections_cut": cuts,
            "refusals_retried_by_clients": load.refusals,
            "status_reads": load.reads,
            "websocket_updates": load.ws_updates,
            "websocket_terminal_states_seen": load.ws_terminal,
            "redis_restart": {"jobs_in_flight": len(in_flight), "jobs_after": len(after),
                              "states": sorted(states.values()),
                              "events_applied_total": int(m["onepiece_ledger_events_total:applied"]),
                              "dead_letters_total": int(sum(v for k, v in m.items()
                                                            if k.startswith("onepiece_ledger_dead_letters:")))},
        }
        ARTIFACTS.mkdir(exist_ok=True)
        (ARTIFACTS / f"ledger-counts-{database}.json").write_text(json.dumps(counts, indent=2) + "\n")
        print(f"\nledger counts ({database}): {json.dumps(counts)}")
        assert load.ws_terminal > 0
    finally:
        if load is not None:
            load.stop.set()
            with load.lock:
                load.next = len(load.bodies)  # submitters stop too
        p.stop()
        logs_dir = ARTIFACTS / f"ledger-logs-{database}"
        logs_dir.mkdir(parents=True, exist_ok=True)
        for f in p.logs.glob("*.log"):
            (logs_dir / f.name).write_bytes(f.read_bytes())
