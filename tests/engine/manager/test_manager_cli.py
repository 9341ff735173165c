"""`onepiece manager`: two replicas, one leads; the standby takes over when the leader is killed."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ONEPIECE = str(Path(sys.executable).parent / "onepiece")


ROOT = f"/onepiece-test-{os.getpid()}"


def _start(etcd_url: str, name: str) -> tuple[subprocess.Popen[str], queue.Queue[str]]:
    p = subprocess.Popen([ONEPIECE, "manager", "--etcd-url", etcd_url, "--name", name, "--ttl", "2", "--root", ROOT,
                          "--interval", "0.5", "--workflow", "sd-t2i=/models/sd-t2i"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    q: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in p.stdout:  # type: ignore[union-attr]
            q.put(line.strip())

    threading.Thread(target=pump, name="onepiece-test-pump", daemon=True).start()
    return p, q


def _wait(q: queue.Queue[str], prefix: str, timeout: float) -> str | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=0.1)
        except queue.Empty:
            continue
        if line.startswith(prefix):
            return line
    return None


def test_two_replicas_one_leads_and_the_standby_takes_over(etcd_server) -> None:
    a, qa = _start(etcd_server.url, "mgr-a")
    try:
        assert _wait(qa, "leader: mgr-a", 30)
        b, qb = _start(etcd_server.url, "mgr-b")
        try:
            assert _wait(qb, "manager: mgr-b", 30)
            assert _wait(qb, "leader:", 1.5) is None  # a still leads
            os.kill(a.pid, signal.SIGKILL)
            assert _wait(qb, "leader: mgr-b", 2 + 3)
            b.send_signal(signal.SIGINT)
            assert b.wait(15) == 0
        finally:
            if b.poll() is None:
                b.kill()
                b.wait()
    finally:
        if a.poll() is None:
            a.kill()
        a.wait()


def test_bad_arguments_are_refused_before_connecting() -> None:
    r = subprocess.run([ONEPIECE, "manager", "--etcd-url", "http://127.0.0.1:1", "--workflow", "nope=/x"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "error:" in r.stdout
    r = subprocess.run([ONEPIECE, "manager", "--etcd-url", "http://127.0.0.1:1"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "--workflow" in r.stdout
