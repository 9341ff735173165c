"""A real Celery worker against the real Redis broker: JSON tasks run, a pickled message is refused."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine import procs
from tests.fixtures.workers import Workers

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def worker(web_redis: str, tmp_path: Path) -> Iterator[tuple[Any, Path]]:
    from onepiece_platform.celery_app import app

    log = tmp_path / "worker.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ONEPIECE_", "DJANGO_"))}
    env.update(DJANGO_SETTINGS_MODULE="onepiece_platform.settings.test", ONEPIECE_REDIS_URL=web_redis,
               ONEPIECE_ENGINE_CLIENT="onepiece_platform.engine_link.local.LocalEngineClient",
               PYTHONPATH=os.pathsep.join([str(REPO_ROOT / "platform"), str(REPO_ROOT)]))
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "onepiece_platform", "worker", "--pool", "solo",
                                 "--without-gossip", "--without-mingle", "--without-heartbeat", "-l", "info"],
                                cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    # point this process's client at the same broker and result store; the app caches its backend and
    # connection pool from settings on first use, so those caches are swapped too and restored after
    saved = (app.conf.broker_url, app.conf.result_backend, app._backend_cache, getattr(app._local, "backend", None))
    _use(app, web_redis, web_redis, None, None)
    try:
        yield app, log
    finally:
        _use(app, *saved)
        procs.stop(proc, timeout=30)


def _use(app: Any, broker: str, results: str, backend_cache: Any, local_backend: Any) -> None:
    app.pool.force_close_all()
    app._pool = None
    app.conf.update(broker_url=broker, result_backend=results)
    app._backend_cache = backend_cache
    app._local.backend = local_backend


@pytest.mark.timeout(120)
def test_worker_runs_json_tasks_and_refuses_pickle(worker, web_redis) -> None:
    app, log = worker
    from onepiece_platform.engine_link.tasks import warm_up

    workers = Workers(web_redis)
    try:
        report = warm_up.apply_async(args=[["sd-t2i"], []], kwargs={"timeout_s": 20}).get(timeout=90)
    finally:
        workers.close()
    assert report["sd-t2i"]["sent"] == 1 and report["sd-t2i"]["completed"] == 1
    app.send_task("onepiece.clean_up", args=[30], serializer="pickle")
    deadline = time.monotonic() + 30
    while "untrusted content" not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
        time.sleep(0.2)
