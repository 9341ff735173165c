"""A real multi-member etcd cluster for tests: one ``etcd`` process per member.

Members are bootstrapped together (``--initial-cluster`` names every peer) and
each listens on its own host's address; ``wrap`` runs a member on another host
(``tests/netns.py``'s ``Host.wrap``). The flags are those of
``engine.embedded.services.EtcdServer`` plus the cluster's membership, and the
same as deploy/k8s/10-etcd.yaml's.
"""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.embedded.services import free_port


@dataclass
class Member:
    name: str
    host: str
    client_port: int
    peer_port: int
    data_dir: Path
    wrap: Callable[[list[str]], list[str]]
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    @property
    def peer(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    def argv(self, initial_cluster: str, token: str) -> list[str]:
        return [
            "etcd", "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
            "--listen-peer-urls", self.peer, "--initial-advertise-peer-urls", self.peer,
            "--initial-cluster", initial_cluster, "--initial-cluster-state", "new",
            "--initial-cluster-token", token,
            "--log-level", "warn",
        ]

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=0.5) as r:
                return b'"health":"true"' in r.read()
        except (urllib.error.URLError, OSError):
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@dataclass
class Cluster:
    members: list[Member]

    @property
    def urls(self) -> str:
        """The comma-separated client URLs (what ONEPIECE_ETCD_URL / --etcd-url carries)."""
        return ",".join(m.url for m in self.members)

    def _client(self, m: Member) -> Any:
        import etcd3gw

        return etcd3gw.client(host=m.host, port=m.client_port, timeout=5)

    def raft_leader(self) -> int | None:
        """Index of the member that leads Raft now (asked of the live members)."""
        ids = {}
        leader = None
        for i, m in enumerate(self.members):
            if m.proc is None or m.proc.poll() is not None:
                continue
            st = self._client(m).status()
            ids[st["header"]["member_id"]] = i
            leader = st["leader"]
        return ids.get(leader) if leader is not None else None

    def move_leader(self, target: int, timeout: float = 15.0) -> None:
        """Make member ``target`` the Raft leader (etcd's MoveLeader, asked of the current leader)."""
        deadline = time.monotonic() + timeout
        want = self._client(self.members[target]).status()["header"]["member_id"]
        while (now := self.raft_leader()) != target:
            if now is not None:
                c = self._client(self.members[now])
                try:
                    c.post(c.get_url("/maintenance/transfer-leadership"), json={"targetID": want})
                except Exception:  # an election in progress: ask again
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"member {target} did not become the Raft leader (leader: {now})")
            time.sleep(0.2)


@contextmanager
def etcd_cluster(
    root: Path,
    hosts: list[str],
    wraps: list[Callable[[list[str]], list[str]]] | None = None,
    ports: tuple[int, int] | None = None,
    timeout: float = 30.0,
) -> Iterator[Cluster]:
    """Start one member per host (ports: fixed (client, peer), or free ones), wait until all are healthy."""
    members = []
    for i, host in enumerate(hosts):
        cp, pp = ports if ports else (free_port(host), free_port(host))
        members.append(Member(f"m{i}", host, cp, pp, root / f"etcd-m{i}",
                              (wraps[i] if wraps else (lambda argv: argv))))
    initial = ",".join(f"{m.name}={m.peer}" for m in members)
    token = f"onepiece-test-{root.name}"
    try:
        for m in members:
            m.data_dir.parent.mkdir(parents=True, exist_ok=True)
            log = open(root / f"{m.name}.log", "ab")
            m.proc = subprocess.Popen(m.wrap(m.argv(initial, token)), stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
            log.close()
        deadline = time.monotonic() + timeout
        while not all(m.healthy() for m in members):
            dead = [m.name for m in members if m.proc is not None and m.proc.poll() is not None]
            if dead or time.monotonic() > deadline:
                tails = {m.name: (root / f"{m.name}.log").read_text(errors="replace")[-1500:] for m in members}
                raise RuntimeError(f"etcd cluster did not come up (dead: {dead}); logs: {tails}")
            time.sleep(0.1)
        yield Cluster(members)
    finally:
        for m in members:
            m.kill()
