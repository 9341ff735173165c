"""Hosts for multi-host tests: network namespaces joined by a bridge, or loopback addresses.

``hosts(n)`` makes ``n`` network namespaces, each with a veth pair into one
bridge in the root namespace; the bridge has ``10.<a>.<b>.1`` (where services
in the root namespace can listen and every host can reach them) and host i has
``10.<a>.<b>.<i + 2>``. Where namespaces cannot be made (not root, no
iproute2), the hosts are loopback addresses 127.0.<b>.<i + 2> and commands run
unwrapped; the ``kind`` attribute says which, and tests print it.

Everything made is removed on exit, including processes still running in a
namespace (killed, so the namespace can go).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)


@dataclass
class Host:
    name: str  # namespace name ("" on loopback)
    address: str

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run on this host."""
        return ["ip", "netns", "exec", self.name, *argv] if self.name else argv

    def pids(self) -> list[int]:
        if not self.name:
            return []
        r = _ip("netns", "pids", self.name)
        return [int(p) for p in r.stdout.split()]


@dataclass
class Hosts:
    kind: str  # "namespaces" | "loopback"
    gateway: str  # where root-namespace services listen so every host reaches them
    hosts: list[Host] = field(default_factory=list)

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)


@contextmanager
def hosts(n: int) -> Iterator[Hosts]:
    tag = uuid.uuid4().hex[:6]
    net = 100 + int(tag[:2], 16) % 100  # 10.233.<net>.0/24, random per run
    bridge = f"opbr{tag}"
    made_ns: list[str] = []
    made_links: list[str] = []
    ok = os.geteuid() == 0 and shutil.which("ip") is not None
    if ok:
        steps: list[tuple[str, ...]] = [
            ("link", "add", bridge, "type", "bridge"),
            ("addr", "add", f"10.233.{net}.1/24", "dev", bridge),
            ("link", "set", bridge, "up"),
        ]
        for i in range(n):
            ns, va, vb = f"op{tag}h{i}", f"op{tag}a{i}", f"op{tag}b{i}"
            steps += [
                ("netns", "add", ns),
                ("link", "add", va, "type", "veth", "peer", "name", vb),
                ("link", "set", va, "master", bridge), ("link", "set", va, "up"),
                ("link", "set", vb, "netns", ns),
                ("-n", ns, "addr", "add", f"10.233.{net}.{i + 2}/24", "dev", vb),
                ("-n", ns, "link", "set", vb, "up"), ("-n", ns, "link", "set", "lo", "up"),
                ("-n", ns, "route", "add", "default", "via", f"10.233.{net}.1"),
            ]
        for step in steps:
            r = _ip(*step)
            if r.returncode != 0:
                ok = False
                break
            if step[:2] == ("netns", "add"):
                made_ns.append(step[2])
            elif step[:2] == ("link", "add"):
                made_links.append(step[2])
    try:
        if ok:
            yield Hosts("namespaces", f"10.233.{net}.1",
                        [Host(f"op{tag}h{i}", f"10.233.{net}.{i + 2}") for i in range(n)])
        else:
            for ns in made_ns:
                _ip("netns", "del", ns)
            for link in made_links:
                _ip("link", "del", link)
            made_ns, made_links = [], []
            yield Hosts("loopback", "127.0.0.1", [Host("", f"127.0.{net}.{i + 2}") for i in range(n)])
    finally:
        for ns in made_ns:
            for pid in Host(ns, "").pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _ip("netns", "del", ns)
        for link in made_links:  # the veths went with their namespaces; the bridge is left
            _ip("link", "del", link)
