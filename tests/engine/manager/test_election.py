"""Leader election on a real etcd: one leader, fail-over within TTL + 1 s, fenced writes."""

from __future__ import annotations

import json
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from engine.manager.election import Election, NotLeader, connect

CANDIDATE = Path(__file__).with_name("candidate.py")
TTL = 2


@pytest.fixture
def etcd(etcd_server):
    client = connect(etcd_server.url)
    key = f"/onepiece/test/leader-{uuid.uuid4().hex[:8]}"
    yield client, key, etcd_server.url
    client.delete(key)
    client.delete("/onepiece/test/x")


def test_only_one_candidate_leads_and_tokens_grow(etcd) -> None:
    client, key, _ = etcd
    a = Election(client, "a", ttl=TTL, key=key)
    b = Election(client, "b", ttl=TTL, key=key)
    first = a.try_acquire()
    assert first is not None and b.try_acquire() is None
    assert a.current_leader() == ("a", first.token)
    a.resign()
    second = b.try_acquire()
    assert second is not None and second.token > first.token
    b.resign()


def test_a_deposed_leader_cannot_write(etcd) -> None:
    client, key, _ = etcd
    a = Election(client, "a", ttl=TTL, key=key)
    b = Election(client, "b", ttl=TTL, key=key)
    ship_a = a.try_acquire()
    assert ship_a is not None
    assert a.fenced_put("/onepiece/test/x", "from a") == ship_a.token
    time.sleep(TTL + 1.5)  # a 'stalls': no keep-alive, its lease expires
    ship_b = b.try_acquire()
    assert ship_b is not None and ship_b.token > ship_a.token
    with pytest.raises(NotLeader, match="stale"):
        a.fenced_put("/onepiece/test/x", "late write from a")
    assert not a.is_leader  # the refusal made it step down
    b.fenced_put("/onepiece/test/x", "from b")
    assert client.get("/onepiece/test/x") == [b"from b"]
    b.resign()


class Proc:
    def __init__(self, url: str, name: str, key: str, owner_key: str) -> None:
        self.name = name
        self.p = subprocess.Popen([sys.executable, str(CANDIDATE), url, name, str(TTL), key, owner_key],
                                  stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, name="onepiece-test-pump", daemon=True).start()

    def _pump(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            self.lines.put(line.strip())

    def wait_for(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                continue
            if line.startswith(prefix):
                return line
        raise AssertionError(f"no {prefix!r} within {timeout}s")

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait(10)


@pytest.fixture
def candidates(etcd_server):
    """Start candidate processes campaigning for a leader key of this test's own."""
    tag = uuid.uuid4().hex[:8]
    keys = {"leader": f"/onepiece/test/leader-{tag}", "owner": f"/onepiece/test/owner-{tag}"}
    procs: list[Proc] = []

    def start(name: str) -> Proc:
        procs.append(Proc(etcd_server.url, name, keys["leader"], keys["owner"]))
        return procs[-1]

    start.keys = keys  # type: ignore[attr-defined]
    yield start
    for p in procs:
        p.close()
    client = connect(etcd_server.url)
    for k in keys.values():
        client.delete(k)


def _leader_and_standby(candidates):
    a, b = candidates("a"), candidates("b")
    a.wait_for("ready", 30)
    b.wait_for("ready", 30)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for me, other in ((a, b), (b, a)):
            try:
                me.wait_for("elected", 0.1)
                return me, other
            except AssertionError:
                pass
    raise AssertionError("nobody was elected")


def test_sigkill_of_the_leader_a_standby_leads_within_ttl_plus_one_second(candidates) -> None:
    leader, standby = _leader_and_standby(candidates)
    leader.wait_for("write ok", 5)
    killed_at = time.time()
    leader.p.send_signal(signal.SIGKILL)
    line = standby.wait_for("elected", TTL + 5)
    took = float(line.split()[2]) - killed_at
    print(f"fail-over took {took:.2f}s (lease TTL {TTL}s)")
    assert took <= TTL + 1.0
    standby.wait_for("write ok", 5)


def test_sigstop_past_the_ttl_then_sigcont_its_writes_are_refused(candidates, etcd_server) -> None:
    leader, standby = _leader_and_standby(candidates)
    ok = leader.wait_for("write ok", 5)
    old_token = int(ok.split()[2])
    leader.p.send_signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    new = standby.wait_for("elected", TTL * 2 + 3)
    assert int(new.split()[1]) > old_token
    time.sleep(max(0.0, 2 * TTL - (time.monotonic() - stopped_at)))  # stopped for twice the TTL
    leader.p.send_signal(signal.SIGCONT)
    after: list[str] = []
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        try:
            after.append(leader.lines.get(timeout=0.1))
        except queue.Empty:
            pass
    # it steps down (whether its keep-alive or a refused write told it first), and no
    # write of its lands after it woke up
    assert any(line.startswith("deposed") for line in after), after
    assert not any(line.startswith("write ok") for line in after), after
    client = connect(etcd_server.url)
    assert client.get(candidates.keys["owner"]) == [standby.name.encode()]
    assert json.loads(client.get(candidates.keys["leader"])[0])["candidate"] == standby.name
