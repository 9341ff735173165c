"""The dashboard against the real engine: a client submits through the REST API with an API key, an
operator watches the queue and progress move in the browser (no reload), the jobs complete, and the
job's detail shows its stage timeline and the image the engine made.

The engine is what an operator runs: ``onepiece node`` (one worker process per sd-t2i stage over the
tiny models, text_encode stretched to 3 s so a queue forms) and ``onepiece proxy``, on the session's
redis-server and etcd. The platform runs in this process (uvicorn thread) with the ledger reconciler
in a thread of its own, as `onepiece up` runs it beside the web server.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.browser.conftest import login, make_user, shot
from tests.fixtures.runtime import NodeRun
from tests.fixtures.runtime import engine as start_engine  # the fixture below is named engine

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow, pytest.mark.models]
WF = "sd-t2i"
ENGINE_DB = 6  # engine tests use db 0, web tests db 5
TEXT_ENCODE_S = 3.0
ROOT = f"/test-{os.getpid()}-browser"  # the engine's etcd root: its own, on the session's etcd


@dataclass
class Engine:
    proxy: str
    redis_url: str
    node: subprocess.Popen[str]
    proxy_proc: subprocess.Popen[str]
    start_reconciler: Any = None


@pytest.fixture(scope="module")
def engine(redis_server: Any, etcd_server: Any, tiny_models: dict[str, Path],
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    import redis

    from engine.coord import etcd_client
    from engine.worker.config import Assignment, InstanceSpec
    from engine.workflow import get_workflow

    redis_url = redis_server.url.rsplit("/", 1)[0] + f"/{ENGINE_DB}"
    redis.Redis.from_url(redis_url).flushdb()
    etcd = etcd_client(etcd_server.url)
    etcd.delete_prefix(ROOT + "/")
    instances = tuple(InstanceSpec(f"{WF}.{s}.0", WF, s, "cpu", 0.2 if s == "denoise" else 0.0)
                      for s in get_workflow(WF).route())
    node = NodeRun("browser-node", Assignment(instances, {WF: str(tiny_models[WF])}),
                   ("--stage-time", f"{WF}/text_encode={TEXT_ENCODE_S}"))
    try:
        with start_engine(redis_url, etcd_server.url, [node], tmp_path_factory.mktemp("browser-node"),
                          f"test-{os.getpid()}-browser-", root=ROOT) as (c, _procs):
            yield Engine(c.proxy, redis_url, c.node, c.proxy_proc)
    finally:
        etcd.delete_prefix(ROOT + "/")


@pytest.fixture
def platform_on_engine(engine: Engine, live_asgi: Any, settings: Any) -> Iterator[Engine]:
    """The platform (already serving) pointed at the engine: its Redis, its Proxy, its etcd root; and the
    ledger reconciler running beside it."""
    from onepiece_platform import redis_conn
    from onepiece_platform.engine_link.client import reset_engines
    from onepiece_platform.engine_link.cluster import reset_clusters
    from onepiece_platform.engine_link.reconciler import Reconciler

    settings.REDIS_URL = engine.redis_url
    settings.ONEPIECE = {**settings.ONEPIECE, "ENGINE_CLIENT": "onepiece_platform.engine_link.proxy.ProxyEngineClient",
                         "PROXY_URL": engine.proxy, "ETCD_ROOT": ROOT}
    redis_conn.close_all()
    reset_engines()
    reset_clusters()
    stop = threading.Event()
    t = threading.Thread(target=lambda: Reconciler(block_ms=200).run(stop, sweep_every_s=2.0),
                         name="browser-reconciler", daemon=True)
    # started by the test (engine.start_reconciler) once its submissions are in: the test database is
    # SQLite's shared in-memory one, whose table locks fail a concurrent writer at once instead of waiting
    engine.start_reconciler = t.start
    yield engine
    stop.set()
    if t.is_alive():
        t.join(10)
    redis_conn.close_all()
    reset_engines()
    reset_clusters()


def _submit(base: str, key: str, seed: int) -> str:
    """Submit as a client that retries a 5xx does: with an Idempotency-Key, so a retry is the same job.

    The test database is SQLite's shared in-memory one, whose table lock fails a write at once (a 500)
    while the page's own reads refresh a running job's row; PostgreSQL waits instead. A retry with the same
    key cannot make a second job (the platform answers the first), so nothing is hidden: the test still
    counts exactly its three jobs."""
    body = {"workflow": WF, "params": {"prompt": f"a cat {seed}", "height": 64, "width": 64,
                                       "num_inference_steps": 8, "seed": seed}}
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}",
               "Idempotency-Key": f"browser-test-{seed}-{os.getpid()}"}
    for attempt in range(4):
        req = urllib.request.Request(base + "/api/v1/jobs", data=json.dumps(body).encode(), method="POST",
                                     headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                assert r.status in (200, 202), r.status  # 200: the same key's job, answered again
                return str(json.loads(r.read())["uid"])
        except urllib.error.HTTPError as e:
            if e.code != 500 or attempt == 3:
                raise AssertionError(f"submit answered {e.code}: {e.read()[:2000]!r}") from None
    raise AssertionError("unreachable")


ROWS = """uids => uids.map(uid => {
    const r = document.querySelector(`#jobs-table tr[data-uid="${uid}"]`);
    if (!r) return null;
    return {state: r.querySelector('.state').textContent, progress: +r.querySelector('progress').value,
            queue: r.querySelector('.queue').textContent};
})"""


def test_submitted_jobs_move_live_to_completed_with_timeline_and_image(platform_on_engine, live_asgi, browser) -> None:
    from onepiece_platform.accounts.models import ApiKey

    make_user("ops", staff=True)
    _, key = ApiKey.issue(make_user("client", staff=False), "browser test")
    ctx = browser.new_context(viewport={"width": 1600, "height": 1000})
    page = ctx.new_page()
    try:
        login(page, live_asgi.url, "ops")
        # the real node's report, with the host's devices as its sampler saw them (no NVML here)
        node = page.wait_for_selector('[data-node="browser-node"] tr.device', timeout=20_000)
        assert ("NVML" in node.inner_text()) != ("CPU figures (no GPU)" in node.inner_text())
        assert page.inner_text(f'[data-workflow="{WF}"] [data-stage="denoise"] .count') == "1 instance"
        # each instance's CPU thread budget, as the node gave it (auto: the host's cores over its instances)
        from engine.worker.threads import usable_cores
        from engine.workflow import get_workflow

        budget = max(1, usable_cores() // len(get_workflow(WF).route()))
        cell = page.wait_for_selector(f'[data-node="browser-node"] tr[data-instance="{WF}.denoise.0"] td.threads')
        assert cell.inner_text() == str(budget)
        # the most requests that may share a step there, as the node reports it (the spec's, unless set)
        row = f'[data-node="browser-node"] tr[data-instance="{WF}.denoise.0"]'
        want = get_workflow(WF).stage("denoise").max_batch
        assert page.inner_text(f"{row} td.batch") == str(want)
        assert page.inner_text(f"{row} td.nice") != "–"
        shot(page, "engine-cluster")
        page.click('nav a[data-view="jobs"]')
        page.evaluate("window.__noReload = true")

        uids = [_submit(live_asgi.url, key, seed) for seed in range(3)]
        platform_on_engine.start_reconciler()
        seen: dict[str, list[dict[str, Any]]] = {u: [] for u in uids}
        shot_mid = False
        deadline = time.monotonic() + 240
        while True:
            for uid, row in zip(uids, page.evaluate(ROWS, uids), strict=True):
                if row and (not seen[uid] or seen[uid][-1] != row):
                    seen[uid].append(row)
            if not shot_mid and any(r and r["state"] == "in_progress" for r in (s[-1] for s in seen.values() if s)):
                shot(page, "engine-jobs-running")
                shot_mid = True
            if all(s and s[-1]["state"] == "completed" for s in seen.values()):
                break
            assert time.monotonic() < deadline, f"not all completed: {seen}"
            time.sleep(0.15)
        print("\nwhat the page showed, per job:\n" + "\n".join(f"{u[:8]}: {s}" for u, s in seen.items()))
        assert page.evaluate("window.__noReload") is True  # all of it without a reload

        # the queue moved: a job waiting behind others was shown with a position that then went down
        positions = {u: [int(r["queue"]) for r in s if r["state"] == "queued" and r["queue"].isdigit()]
                     for u, s in seen.items()}
        assert any(len(p) >= 2 and p[0] > p[-1] for p in positions.values()), positions
        # progress moved while jobs ran, and every job ended completed at 100%
        running = {r["progress"] for s in seen.values() for r in s if r["state"] == "in_progress"}
        assert len({p for p in running if 0 < p < 100}) >= 2, running
        assert all(s[-1] == {"state": "completed", "progress": 100, "queue": "–"} for s in seen.values())
        shot(page, "engine-jobs-completed")

        page.click(f'tr[data-uid="{uids[-1]}"]')
        page.wait_for_selector("#job-gantt rect[data-stage='image_encode']", timeout=10_000)
        bars = page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('#job-gantt rect[data-stage]')]
            .map(r => [r.dataset.stage, [+r.getAttribute('x'), +r.getAttribute('width')]]))""")
        assert set(bars) == {"waiting", "text_encode", "denoise", "vae_decode", "image_encode"}
        # the bars are the stage times the engine's events reported: text_encode held its 3 s floor,
        # and each bar's length is its stage's share of the job's time
        job = page.evaluate(f"fetch('/dashboard/api/jobs/{uids[-1]}').then(r => r.json()).then(d => d.job)")
        took = {s["stage"]: s["finished"] - s["started"] for s in job["stages"] if s["finished"] and s["started"]}
        assert took["text_encode"] >= TEXT_ENCODE_S - 0.05, took
        per_second = bars["text_encode"][1] / took["text_encode"]
        assert bars["denoise"][1] == pytest.approx(took["denoise"] * per_second, abs=1.0)
        order = sorted((v[0], s) for s, v in bars.items() if s != "waiting")
        assert [s for _, s in order] == ["text_encode", "denoise", "vae_decode", "image_encode"]
        page.wait_for_function("document.querySelector('#job-result img')?.complete &&"
                               " document.querySelector('#job-result img').naturalWidth === 64", timeout=10_000)
        shot(page, "engine-job-detail")

        # the workers' measured stage times reach the cluster view through the node's report in etcd
        page.click('nav a[data-view="cluster"]')
        te = f'[data-workflow="{WF}"] [data-stage="text_encode"]'
        page.wait_for_function(f"!document.querySelector('{te}').textContent.includes('service –')", timeout=15_000)
        page.wait_for_function(f"![...document.querySelectorAll('[data-workflow=\"{WF}\"] .stage')]"
                               ".some(e => e.textContent.includes('service –'))", timeout=15_000)
        service = {s: float(t.split("service ", 1)[1].split(" s", 1)[0]) for s, t in page.evaluate(
            f"[...document.querySelectorAll('[data-workflow=\"{WF}\"] .stage')].map(e => [e.dataset.stage, e.innerText])")}
        assert service["text_encode"] >= TEXT_ENCODE_S - 0.05, service
        # no Node Manager runs here: the times are the instances' own, said to be measured, and the page
        # names no bottleneck of its own (that is the leader's figure: tests/browser/test_dashboard.py)
        assert "(measured)" in page.inner_text(te)
        assert page.query_selector(f'[data-workflow="{WF}"] .stage.bottleneck') is None
        shot(page, "engine-cluster-after")
    finally:
        ctx.close()
