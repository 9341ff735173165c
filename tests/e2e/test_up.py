"""``onepiece up`` starts what exists, prints where it listens, and stops cleanly."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

from engine.coord.keys import Keyspace
from tests.e2e import first_minute
from tests.e2e.up import start_up, stop_up
from tests.fixtures.web import png

KEYS = Keyspace()  # the engine's etcd keys under the default root (/onepiece)


@pytest.mark.timeout(600)
def test_up_serves_and_stops_cleanly(tmp_path: Path) -> None:
    # the first run builds the tiny models itself; no spare slots, so that the instances checked below are the
    # static assignment the Node Manager takes over (with the default spare slot, it adds a bottleneck
    # instance a moment later: tests/engine/test_launcher_workflows.py, tests/engine/manager/test_pools_plan.py)
    proc, lines = start_up(tmp_path / "state", "--spare-slots", "0")
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 7  # redis, etcd, s3 (the object store), web, node (+ its workers), proxy, manager
        assert lines["manager"].startswith("leading"), lines
        with urllib.request.urlopen(lines["web"] + "readyz", timeout=10) as r:
            body = json.loads(r.read())
        assert body["checks"] == {"database": "ok", "redis": "ok"}
        with urllib.request.urlopen(lines["proxy"] + "/livez", timeout=10) as r:
            assert json.loads(r.read()) == {"status": "ok"}
        with urllib.request.urlopen(lines["proxy"] + "/readyz", timeout=10) as r:
            checks = json.loads(r.read())["checks"]
        from engine.workflow import workflows
        from onepiece_launcher.up import DEFAULT_WORKFLOWS

        # the default three are served; every other workflow the engine knows has no route (one flag away)
        assert checks == {"redis": "ok", **{f"routes:{w}": "ok" if w in DEFAULT_WORKFLOWS else "none" for w in workflows()}}
        rings = [n for n in os.listdir("/dev/shm") if n.startswith(f"onepiece-up-{proc.pid}-")]
        inboxes = [n for n in rings if not n.endswith(".cfg")]
        # one inbox ring per stage instance: one per stage pool (the Wan2.1 pair shares umT5, the VAE decoder and
        # the mp4 encoder), 11 for the three workflows' 14 stages
        assert len(inboxes) == 11, rings
        assert sorted(n for n in rings if n.endswith(".cfg")) == [
            f"onepiece-up-{proc.pid}-wan2.1-{kind}.denoise.0.cfg" for kind in ("i2v", "t2v")]
        # the Node Manager leads, took the assignment over without moving an instance, and feeds the
        # Proxy's admission with each workflow's capacity
        # etcd has authentication on: the summary shows its URL without the password, which only the state
        # folder holds; an anonymous client is refused
        from urllib.parse import quote

        from etcd3gw.exceptions import Etcd3Exception

        from engine.coord import etcd_client

        password = (tmp_path / "state" / "secrets" / "etcd-password").read_text().strip()
        assert lines["etcd"].startswith("http://onepiece:***@") and password not in "".join(lines.values())
        with pytest.raises(Etcd3Exception):
            etcd_client(lines["etcd"].replace("onepiece:***@", "")).get(KEYS.capacity("sd-t2i"))
        etcd = etcd_client(lines["etcd"].replace("***", quote(password, safe=""), 1))
        deadline = time.monotonic() + 60
        while not all(etcd.get(KEYS.capacity(wf)) for wf in ("sd-t2i", "wan2.1-i2v", "wan2.1-t2v")):
            assert time.monotonic() < deadline, "the Node Manager published no capacity"
            time.sleep(0.2)
        capacity = json.loads(etcd.get(KEYS.capacity("sd-t2i"))[0])
        assert capacity["fence_token"] > 0 and capacity["rps"] > 0 and capacity["mode"] == "individual"
        assert capacity["instances"] == {s: 1 for s in ("text_encode", "denoise", "vae_decode", "image_encode")}
        t2v = json.loads(etcd.get(KEYS.capacity("wan2.1-t2v"))[0])
        assert t2v["rps"] > 0 and t2v["instances"] == {s: 1 for s in ("text_encode", "denoise", "vae_decode",
                                                                     "video_encode")}
        # text-to-video end to end: the official client, no image, an mp4 back
        import openai

        from tests.web.webhooks.receiver import Receiver

        receiver = Receiver().start()  # its completion webhook, from onepiece up's delivery worker
        try:
            req = urllib.request.Request(lines["web"] + "api/v1/webhooks", method="POST",
                                         data=json.dumps({"url": receiver.url}).encode(),
                                         headers={"Authorization": f"Bearer {lines['api key']}",
                                                  "Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=10) as r:
                secret = json.loads(r.read())["secret"]
            client = openai.OpenAI(base_url=lines["api"], api_key=lines["api key"], max_retries=0, timeout=60)
            video = client.videos.create_and_poll(prompt="a cat on the moon", size="32x32", seconds="1",
                                                  poll_interval_ms=200, extra_body={"num_inference_steps": 2})
            assert video.status == "completed" and video.model == "wan2.1-t2v", video
            assert client.videos.download_content(video.id).content[4:8] == b"ftyp"
            [hook] = receiver.wait_for(1, timeout=30)
            event = client.webhooks.unwrap(hook.body, hook.headers, secret=secret)
            assert event.type == "video.completed" and event.data.id == video.id
            # what a new user meets in the first minute (issue 25), on this same system
            client.timeout = 150
            first_minute.check_defaults_and_limits(lines, client, tmp_path / "state")
            first_minute.check_other_clients(lines, client, png())
            took = first_minute.check_priced_admission(lines, client, tmp_path / "state")
            print(f"a 512x512 50-step image refused by priced admission in {took * 1e3:.0f} ms (web + Proxy)")
            client.close()
        finally:
            receiver.stop()
        assert sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"onepiece-up-{proc.pid}-")) == sorted(rings)
        _reconciler_is_supervised(lines)
        children = psutil.Process(proc.pid).children(recursive=True)  # the restarted reconciler among them
    finally:
        out = stop_up(proc)
    assert proc.returncode == 0, out
    assert "stopped" in out
    # the supervisor said what happened, on onepiece up's output and in its log
    log = (tmp_path / "state" / "logs" / "supervisor.log").read_text()
    for said in (out, log):
        assert "reconciler: killed by SIGKILL; restarting in 1.0 s" in said and "reconciler: restarted (pid" in said
    for c in children:
        assert not c.is_running() or c.status() == psutil.STATUS_ZOMBIE, f"left behind: {c}"
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"onepiece-up-{proc.pid}-")]


def _readyz(web: str) -> dict[str, Any]:
    with urllib.request.urlopen(web + "readyz", timeout=10) as r:
        return json.loads(r.read())


def _reconciler_is_supervised(lines: dict[str, str]) -> None:
    """SIGKILL the reconciler: /readyz says degraded while it is down or restarting, it is restarted, and a
    job submitted meanwhile reaches its terminal state in the ledger with every stage run recorded (the
    reconciler's work alone: the list route reads the ledger as it is, never the engine)."""
    web, key = lines["web"], lines["api key"]
    before = _readyz(web)
    assert before["status"] == "ok", before
    assert set(before["processes"]) == {"redis", "etcd", "s3", "web", "node", "proxy", "manager", "reconciler",
                                        "webhooks"}, before
    assert all(p["state"] == "up" and p["restarts"] == 0 for p in before["processes"].values()), before
    os.kill(before["processes"]["reconciler"]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 30
    # down for the first backoff (1 s), then starting for 5 s: the change is seen well within that
    while (seen := _readyz(web))["processes"]["reconciler"]["restarts"] == 0 and \
            seen["processes"]["reconciler"]["state"] == "up":
        assert time.monotonic() < deadline, "the supervisor did not notice the reconciler's death"
        time.sleep(0.05)
    assert seen["status"] == "degraded" and seen["processes"]["reconciler"]["state"] in ("down", "starting"), seen
    auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    body = {"workflow": "sd-t2i", "params": {"prompt": "a lighthouse", "height": 64, "width": 64,
                                             "num_inference_steps": 2}}
    req = urllib.request.Request(web + "api/v1/jobs", data=json.dumps(body).encode(), headers=auth, method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        uid = json.loads(r.read())["uid"]
    while True:
        after = _readyz(web)
        rec = after["processes"]["reconciler"]
        if rec["state"] == "up":
            break
        assert time.monotonic() < deadline + 30, after
        time.sleep(0.2)
    assert after["status"] == "ok" and rec["restarts"] == 1 and rec["last_exit"] == -signal.SIGKILL, after
    assert rec["pid"] != before["processes"]["reconciler"]["pid"]
    listing = urllib.request.Request(web + "api/v1/jobs?state=completed&page_size=100", headers=auth)
    while True:
        with urllib.request.urlopen(listing, timeout=30) as r:
            done = {j["uid"]: j for j in json.loads(r.read())["results"]}
        if uid in done:
            break
        assert time.monotonic() < deadline + 120, f"{uid} never reached its terminal state in the ledger"
        time.sleep(0.2)
    times = done[uid]["stage_times"]
    assert set(times) == {"text_encode", "denoise", "vae_decode", "image_encode"}, times
    assert all("finished" in t for t in times.values()), times
