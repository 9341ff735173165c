"""``onepiece bench resources``: monolithic vs OnePiece sizing, the CLI, and the real-engine validation."""

from __future__ import annotations

import json
import os
import signal
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from engine.bench.queueing import poisson_arrivals
from engine.bench.resources_profile import Profile, Request, Stage, from_obj, load, stretched
from engine.bench.resources_sim import Scenario, simulate_monolithic, size
from engine.manager.allocator import theorem1

WAN_PROFILE = Path(__file__).resolve().parents[3] / "benchmarks/resources/profiles/wan2.1-i2v-14b-480p-h200-published.json"


def _sized(profile: Profile, devices: float, **kw: object) -> tuple:
    sc = Scenario(profile, [(1.0, profile.reference)], requests=1500, **kw)  # type: ignore[arg-type]
    rate = devices / profile.total_seconds(profile.reference, "gpu")
    return size(sc, rate)


def test_two_stage_case_matches_theorem1_by_hand() -> None:
    # X: 1 s, Y: 3 s; at 1.8 req/s (90% busy) X needs 2 instances and Y, by Theorem 1, ceil(2 x 3 / 1) = 6;
    # a monolith (4 s per request) needs ceil(1.8 x 4 / 0.95) = 8 replicas: the same 8 devices, ratio 1
    prof = stretched({"encode": 1.0, "denoise": 3.0})
    sc = Scenario(prof, [(1.0, prof.reference)], slo_x=10, hop_s=0.0, requests=1500)
    m, o = size(sc, 1.8)
    assert m is not None and o is not None
    assert o.detail["instances"] == {"encode": 2, "denoise": theorem1(2, 1.0, 3.0)} == {"encode": 2, "denoise": 6}
    assert m.devices == 8 and o.devices == 8
    assert m.throughput == pytest.approx(1.8, rel=0.1) and o.throughput == pytest.approx(1.8, rel=0.1)
    # idle latency is the sum of the stages for both
    assert m.latency_p50 >= 4.0 and o.latency_p50 >= 4.0


def test_ratio_grows_as_the_diffusion_share_falls_only_if_light_stages_idle_the_device() -> None:
    base = stretched({"encode": 1.0, "denoise": 8.0, "decode": 1.0})
    ratios = {}
    for share in (0.5, 0.95):
        p = base.with_diffusion_share(share)
        assert p.seconds("denoise", p.reference) / p.total_seconds(p.reference) == pytest.approx(share)
        m, o = _sized(p, 24)
        idle_m, idle_o = _sized(p.with_occupancy(0.25), 24)
        ratios[share] = (m.devices / o.devices, idle_m.devices / idle_o.detail["devices_packed"])
    # light stages that saturate the device: splitting the pipeline saves nothing at batch 1
    assert ratios[0.5][0] <= 1.05 and ratios[0.95][0] <= 1.05
    # light stages that leave the device 75% idle, packed: the less time in diffusion, the bigger the saving,
    # and never above the bound 1 / (share + (1 - share) x occupancy)
    assert ratios[0.5][1] > ratios[0.95][1] > 0.9
    assert 1.2 < ratios[0.5][1] <= 1 / (0.5 + 0.5 * 0.25) + 0.05


def test_published_wan_profile_never_beats_one_over_the_diffusion_share_at_batch_1() -> None:
    wan = load(WAN_PROFILE)
    share = wan.seconds("denoise", wan.reference) / wan.total_seconds(wan.reference, "gpu")
    assert 0.9 < share < 1.0
    for devices in (4, 32):
        m, o = _sized(wan, devices)
        assert m is not None and o is not None
        assert m.devices / o.devices <= 1 / share + 1e-9
        assert m.devices / o.detail["devices_packed"] <= 1 / share + 1e-9
        assert o.latency_p99 <= 2 * wan.total_seconds(wan.reference) and m.latency_p99 <= 2 * wan.total_seconds(wan.reference)


def test_monolith_offloads_when_the_components_do_not_fit_and_nothing_fits_a_too_small_device() -> None:
    stages = (Stage("encode", 1.0, weights_gib=30), Stage("denoise", 4.0, weights_gib=30, activation_gib=10))
    prof = Profile("p", stages, Request(steps=1), device_memory_gib=80)
    reqs = [prof.reference] * 50
    arr = poisson_arrivals(0.2, 50)
    fits = simulate_monolithic(prof, reqs, arr, 4)
    small = Profile("p", stages, Request(steps=1), device_memory_gib=50)
    swapped = simulate_monolithic(small, reqs, arr, 4)
    assert not fits.detail["offload"] and swapped.detail["offload"]
    assert swapped.latency_p50 > fits.latency_p50 + 60 * 2**30 * 8 / 200e9 * 0.9  # weights cross PCIe per request
    m, o = _sized(Profile("p", stages, Request(steps=1), device_memory_gib=35), 4)
    assert m is None and o is None


def test_profile_reads_the_fullsize_profile_scripts_output() -> None:
    doc = {"shape": {"height": 480, "width": 832, "frames": 81, "text_tokens": 512},
           "stages": {"text_encode": {"seconds": 0.2, "per": "request", "runs": [0.2], "peak_gib": 12.0,
                                      "hands_on_bytes": 100},
                      "denoise": {"seconds": 9.0, "per": "step", "runs": [9.0], "peak_gib": 50.0},
                      "vae_decode": {"seconds": 10.0, "per": "request", "runs": [10.0], "peak_gib": 10.0}}}
    p = from_obj(doc)
    assert p.kind == "measured" and p.reference.steps == 50
    assert p.seconds("denoise", Request(steps=10)) == pytest.approx(90.0)
    assert p.seconds("vae_decode", Request(frames=33)) == pytest.approx(10.0 * 33 / 81)
    assert p.stage("denoise").memory_gib == 50.0
    wan = load(WAN_PROFILE)
    assert wan.kind == "published" and wan.sources
    assert all(s.source for s in wan.stages)
    # the published end-to-end time is what the stages add up to
    assert wan.total_seconds(wan.reference) == pytest.approx(366, rel=0.01)


def test_cli_small_configuration_writes_table_json_and_png(tmp_path: Path) -> None:
    from engine.cli import main

    rc = main(["bench", "resources", "--no-validate", "--sizes", "4", "16", "--requests", "400",
               "--sensitivity-devices", "8", "--pool-sizes", "4", "--expert-sizes", "8", "--out-dir", str(tmp_path)])
    assert rc == 0
    png = (tmp_path / "resources.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    result = json.loads((tmp_path / "resources.json").read_text())
    assert [round(r["monolithic"]["devices"] / r["onepiece"]["devices"], 6) for r in result["curve"]] == \
        [round(r["ratio"], 6) for r in result["curve"]]
    assert {"diffusion_share", "steps", "frames", "mix"} <= set(result["sensitivity"])
    assert any("sequence parallel" in r["assumption"] for r in result["assumptions"])
    text = (tmp_path / "results.md").read_text()
    assert "| target req/h |" in text and "ratio" in text
    # the new sections: batching by request shape, the shared-pool pair, Wan2.2 A14B per device
    assert len(result["batching"]) == 3 and "SGLang" in result["batching_source"]
    assert [r["rate_rps"] for r in result["shared_pools"]] and result["shared_pools"][0]["ratio_shared"] > 0
    assert {r["device"] for r in result["wan22_a14b"]} == {"H200 141 GB", "H100 80 GB", "L40S 48 GB"}
    assert "Shared pools" in text and "Wan2.2 T2V A14B" in text and "request shape" in text


@pytest.mark.slow
@pytest.mark.models
def test_simulation_tracks_the_real_engine(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    from engine.bench.resources_validate import ValidationConfig, run

    cfg = ValidationConfig(stage_seconds={"text_encode": 0.05, "denoise": 0.2, "vae_decode": 0.08,
                                          "image_encode": 0.03},
                           instances={"text_encode": 1, "denoise": 1, "vae_decode": 1, "image_encode": 1},
                           loads=(0.6,), requests=12, calibration=2, startup_timeout_s=120)
    stalled = threading.Event()
    resumed = threading.Event()

    def stall(eng: Any) -> None:
        # the denoise worker held off the CPU for 1.5 s a second into the load, as a busy host does to it:
        # the prediction from the calibration cannot know, the replay of the observed stage times must
        pid = eng.worker_pid("sd-t2i.denoise.0")

        def pause() -> None:
            if resumed.wait(1.0):
                return
            os.kill(pid, signal.SIGSTOP)
            stalled.set()
            resumed.wait(1.5)
            os.kill(pid, signal.SIGCONT)

        threading.Thread(target=pause, daemon=True).start()

    try:
        out = run(cfg, model_dir=tiny_models["sd-t2i"], work_dir=tmp_path / "engine",
                  ring_prefix=f"test-{os.getpid()}-res-", log=lambda s: None, before_load=stall)
    finally:
        resumed.set()
    assert stalled.is_set()
    assert out["calibrated_service_s"]["denoise"] >= 0.2  # the stretch holds the instance
    (p,) = out["points"]
    assert p["completed"] == 12
    # The replay gives each request the stage times the engine's events show it had under this load: it
    # checks the queueing model (instance counts, FCFS, hand-offs) whatever the host did to the stages.
    for key in ("throughput_rps", "latency_p50_s"):
        assert 0.8 <= p["replayed"][key] / p["measured"][key] <= 1.25, json.dumps(p)
    # the stall was real: the prediction from the idle calibration misses the measured latency
    assert p["simulated"]["latency_p50_s"] < 0.8 * p["measured"]["latency_p50_s"], json.dumps(p)


# -- batching with published gains, shared pools, Wan2.2 A14B's experts (issue 24 item 8, issue 26 item 5) --
PROFILES = WAN_PROFILE.parent


def test_published_batch_gains_are_sglangs_at_its_sizes() -> None:
    from engine.bench.resources_sim import published_speedup

    # SGLang, Qwen-Image on H200: 512x512 is 1,024 latent tokens, 1024x1024 is 4,096
    assert [published_speedup(k, 1024) for k in (1, 2, 4, 8)] == [1.0, 1.82, 2.77, 3.14]
    assert published_speedup(2, 4096) == published_speedup(8, 4096) == 1.02
    assert published_speedup(8, 32760) == 1.02  # Wan2.1 480p, 81 frames: compute-bound, held at the large size
    assert 1.02 < published_speedup(8, 2048) < 3.14 and 1.82 < published_speedup(3, 1024) < 2.77


def test_batching_saves_devices_only_where_the_published_gain_is() -> None:
    wan = load(WAN_PROFILE)
    small, video = Request(512, 512, 1, 40), Request(480, 832, 81, 40)
    out = {}
    for name, req in (("small", small), ("video", video)):
        sc = Scenario(wan, [(1.0, req)], requests=600)
        rate = 16 / wan.total_seconds(req, "gpu")
        m1, o1 = size(sc, rate)
        mb, ob = size(replace(sc, batch=2, onepiece_batch=2, published_batching=True), rate)
        assert m1 and o1 and mb and ob
        out[name] = (m1.devices, o1.devices, mb.devices, ob.devices)
    # 1,024 tokens: 1.82x at batch 2 takes devices off both deployments (ignoring the gain would not)
    m1, o1, mb, ob = out["small"]
    assert mb < m1 and ob < o1, out
    # 32,760 tokens: 1.02x buys nothing, and a batch's members wait for each other
    m1, o1, mb, ob = out["video"]
    assert mb >= m1 and ob >= o1, out


def _pair(requests: int = 600) -> Any:
    from engine.bench.resources_pools import Cluster, Workflow

    i2v, t2v = load(WAN_PROFILE), load(PROFILES / "wan2.1-t2v-14b-480p-h200-derived.json")
    return Cluster((Workflow("wan2.1-t2v", t2v, 0.5), Workflow("wan2.1-i2v", i2v, 0.5)), requests=requests)


def test_shared_pools_serve_both_wan_workflows_with_fewer_devices() -> None:
    from engine.bench.resources_pools import pools, shared_pools, slo

    cl = _pair()
    shared = pools(cl.workflows, share=True)
    # the published releases share the umT5 encoder and the VAE: one pool each, serving both workflows
    assert shared["umt5-xxl-encoder"]["workflows"] == ["wan2.1-t2v", "wan2.1-i2v"]
    assert shared["wan2.1-vae-decoder"]["workflows"] == ["wan2.1-t2v", "wan2.1-i2v"]
    assert "wan2.1-t2v/denoise" in shared and "wan2.1-i2v/denoise" in shared  # different weights: apart
    assert len(pools(cl.workflows, share=False)) == len(shared) + 3
    (row,) = shared_pools(cl, [4])
    m, alone, both = row["monoliths"], row["onepiece_unshared"], row["onepiece_shared"]
    assert m["by_workflow"].keys() == {"wan2.1-t2v", "wan2.1-i2v"}
    assert m["devices"] == sum(v["devices"] for v in m["by_workflow"].values())
    # sharing takes the duplicated light instances away (ignoring it gives the unshared count)
    assert both["devices"] < alone["devices"], row
    assert both["instances"]["umt5-xxl-encoder"] >= 1 and "wan2.1-t2v/text_encode" not in both["instances"]
    assert row["ratio_shared"] == pytest.approx(m["devices"] / both["devices"])
    for p99 in both["latency_p99_by_workflow_s"].values():  # every workflow meets the objective
        assert p99 <= slo(cl)


def test_wan22_experts_memory_modes_and_stages() -> None:
    from engine.bench.resources_pools import DEVICES_A14B, experts, on_device
    from engine.bench.resources_sim import mono_memory

    a14b = load(PROFILES / "wan2.2-t2v-a14b-480p-h200-derived.json")
    high, low = a14b.stage("denoise_high"), a14b.stage("denoise_low")
    assert (high.step_share, low.step_share) == (26 / 40, 14 / 40) and high.weights_gib == pytest.approx(26.61)
    modes = {label: mono_memory(on_device(a14b, mem, pcie, f), 1) for label, mem, pcie, f in DEVICES_A14B}
    assert modes["H200 141 GB"] == ("resident", 0.0)
    # 80 GB: both experts (53 GiB) + umT5 + activations do not fit; one at a time does: both cross PCIe per request
    assert modes["H100 80 GB"] == ("swap experts", pytest.approx(2 * 26.61, abs=0.01))
    assert modes["L40S 48 GB"][0] == "offload"
    rows = experts(a14b, [8], requests=500, steps=(40,), activations=(None, 8.0))
    by = {(r["device"], r["denoise_activation_gib"]): r for r in rows}
    # 48 GB with 22 GiB of activations: one expert alone does not fit, so neither deployment runs
    assert by[("L40S 48 GB", 22.0)]["onepiece"] is None and by[("L40S 48 GB", 22.0)]["monolithic"] is None
    r = by[("H100 80 GB", 22.0)]
    assert r["swap_s_per_request"] == pytest.approx(2 * 26.61 * 2**30 * 8 / 512e9, rel=1e-3)
    inst = r["onepiece"]["instances"]
    assert inst["denoise_high"] > inst["denoise_low"] >= 1  # each pool sized to its share of the steps
    assert r["ratio"] == pytest.approx(r["monolithic"]["devices"] / r["onepiece"]["devices"])
