"""``onepiece bench resources``: monolithic vs OnePiece sizing, the CLI, and the real-engine validation."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from engine.bench.resources_profile import Profile, Request, Stage, from_obj, load, stretched
from engine.bench.resources_sim import Scenario, simulate_monolithic, size
from engine.manager.allocator import theorem1
from engine.manager.simulate import poisson_arrivals

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
               "--sensitivity-devices", "8", "--out-dir", str(tmp_path)])
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


@pytest.mark.slow
@pytest.mark.models
def test_simulation_tracks_the_real_engine(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    from engine.bench.resources_validate import ValidationConfig, run

    cfg = ValidationConfig(stage_seconds={"text_encode": 0.05, "denoise": 0.2, "vae_decode": 0.08,
                                          "image_encode": 0.03},
                           instances={"text_encode": 1, "denoise": 1, "vae_decode": 1, "image_encode": 1},
                           loads=(0.6,), requests=12, calibration=2, startup_timeout_s=120)
    out = run(cfg, model_dir=tiny_models["sd-t2i"], work_dir=tmp_path / "engine",
              ring_prefix=f"test-{os.getpid()}-res-", log=lambda s: None)
    assert out["calibrated_service_s"]["denoise"] >= 0.2  # the stretch holds the instance
    (p,) = out["points"]
    assert p["completed"] == 12
    # a generous bound: it catches broken wiring, not noise on a shared 2-core machine
    for key in ("throughput_rps", "latency_p50_s"):
        assert 0.5 <= p["simulated"][key] / p["measured"][key] <= 2.0, p
