"""``onepiece up`` starts what exists, prints where it listens, and stops cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest


@pytest.mark.timeout(600)
def test_up_serves_and_stops_cleanly(tmp_path: Path) -> None:
    onepiece = str(Path(sys.executable).parent / "onepiece")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONEPIECE_")}
    proc = subprocess.Popen(
        [onepiece, "up", "--state-dir", str(tmp_path / "state"), "--web-port", "0", "--proxy-port", "0",
         "--ring-bytes", str(4 << 20)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )
    lines: dict[str, str] = {}
    try:
        deadline = time.monotonic() + 400  # first run builds the tiny models and starts 10 stage workers
        assert proc.stdout is not None
        for line in proc.stdout:
            if ": " in line:
                k, v = line.rstrip("\n").split(": ", 1)
                lines[k] = v
            if line.startswith("ready"):
                break
            assert time.monotonic() < deadline, "onepiece up took too long"
        assert "web" in lines, lines
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 5  # redis, etcd, web, node (+ its workers), proxy
        with urllib.request.urlopen(lines["web"] + "readyz", timeout=10) as r:
            body = json.loads(r.read())
        assert body["checks"] == {"database": "ok", "redis": "ok"}
        with urllib.request.urlopen(lines["proxy"] + "/livez", timeout=10) as r:
            assert json.loads(r.read()) == {"status": "ok"}
        with urllib.request.urlopen(lines["proxy"] + "/readyz", timeout=10) as r:
            checks = json.loads(r.read())["checks"]
        assert checks == {"redis": "ok", "routes:sd-t2i": "ok", "routes:wan2.1-i2v": "ok"}
        rings = [n for n in os.listdir("/dev/shm") if n.startswith(f"onepiece-up-{proc.pid}-")]
        assert len(rings) == 10, rings  # one inbox ring per stage instance
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "stopped" in out
    for c in children:
        assert not c.is_running() or c.status() == psutil.STATUS_ZOMBIE, f"left behind: {c}"
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"onepiece-up-{proc.pid}-")]
