"""Stage pools shared across workflows, live: one umT5 / VAE-decoder / mp4 instance serves both Wan2.1 workflows,
each request leaves it for its own workflow's next stage, and a SIGKILL of a shared worker loses no job of either."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.fixtures.runtime import Cluster

pytestmark = [pytest.mark.models, pytest.mark.timeout(600)]

WAN = dict(prompt="a cat on the moon", height=32, width=32, num_frames=5, num_inference_steps=2)
SHARED = ("text_encode", "vae_decode", "video_encode")


def _references(tiny_models: dict[str, Path], input_png: bytes, seeds: list[int]) -> dict[tuple[str, int], bytes]:
    """Each request run alone, in one process (LocalRunner: the one-call run tests/engine/stages proves equal to
    diffusers' pipelines)."""
    from engine.stages.runner import LocalRunner
    from engine.workflow import get_workflow

    out = {}
    for wf in ("wan2.1-i2v", "wan2.1-t2v"):
        runner = LocalRunner(wf, tiny_models[wf], "cpu")
        for seed in seeds:
            inputs = {"image": input_png} if wf == "wan2.1-i2v" else {}
            out[wf, seed] = bytes(runner.run(get_workflow(wf).resolve_params({**WAN, "seed": seed}), inputs).outputs["video"])
    return out


def test_one_pool_serves_both_wan_workflows_and_a_sigkill_of_it_loses_no_job(
        one_node: Cluster, tiny_models: dict[str, Path], input_png: bytes) -> None:
    report = one_node.node_report()["instances"]
    shared = {iid: r for iid, r in report.items() if len(r.get("serves", [])) > 1}
    assert set(shared) == {f"wan2.1-i2v.{st}.0" for st in SHARED}
    for st in SHARED:
        assert sorted(shared[f"wan2.1-i2v.{st}.0"]["serves"]) == [f"wan2.1-i2v/{st}", f"wan2.1-t2v/{st}"]
    assert not any(r["workflow"] == "wan2.1-t2v" and r["stage"] in SHARED for r in report.values())
    # each member's route leads to the same instance, so the Proxy and the denoise stages find it
    routes = {name for name in (m["key"].decode() for _, m in one_node.etcd.get_prefix(one_node.keys.routes()))
              if name.endswith("/wan2.1-i2v.video_encode.0")}
    assert routes == {one_node.keys.route(w, "video_encode", "wan2.1-i2v.video_encode.0") for w in ("wan2.1-i2v", "wan2.1-t2v")}

    seeds = [1, 2, 3]
    reference = _references(tiny_models, input_png, seeds)
    victim = shared["wan2.1-i2v.video_encode.0"]
    # both workflows' requests at once; the shared mp4 encoder is killed before any of them has reached it,
    # so every one of them passes through the restarted worker (its ring kept what was handed to it). It is
    # stopped (SIGSTOP) before the requests are sent, so that none can start on it before the kill however
    # fast the earlier stages run (a fast host once brought two there first); SIGKILL ends a stopped process.
    os.kill(victim["pid"], signal.SIGSTOP)
    jobs: dict[str, tuple[str, int]] = {}
    lock = threading.Lock()

    def submit(wf: str, seed: int) -> None:
        uid = one_node.submit(wf, {**WAN, "seed": seed}, {"image": input_png} if wf == "wan2.1-i2v" else None)
        with lock:
            jobs[uid] = (wf, seed)

    threads = [threading.Thread(target=submit, args=(wf, s)) for s in seeds for wf in ("wan2.1-t2v", "wan2.1-i2v")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reached = [uid for uid in jobs if any(e["type"] == "stage_started" and e["stage"] == "video_encode"
                                          for e in one_node.events(uid))]
    os.kill(victim["pid"], signal.SIGKILL)
    assert not reached, "a request reached the mp4 stage before the kill: the test proves nothing for it"

    for uid, (wf, seed) in jobs.items():
        done = one_node.wait(uid, {"completed", "failed", "cancelled", "expired"}, timeout=240)
        assert done["state"] == "completed", (wf, done)
        status, mp4, _ = one_node.call("GET", f"/v1/requests/{uid}/result")
        assert status == 200 and mp4 == reference[wf, seed], f"{wf} seed {seed} differs from its solo run"
        events = one_node.events(uid)
        assert [e["type"] for e in events].count("completed") == 1
        started = [e["stage"] for e in events if e["type"] == "stage_started"]
        from engine.workflow import get_workflow

        assert [s for s in dict.fromkeys(started)] == get_workflow(wf).route()  # its own chain, in order
    # the shared worker came back on the same ring and measured both workflows' requests apart (the node
    # reports every 2 s: wait for the report that has them)
    deadline = time.monotonic() + 30
    while True:
        after = one_node.node_report()["instances"]["wan2.1-i2v.video_encode.0"]
        if after["restarts"] >= 1 and set(after.get("service_s", {})) == {"wan2.1-i2v", "wan2.1-t2v"}:
            break
        assert time.monotonic() < deadline, after
        time.sleep(0.2)
    assert after["pid"] != victim["pid"] and after["address"] == victim["address"]
