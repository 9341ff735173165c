"""A real one-node deployment for the runtime tests, started once per session.

Redis and etcd (the session fixtures), the tiny models, ``onepiece node`` with
one worker process per stage of both workflows, and ``onepiece proxy``: the
same commands an operator runs. Rings are named ``onepiece-test-<pid>-*`` and
the fixture checks at teardown that none is left behind.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engine.proxy.auth import auth_headers
from tests.e2e.up import stop_up
from tests.engine.stages.conftest import input_png, tiny_models  # noqa: F401 - fixtures reused here

# sd-t2i's denoise sleeps this long after every step, so cancel and SIGKILL
# tests can catch a request mid-denoise (see InstanceSpec.step_delay_s).
SD_STEP_DELAY_S = 0.05
STARTUP_TIMEOUT_S = 240


@dataclass
class Cluster:
    proxy: str
    node: subprocess.Popen[str]
    proxy_proc: subprocess.Popen[str]
    store: Any
    etcd: Any
    run_dir: Path
    ring_prefix: str
    other_proxies: tuple[str, ...] = ()  # more Proxies' URLs (engine() with several proxy_args)

    # -- HTTP helpers -------------------------------------------------------------------------
    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, Any, dict[str, str]]:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data else {}
        req = urllib.request.Request(self.proxy + path, data=data, method=method,
                                     headers={**headers, **auth_headers(os.environ["ONEPIECE_PROXY_TOKEN"])})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                raw, status, headers = r.read(), r.status, dict(r.headers)
        except urllib.error.HTTPError as e:
            raw, status, headers = e.read(), e.code, dict(e.headers)
        ctype = headers.get("Content-Type", "")
        return status, (json.loads(raw) if ctype.startswith("application/json") else raw), headers

    def submit(self, workflow: str, params: dict[str, Any], inputs: dict[str, bytes] | None = None,
               **extra: Any) -> str:
        body = {"workflow": workflow, "params": params,
                "inputs": {k: base64.b64encode(v).decode() for k, v in (inputs or {}).items()}, **extra}
        status, doc, _ = self.call("POST", "/v1/requests", body)
        assert status == 202, doc
        return str(doc["uid"])

    def wait(self, uid: str, states: set[str], timeout: float = 120) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            status, doc, _ = self.call("GET", f"/v1/requests/{uid}")
            assert status == 200, doc
            if doc["state"] in states:
                return dict(doc)
            assert time.monotonic() < deadline, f"{uid} still {doc} after {timeout}s"
            time.sleep(0.05)

    def events(self, uid: str) -> list[dict[str, str]]:
        return list(self.store.events(uid))

    def node_report(self) -> dict[str, Any]:
        values = self.etcd.get("/onepiece/nodes/test-node")
        return json.loads(values[0]) if values else {}


def _stop(proc: subprocess.Popen[str], timeout: float = 60) -> str:
    return stop_up(proc, timeout)  # Ctrl-C, then a kill after the timeout: what an operator does


@pytest.fixture(scope="session")
def cluster(redis_server: Any, etcd_server: Any, tiny_models: dict[str, Path],  # noqa: F811
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    from engine.coord import etcd_client
    from engine.store import JobStore
    from engine.worker.config import Assignment, default_assignment

    store = JobStore.from_url(redis_server.url, ttl=600)
    store.r.flushdb()
    store.close()
    etcd_client(etcd_server.url).delete_prefix("/onepiece/")
    base = default_assignment({k: str(v) for k, v in tiny_models.items()}, device="cpu")
    instances = tuple(
        type(i)(i.id, i.workflow, i.stage, i.device, SD_STEP_DELAY_S if i.id == "sd-t2i.denoise.0" else 0.0)
        for i in base.instances
    )
    node = NodeRun("test-node", Assignment(instances, base.model_dirs))
    with engine(redis_server.url, etcd_server.url, [node], tmp_path_factory.mktemp("node"),
                f"test-{os.getpid()}-") as (c, _procs):
        yield c


@dataclass
class NodeRun:
    """One ``onepiece node`` of a multi-node test engine."""

    name: str
    assignment: Any  # engine.worker.config.Assignment
    args: tuple[str, ...] = ()  # extra `onepiece node` arguments
    wrap: Callable[[list[str]], list[str]] = lambda argv: argv  # e.g. run it in a network namespace


@contextmanager
def engine(redis_url: str, etcd_url: str, nodes: list[NodeRun], tmp: Path, prefix: str,
           env_extra: dict[str, str] | None = None, proxy_args: tuple[tuple[str, ...], ...] = ((),),
           killed: frozenset[str] = frozenset(),
           ) -> Iterator[tuple[Cluster, dict[str, subprocess.Popen[str]]]]:
    """Nodes and Proxies (one per ``proxy_args``) started with the commands an operator runs; every node's
    rings are named ``<prefix><node>-...``. Waits until every instance's route is published and the first
    Proxy sees them; at the end checks clean exits (a node in ``killed`` may have been SIGKILLed on
    purpose) and that no ring is left."""
    from engine.coord import etcd_client
    from engine.store import JobStore

    store = JobStore.from_url(redis_url, ttl=600)
    etcd = etcd_client(etcd_url)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONEPIECE_")}
    env.update(ONEPIECE_REDIS_URL=redis_url, ONEPIECE_ETCD_URL=etcd_url, ONEPIECE_DEVICE="cpu",
               ONEPIECE_PROXY_TOKEN=os.environ["ONEPIECE_PROXY_TOKEN"],
               ONEPIECE_PROGRESS_INTERVAL_MS="0", ONEPIECE_ROUTE_REFRESH_S="0.2", **(env_extra or {}))
    onepiece = [sys.executable, "-m", "engine.cli"]
    procs: dict[str, subprocess.Popen[str]] = {}
    proxy = None
    extra: list[subprocess.Popen[str]] = []
    try:
        for n in nodes:
            run_dir = tmp / f"node-{n.name}"
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "assignment.json").write_text(n.assignment.to_json())
            procs[n.name] = subprocess.Popen(n.wrap([
                *onepiece, "node", "--node", n.name, "--run-dir", str(run_dir), "--assignment",
                str(run_dir / "assignment.json"), "--ring-prefix", f"{prefix}{n.name}-", "--ring-bytes",
                str(8 << 20), "--ring-slots", "64", *n.args]), env=env, stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True)
        urls = []
        for args in proxy_args:
            p = subprocess.Popen([*onepiece, "proxy", "--port", "0", *args], env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True)
            proxy = proxy or p
            if p is not proxy:
                extra.append(p)
            assert p.stdout is not None
            line = p.stdout.readline()
            assert line.startswith("proxy: "), line + _stop(p)
            urls.append(line.split(": ", 1)[1].strip())
        assert proxy is not None
        c = Cluster(urls[0], next(iter(procs.values())), proxy, store, etcd, tmp, prefix, tuple(urls[1:]))
        want = {i.id for n in nodes for i in n.assignment.instances}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            published = {m["key"].decode().rsplit("/", 1)[1] for _, m in etcd.get_prefix("/onepiece/routes/")}
            status, doc, _ = c.call("GET", "/readyz")
            checks = doc.get("checks", {}) if isinstance(doc, dict) else {}
            if published >= want and status == 200 and all(
                    v == "ok" for k, v in checks.items() if k.startswith("routes:") and k[7:] in
                    {i.workflow for n in nodes for i in n.assignment.instances}):
                break
            for p in procs.values():
                assert p.poll() is None, _stop(p)
            assert time.monotonic() < deadline, f"not ready: {sorted(want - published)} {doc}"
            time.sleep(0.25)
        yield c, procs
    finally:
        outs = {n: _stop(p) for n, p in procs.items()}
        proxy_out = _stop(proxy) if proxy is not None else ""
        for p in extra:
            _stop(p)
        store.close()
        left = [n for n in os.listdir("/dev/shm") if n.startswith(f"onepiece-{prefix}")]
        assert not left, f"rings left behind: {left}"
        for name, p in procs.items():
            assert p.returncode == 0 or (name in killed and p.returncode == -signal.SIGKILL), outs[name]
        assert proxy is None or proxy.returncode == 0, proxy_out


def logs(c: Cluster, instance: str) -> str:
    return "".join(p.read_text(errors="replace") for p in c.run_dir.glob(f"node-*/logs/{instance}.log"))
