"""A cluster rehearsal: three hosts (network namespaces), the deployment's roles on them, one host lost.

Placement (each host runs what a machine of the cluster would)::

    host 0: etcd member, Redis (with a password), TaskManager "host-0", Node Manager "nm-host0",
            the Proxy, the web platform (uvicorn, SQLite) and its reconciler
    host 1: etcd member, Node Manager "nm-host1" (started first: it leads)
    host 2: etcd member, TaskManager "host-2"

The commands are the manifests' (deploy/k8s/30-engine.yaml, 20-web.yaml; deploy/systemd):
``onepiece node --transport tcp --data-host <host address>``, ``onepiece manager --ttl 3
--slots-per-node 2 --workflow sd-t2i=DIR``, ``onepiece proxy --host --port``, ``uvicorn
onepiece_platform.asgi:application``, ``manage.py reconcile``; everything reads
``ONEPIECE_ETCD_URL`` = the three members' client URLs, host 1's member first, so every
process must fail over when host 1 goes.

The TaskManagers start with no assignment: the leading Node Manager assigns sd-t2i's four
stages over the two nodes. ``--slots-per-node 2`` x 2 nodes = 4 slots = one instance per
stage (Theorem 1 needs at least one each), so the placement puts two stages on each node
and every request crosses from host 0 to host 2 over the tcp transport.

Then host 1 is killed (every process in its namespace, SIGKILL) while requests are in
flight: the Node Manager on host 0 must lead within TTL + a few seconds, etcd must serve
with 2 of 3 members, and every request accepted before, during and after the loss must
complete (a 503 refusal retried by the client is no loss). Where network namespaces
cannot be made (not root), the hosts are loopback addresses and "killing host 1" kills
the processes started for it; the test prints which kind ran.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from engine.coord import etcd_client
from engine.coord.keys import Keyspace
from engine.embedded.services import free_port
from onepiece_launcher.up import WEB_SERVER_FLAGS
from tests.deploy.etcdcluster import etcd_cluster
from tests.netns import Hosts, hosts

KEYS = Keyspace()  # the engine's etcd keys under the default root (/onepiece)

pytestmark = [pytest.mark.models, pytest.mark.slow, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ROUTE = ["text_encode", "denoise", "vae_decode", "image_encode"]
STAGE_TIME_S = 0.3  # every stage takes at least this: requests stay in flight across the loss
PARAMS = {"prompt": "a lighthouse at dusk", "height": 64, "width": 64, "num_inference_steps": 2, "seed": 5}
TTL_S = 3
REDIS_PASSWORD = "rehearsal-secret"
TERMINAL = {"completed", "failed", "cancelled", "expired"}


def _http(method: str, url: str, body: Any = None, headers: dict[str, str] | None = None,
          timeout: float = 30) -> tuple[int, Any, dict[str, str]]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={**({"Content-Type": "application/json"} if data else {}), **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status, hdrs = r.read(), r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        raw, status, hdrs = e.read(), e.code, dict(e.headers)
    hdrs = {k.title(): v for k, v in hdrs.items()}  # uvicorn sends lower-case names
    return status, (json.loads(raw) if "json" in hdrs.get("Content-Type", "") else raw), hdrs


def _wait(what: str, cond: Any, timeout: float, interval: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = cond()
        except Exception:  # a service still starting (connection refused, a 5xx): look again
            got = None
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(interval)


class Rehearsal:
    """The processes started per host, their logs, and how to lose a host."""

    def __init__(self, net: Hosts, tmp: Path, env: dict[str, str]) -> None:
        self.net, self.tmp, self.env = net, tmp, env
        self.procs: dict[str, tuple[int, subprocess.Popen[bytes]]] = {}
        (tmp / "logs").mkdir(parents=True, exist_ok=True)

    def addr(self, i: int) -> str:
        return self.net[i].address

    def port(self, i: int, fixed: int) -> int:
        """In a namespace each host has its own ports; on loopback, a free one on the host's address."""
        return fixed if self.net.kind == "namespaces" else free_port(self.addr(i))

    def spawn(self, i: int, name: str, argv: list[str], **env: str) -> subprocess.Popen[bytes]:
        with open(self.tmp / "logs" / f"{name}.log", "ab") as out:
            p = subprocess.Popen(self.net[i].wrap(argv), env={**self.env, **env}, cwd=REPO, stdout=out,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs[name] = (i, p)
        return p

    def log(self, name: str) -> str:
        path = self.tmp / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def alive(self, name: str) -> bool:
        return self.procs[name][1].poll() is None

    def kill_host(self, i: int) -> set[int]:
        """SIGKILL every process on host i: in its namespace (all of them, children included), or ours."""
        killed = set()
        for _name, (h, p) in self.procs.items():
            if h == i and p.poll() is None:
                p.kill()
                killed.add(p.pid)
        for pid in self.net[i].pids():
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
        for _name, (h, p) in self.procs.items():
            if h == i:
                p.wait(10)
        return killed

    def stop_all(self) -> dict[str, str]:
        """TaskManagers first (SIGINT: they stop their workers and unlink their rings), then the rest."""
        order = sorted(self.procs, key=lambda n: 0 if n.startswith("node-") else 1)
        for name in order:
            _, p = self.procs[name]
            if p.poll() is None:
                p.send_signal(signal.SIGINT if name.startswith("node-") else signal.SIGTERM)
            if name.startswith("node-"):
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
        for name in order:
            _, p = self.procs[name]
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        return {n: self.log(n)[-3000:] for n in order}


def _leader(etcd: Any) -> tuple[str, int] | None:
    got = etcd.get(KEYS.leader(), metadata=True)
    if not got:
        return None
    return json.loads(got[0][0])["candidate"], int(got[0][1]["create_revision"])


def test_three_host_rehearsal_survives_losing_the_leading_managers_host(
        tiny_models: dict[str, Path], tmp_path: Path) -> None:
    t_start = time.monotonic()
    with hosts(3) as net:
        print(f"\nrehearsal hosts: {net.kind} ({', '.join(h.address for h in net.hosts)}; gateway {net.gateway})")
        ns = net.kind == "namespaces"
        with etcd_cluster(tmp_path / "etcd", [h.address for h in net.hosts], [h.wrap for h in net.hosts],
                          ports=(2379, 2380) if ns else None) as cluster:
            m = cluster.members
            # what ONEPIECE_ETCD_URL carries; host 1's member first, so losing it makes every client fail over
            etcd_url = ",".join(x.url for x in (m[1], m[0], m[2]))
            redis_port = 6379 if ns else free_port(net[0].address)
            redis_url = f"redis://:{REDIS_PASSWORD}@{net[0].address}:{redis_port}/0"
            env = {k: v for k, v in os.environ.items() if not k.startswith(("ONEPIECE_", "DJANGO_"))}
            env.update(ONEPIECE_ETCD_URL=etcd_url, ONEPIECE_REDIS_URL=redis_url, ONEPIECE_DEVICE="cpu",
                       ONEPIECE_TRANSPORT="tcp", ONEPIECE_PROGRESS_INTERVAL_MS="0", ONEPIECE_ROUTE_REFRESH_S="0.2",
                       ONEPIECE_STATE_DIR=str(tmp_path / "state"),
                       ONEPIECE_PROXY_TOKEN=os.environ["ONEPIECE_PROXY_TOKEN"],
                       DJANGO_SETTINGS_MODULE="onepiece_platform.settings.local",
                       DJANGO_ALLOWED_HOSTS=f"{net[0].address},localhost,127.0.0.1",
                       PYTHONPATH=os.pathsep.join([str(REPO / "platform"), os.environ.get("PYTHONPATH", "")]))
            r = Rehearsal(net, tmp_path, env)
            try:
                _rehearse(r, cluster, tiny_models, t_start)
            finally:
                tails = r.stop_all()
                for name, (_, p) in r.procs.items():
                    if name.startswith("node-"):
                        assert p.returncode == 0, f"{name} exited with {p.returncode}:\n{tails[name]}"


def _rehearse(r: Rehearsal, cluster: Any, tiny_models: dict[str, Path], t_start: float) -> None:
    onepiece = str(BIN / "onepiece")
    model_dir = str(tiny_models["sd-t2i"])
    h0, h2 = r.addr(0), r.addr(2)
    etcd = etcd_client(r.env["ONEPIECE_ETCD_URL"])  # the test's own view of the cluster, with the same list

    # -- host 0: Redis (password), then the platform's database and a client's API key ---------------
    redis_port = int(r.env["ONEPIECE_REDIS_URL"].rsplit(":", 1)[1].split("/")[0])
    (r.tmp / "redis").mkdir()
    r.spawn(0, "redis", ["redis-server", "--bind", h0, "--port", str(redis_port), "--requirepass", REDIS_PASSWORD,
                         "--save", "", "--appendonly", "no", "--dir", str(r.tmp / "redis")])
    manage = [sys.executable, str(REPO / "manage.py")]

    def django(*args: str) -> str:
        done = subprocess.run([*manage, *args], env=r.env, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    Path(r.env["ONEPIECE_STATE_DIR"]).mkdir(parents=True, exist_ok=True)
    django("migrate", "--noinput", "-v", "0")
    key = django("ensure_demo_user").split("api key: ")[-1].strip()
    django("shell", "-c", "from django.contrib.auth import get_user_model;"
           "from onepiece_platform.quotas.models import Quota;"
           "Quota.objects.update_or_create(user=get_user_model().objects.get(username='demo'),"
           " defaults={'max_concurrent_jobs': 100})")

    # -- the Node Managers: host 1's first, so it leads ------------------------------------------------
    manager = [onepiece, "manager", "--ttl", str(TTL_S), "--slots-per-node", "2", "--interval", "0.5",
               "--workflow", f"sd-t2i={model_dir}"]
    r.spawn(1, "manager-host1", [*manager, "--name", "nm-host1"])
    first = _wait("nm-host1 to lead", lambda: _leader(etcd), 60)
    assert first[0] == "nm-host1", first
    r.spawn(0, "manager-host0", [*manager, "--name", "nm-host0"])

    # -- the TaskManagers (no assignment: the leader places the stages), the Proxy, the platform -------
    stage_time = ",".join(f"{s}={STAGE_TIME_S}" for s in ROUTE)
    for i in (0, 2):
        run_dir = r.tmp / f"node-host-{i}"
        r.spawn(i, f"node-host-{i}", [onepiece, "node", "--node", f"host-{i}", "--transport", "tcp",
                                      "--data-host", r.addr(i), "--run-dir", str(run_dir),
                                      "--ring-prefix", f"test-{os.getpid()}-host-{i}-", "--ring-bytes",
                                      str(8 << 20), "--ring-slots", "64", "--stage-time", stage_time])
    proxy_port = r.port(0, 8100)
    proxy = f"http://{h0}:{proxy_port}"
    r.spawn(0, "proxy", [onepiece, "proxy", "--host", h0, "--port", str(proxy_port)])
    web_port = r.port(0, 8000)
    web = f"http://{h0}:{web_port}"
    r.spawn(0, "web", [str(BIN / "uvicorn"), "onepiece_platform.asgi:application", "--host", h0, "--port",
                       str(web_port), *WEB_SERVER_FLAGS, "--log-level", "warning"], ONEPIECE_PROXY_URL=proxy)
    r.spawn(0, "reconciler", [*manage, "reconcile"], ONEPIECE_PROXY_URL=proxy)

    def routes() -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for value, meta in etcd.get_prefix(KEYS.routes("sd-t2i")):
            stage = meta["key"].decode().split("/")[-2]  # /onepiece/routes/<workflow>/<stage>/<instance>
            out.setdefault(stage, []).append(json.loads(value)["address"])
        return out

    def serving() -> bool:
        status, doc, _ = _http("GET", proxy + "/readyz", timeout=3)
        return set(routes()) == set(ROUTE) and status == 200 and doc["checks"].get("routes:sd-t2i") == "ok"

    _wait("every stage to serve", serving, 240, 0.5)
    _wait("the platform", lambda: _http("GET", web + "/livez", timeout=3)[0] == 200, 60)
    placed = routes()
    print(f"ready after {time.monotonic() - t_start:.1f}s; placement: {placed}")
    hosts_of = {s: {a.split("//", 1)[1].split(":", 1)[0] for a in addrs} for s, addrs in placed.items()}
    assert set().union(*hosts_of.values()) == {h0, h2}, hosts_of  # the chain spans both TaskManagers' hosts
    assert all(a.startswith("tcp://") for addrs in placed.values() for a in addrs), placed

    auth = {"Authorization": f"Bearer {key}"}
    refused = {"n": 0}

    def submit() -> str:
        deadline = time.monotonic() + 60
        while True:
            status, doc, hdrs = _http("POST", web + "/api/v1/jobs", {"workflow": "sd-t2i", "params": PARAMS}, auth)
            if status == 202:
                assert isinstance(doc, dict), (hdrs, doc)
                return str(doc["uid"])
            assert status in (503, 429) and "Retry-After" in hdrs, (status, doc)  # a refusal, never a loss
            refused["n"] += 1
            assert time.monotonic() < deadline, (status, doc)
            time.sleep(min(float(hdrs["Retry-After"]), 0.5))

    def state(uid: str) -> dict[str, Any]:
        status, doc, _ = _http("GET", f"{web}/api/v1/jobs/{uid}", headers=auth)
        assert status == 200, doc
        return dict(doc)

    def finished(uids: list[str], timeout: float) -> dict[str, str]:
        out: dict[str, str] = {}

        def all_done() -> bool:
            for u in uids:
                if u not in out:
                    st = state(u)["state"]
                    if st in TERMINAL:
                        out[u] = st
            return len(out) == len(uids)

        _wait(f"{len(uids)} jobs to finish", all_done, timeout, 0.25)
        return out

    # -- one request through the platform, across hosts -------------------------------------------------
    t0 = time.monotonic()
    uid = submit()
    assert finished([uid], 120) == {uid: "completed"}
    status, png, _ = _http("GET", f"{web}/api/v1/jobs/{uid}/result", headers=auth)
    assert status == 200 and png[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"first request across hosts: completed in {time.monotonic() - t0:.1f}s")

    # -- lose host 1 (the leading Node Manager and one etcd member) with requests in flight -----------
    # the hardest case for etcd: host 1's member leads Raft, so its loss also means a Raft election
    cluster.move_leader(1)
    before = [submit() for _ in range(3)]
    t_kill = time.monotonic()
    killed = r.kill_host(1)
    cluster.members[1].kill()  # on loopback hosts there is no namespace to empty: stop it ourselves
    in_flight = [u for u in before if state(u)["state"] not in TERMINAL]
    print(f"killed host 1 ({len(killed)} processes, among them etcd member m1, the Raft leader, and nm-host1) "
          f"with {len(in_flight)} of {len(before)} earlier requests in flight")
    assert in_flight, "the kill came after every earlier request had finished: nothing was in flight"
    during = [submit() for _ in range(3)]
    t_during = time.monotonic()
    new = _wait("nm-host0 to lead", lambda: (lambda ld: ld if ld and ld[0] == "nm-host0" else None)(_leader(etcd)),
                TTL_S + 12, 0.05)
    failover_s = time.monotonic() - t_kill
    print(f"nm-host0 leads {failover_s:.2f}s after the kill (token {first[1]} -> {new[1]}); "
          f"Raft leader now m{cluster.raft_leader()}; 3 requests accepted {t_during - t_kill:.2f}s into the loss")
    # the old leader's lease runs out TTL after its last refresh; losing the Raft leader adds the Raft
    # election (about 1-2 s) and etcd's renewal of every lease by its TTL on a leader change
    assert failover_s < 2 * TTL_S + 4, failover_s
    assert new[1] > first[1]
    after = [submit() for _ in range(3)]

    # etcd serves with 2 of 3 members: host 1's member is gone, the others healthy, writes go through
    assert not cluster.members[1].healthy()
    assert cluster.members[0].healthy() and cluster.members[2].healthy()
    etcd.put("/rehearsal/after-loss", "ok")
    assert etcd.get("/rehearsal/after-loss") == [b"ok"]
    assert etcd.failovers >= 1 and etcd.url != cluster.members[1].url
    # the new leader's fenced writes pass: it publishes capacity under its own token
    _wait("the new leader's capacity write",
          lambda: json.loads(etcd.get(KEYS.capacity("sd-t2i"))[0])["fence_token"] == new[1], 20)

    outcome = finished(before + during + after, 150)
    took = time.monotonic() - t_kill
    counts = {k: sum(1 for u in uids if outcome[u] == "completed") for k, uids in
              (("before", before), ("during", during), ("after", after))}
    print(f"requests across the loss: {counts} completed of 3 each, {refused['n']} refusals retried, "
          f"all finished {took:.1f}s after the kill; whole rehearsal {time.monotonic() - t_start:.1f}s")
    assert all(s == "completed" for s in outcome.values()), {u: (s, state(u)) for u, s in outcome.items()}
    # each exactly once in the ledger
    status, page, _ = _http("GET", f"{web}/api/v1/jobs?page_size=100", headers=auth)
    ledger = [j["uid"] for j in page["results"]]
    assert sorted(ledger) == sorted([uid, *before, *during, *after]), ledger
    # the stages stayed where they were: the new leader kept the placement (one instance per stage)
    assert routes() == placed
    # every surviving process reached etcd through another member once host 1's was gone
    for name in ("node-host-0", "node-host-2", "manager-host0"):
        assert r.alive(name), r.log(name)[-3000:]
        assert f"etcd endpoint {cluster.members[1].url} unreachable" in r.log(name), (name, r.log(name)[-3000:])
    assert "leader: nm-host0" in r.log("manager-host0")
