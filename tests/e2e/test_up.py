"""``onepiece up`` starts what exists, prints where it listens, and stops cleanly."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from tests.e2e.up import start_up, stop_up


@pytest.mark.timeout(600)
def test_up_serves_and_stops_cleanly(tmp_path: Path) -> None:
    proc, lines = start_up(tmp_path / "state")  # the first run builds the tiny models itself
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 6  # redis, etcd, web, node (+ its workers), proxy, manager
        assert lines["manager"].startswith("leading"), lines
        with urllib.request.urlopen(lines["web"] + "readyz", timeout=10) as r:
            body = json.loads(r.read())
        assert body["checks"] == {"database": "ok", "redis": "ok"}
        with urllib.request.urlopen(lines["proxy"] + "/livez", timeout=10) as r:
            assert json.loads(r.read()) == {"status": "ok"}
        with urllib.request.urlopen(lines["proxy"] + "/readyz", timeout=10) as r:
            checks = json.loads(r.read())["checks"]
        assert checks == {"redis": "ok", "routes:sd-t2i": "ok", "routes:wan2.1-i2v": "ok"}
        rings = [n for n in os.listdir("/dev/shm") if n.startswith(f"onepiece-up-{proc.pid}-")]
        inboxes = [n for n in rings if not n.endswith(".cfg")]
        assert len(inboxes) == 10, rings  # one inbox ring per stage instance
        assert [n for n in rings if n.endswith(".cfg")] == [f"onepiece-up-{proc.pid}-wan2.1-i2v.denoise.0.cfg"]
        # the Node Manager leads, took the assignment over without moving an instance, and feeds the
        # Proxy's admission with each workflow's capacity
        from engine.worker.routes import etcd_client

        etcd = etcd_client(lines["etcd"])
        deadline = time.monotonic() + 60
        while not all(etcd.get(f"/onepiece/capacity/{wf}") for wf in ("sd-t2i", "wan2.1-i2v")):
            assert time.monotonic() < deadline, "the Node Manager published no capacity"
            time.sleep(0.2)
        capacity = json.loads(etcd.get("/onepiece/capacity/sd-t2i")[0])
        assert capacity["fence_token"] > 0 and capacity["rps"] > 0 and capacity["mode"] == "individual"
        assert capacity["instances"] == {s: 1 for s in ("text_encode", "denoise", "vae_decode", "image_encode")}
        assert sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"onepiece-up-{proc.pid}-")) == sorted(rings)
    finally:
        out = stop_up(proc)
    assert proc.returncode == 0, out
    assert "stopped" in out
    for c in children:
        assert not c.is_running() or c.status() == psutil.STATUS_ZOMBIE, f"left behind: {c}"
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"onepiece-up-{proc.pid}-")]
