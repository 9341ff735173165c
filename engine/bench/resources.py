"""``onepiece bench resources``: devices needed against target throughput, monolithic vs OnePiece.

Measures the paper's "16x fewer GPUs for Wan2.1 image-to-video" instead of
repeating it. For one stage profile (``--profile``; the default is the
published-timings Wan2.1 I2V 14B 480p profile in benchmarks/resources/profiles)
and a request mix, the simulation in ``engine.bench.resources_sim`` finds, for
each target throughput, the fewest devices meeting a p99 latency objective for
a monolithic deployment and for OnePiece's per-stage instances (sized by the
Node Manager's allocator); then sweeps the diffusion stage's share of the time,
steps, video length and request mix, and lists which assumptions produce which
ratio. ``engine.bench.resources_validate`` first checks the simulation against
the real engine on this machine (tiny models, stretched stage times). Writes a
PNG plot, the JSON and a Markdown report into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from engine.bench.resources_pools import Cluster, Workflow, experts, shared_pools
from engine.bench.resources_profile import Profile, Request, load
from engine.bench.resources_sim import (
    BATCH_SOURCE,
    Mix,
    Point,
    Scenario,
    mean_seconds,
    published_speedup,
    size,
    slo_seconds,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PROFILE = "benchmarks/resources/profiles/wan2.1-i2v-14b-480p-h200-published.json"
T2V_PROFILE = "benchmarks/resources/profiles/wan2.1-t2v-14b-480p-h200-derived.json"
A14B_PROFILE = "benchmarks/resources/profiles/wan2.2-t2v-a14b-480p-h200-derived.json"
CLAIM = 16.0


def _resolve(path: str) -> Path:
    p = Path(path)
    return p if p.exists() or p.is_absolute() else REPO_ROOT / p


def _gpu_seconds(profile: Profile, mix: Mix) -> float:
    means = mean_seconds(profile, mix)
    return sum(means[s.name] for s in profile.stages if s.device == "gpu")


def _row(m: Point | None, o: Point | None) -> dict[str, Any]:
    out: dict[str, Any] = {"monolithic": m.as_dict() if m else None, "onepiece": o.as_dict() if o else None}
    if m and o:
        out["ratio"] = m.devices / o.devices
        out["ratio_packed"] = m.devices / int(o.detail["devices_packed"])  # type: ignore[call-overload]
    else:
        out["ratio"] = out["ratio_packed"] = None
    return out


def _at(sc: Scenario, devices: int) -> dict[str, Any]:
    """Both deployments at the rate a monolith of ``devices`` devices would serve fully busy."""
    rate = devices / _gpu_seconds(sc.profile, sc.mix)
    m, o = size(sc, rate)
    return {"rate_rps": rate, **_row(m, o)}


def curve(sc: Scenario, sizes: list[int]) -> list[dict[str, Any]]:
    return [_at(sc, n) for n in sizes]


def _share(profile: Profile, mix: Mix) -> float:
    means = mean_seconds(profile, mix)
    return means.get("denoise", 0.0) / _gpu_seconds(profile, mix)


def sensitivity(sc: Scenario, devices: int, light_occupancy: float) -> dict[str, list[dict[str, Any]]]:
    prof, ref = sc.profile, sc.profile.reference
    out: dict[str, list[dict[str, Any]]] = {"diffusion_share": [], "steps": [], "frames": [], "mix": []}
    base_share = _share(prof, sc.mix)
    for share in sorted({0.05, 0.1, 0.3, 0.5, 0.7, 0.9, round(base_share, 3), 0.99}):
        p = prof if abs(share - base_share) < 1e-3 else prof.with_diffusion_share(share)
        row = _at(replace(sc, profile=p), devices)
        idle = _at(replace(sc, profile=p.with_occupancy(light_occupancy)), devices)
        out["diffusion_share"].append({"diffusion_share": share, **row,
                                       "ratio_packed_idle_light": idle["ratio_packed"]})
    idle_prof = prof.with_occupancy(light_occupancy)

    def both(mix: Mix) -> dict[str, Any]:
        return {"diffusion_share": _share(prof, mix), **_at(replace(sc, mix=mix), devices),
                "ratio_packed_idle_light": _at(replace(sc, mix=mix, profile=idle_prof), devices)["ratio_packed"]}

    for steps in (4, 10, 20, 40, 50):
        out["steps"].append({"steps": steps, **both([(1.0, replace(ref, steps=steps))])})
    for frames in (17, 33, 49, 81, 129):
        out["frames"].append({"frames": frames, **both([(1.0, replace(ref, frames=frames))])})
    mixes: dict[str, Mix] = {
        "all 480p, 81 frames, 40 steps": [(1.0, ref)],
        "50% distilled 4-step + 50% 40-step": [(0.5, replace(ref, steps=4)), (0.5, ref)],
        "70% 33-frame clips + 30% 81-frame": [(0.7, replace(ref, frames=33)), (0.3, ref)],
        "50% 480p + 50% 720p (720x1280)": [(0.5, ref), (0.5, Request(720, 1280, ref.frames, ref.steps))],
    }
    for name, mix in mixes.items():
        out["mix"].append({"mix": name, **both(mix)})
    return out


def assumptions(sc: Scenario, devices: int, light_occupancy: float) -> list[dict[str, Any]]:
    """Which assumption produces which ratio, at one cluster size."""
    prof = sc.profile
    rows: list[dict[str, Any]] = []

    def add(name: str, s: Scenario, note: str = "") -> None:
        rows.append({"assumption": name, "note": note, **_at(s, devices)})

    add("as built: batch 1 both, one instance per device", sc)
    add("monolith batches 2 (diffusers num_videos_per_prompt-style)", replace(sc, batch=2),
        "the 14B transformer is compute-bound (batch gain 0), so a batch of two takes twice as long")
    add("OnePiece batches its light stages (8 per batch; a what-if, TaskWorkers run one at a time)",
        replace(sc, onepiece_batch=8))
    add(f"light stages leave the device idle (occupancy {light_occupancy}) and OnePiece packs them",
        replace(sc, profile=prof.with_occupancy(light_occupancy)), "read the ratio_packed column")
    add("H100 80 GB devices (everything still fits one device)", replace(sc, profile=replace(prof, device_memory_gib=74.5)))
    add("48 GB devices (L20/L40S class)", replace(sc, profile=replace(prof, device_memory_gib=44.7)),
        "the 14B transformer's 30.5 GiB + 22 GiB activations fit neither deployment: both need sharding (not modelled)")
    add("monolith runs 8-GPU sequence parallel per replica at 3.5x (published), OnePiece one GPU per instance",
        replace(sc, gpus_per_replica=8, sp_speedup=3.5),
        "not like for like: the monolith buys latency OnePiece's single-GPU denoise does not have")
    share = _share(prof, sc.mix)
    rows.append({"assumption": "upper bound: light stages free, OnePiece pays only for the diffusion stage",
                 "note": "1 / diffusion share: the most any disaggregation can save at batch 1",
                 "ratio": 1 / share, "ratio_packed": 1 / share})
    return rows


BATCH_SHAPES: dict[str, Request] = {
    "480x832, 81 frames (32,760 latent tokens)": Request(480, 832, 81, 40),
    "1024x1024, 1 frame (4,096 tokens: SGLang's 1.02x size)": Request(1024, 1024, 1, 40),
    "512x512, 1 frame (1,024 tokens: SGLang's 1.82-3.14x size)": Request(512, 512, 1, 40),
}


def batching(sc: Scenario, devices: int, batches: tuple[int, ...] = (2, 4, 8)) -> list[dict[str, Any]]:
    """Both deployments at batch 1 and at their best maximum batch of ``batches`` (the fewest devices) with
    the published denoise gains by latent tokens (``resources_sim.PUBLISHED_BATCH_SPEEDUP``; the light stages
    keep their ``batch_gain``), per request shape, at the rate a ``devices``-device monolith serves fully
    busy at batch 1. A free instance takes up to the maximum of the waiting requests, never waiting for more:
    a bigger batch raises throughput by the gain and each member's latency by batch / gain."""
    rows = []
    for name, req in BATCH_SHAPES.items():
        mix: Mix = [(1.0, req)]
        base = replace(sc, mix=mix, batch=1, onepiece_batch=1, published_batching=False)
        rate = devices / _gpu_seconds(sc.profile, mix)
        m1, o1 = size(base, rate)
        by: dict[int, tuple[Point | None, Point | None]] = {1: (m1, o1)}
        for b in batches:
            by[b] = size(replace(base, batch=b, onepiece_batch=b, published_batching=True), rate)

        bm, bo = _best_batch(by, 0), _best_batch(by, 1)
        mb, ob = by[bm][0], by[bo][1]
        rows.append({"shape": name, "latent_tokens": req.tokens, "rate_rps": rate,
                     "denoise_speedup": {str(b): published_speedup(b, req.tokens) for b in batches},
                     "devices_by_batch": {str(b): {"monolithic": m and m.devices, "onepiece": o and o.devices}
                                          for b, (m, o) in by.items()},
                     "batch1": _row(m1, o1), "monolith_best_batch": bm, "onepiece_best_batch": bo,
                     "batched": _row(mb, ob),
                     "monolith_batched_vs_batch1": m1.devices / mb.devices if m1 and mb else None,
                     "onepiece_batched_vs_batch1": o1.devices / ob.devices if o1 and ob else None})
    return rows


def _best_batch(by: dict[int, tuple[Point | None, Point | None]], side: int) -> int:
    """The maximum batch with the fewest devices on one side (0: monolithic, 1: OnePiece); the smaller on ties."""
    ok = {b: p.devices for b, pts in by.items() if (p := pts[side]) is not None}
    return min(ok, key=lambda b: (ok[b], b)) if ok else 1


def _cluster(args: Any) -> Cluster:
    i2v, t2v = load(_resolve(args.profile)), load(_resolve(T2V_PROFILE))
    return Cluster((Workflow("wan2.1-t2v", t2v, 0.5), Workflow("wan2.1-i2v", i2v, 0.5)), slo_x=args.slo_x,
                   hop_s=args.hop_ms / 1e3, requests=args.requests)


# -- output --------------------------------------------------------------------------------------
def _f(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def markdown(result: dict[str, Any]) -> str:
    """The results page: the devices curve, then each table the run produced (assumptions, sensitivity,
    validation against the real engine, and the later figures)."""
    lines = _md_curve(result) + _md_assumptions(result) + _md_sensitivity(result) + _md_validation(result)
    lines += _markdown_new(result)
    return "\n".join(lines) + "\n"


def _md_curve(result: dict[str, Any]) -> list[str]:
    prof = result["profile"]
    lines = [f"Profile: `{prof['name']}` ({prof['kind']}; {prof['device']}); mix: {result['mix']}; latency objective: "
             f"p99 <= {result['slo_x']}x the idle end-to-end time ({_f(result['slo_s'], '.0f')} s); hop cost "
             f"{result['hop_ms']:.0f} ms; {result['requests']}+ simulated requests per point; devices counted as "
             "one per instance (\"dedicated\") and with light stages packed by busy time and memory (\"packed\").",
             "", "| target req/h | monolithic devices | OnePiece devices | packed | ratio mono/OnePiece | ratio packed "
             "| device-s/req mono | OnePiece | util mono | OnePiece | p50/p99 s mono | p50/p99 s OnePiece |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["curve"]:
        m, o = r["monolithic"], r["onepiece"]
        lines.append(
            f"| {r['rate_rps'] * 3600:.0f} | {_f(m and m['devices'], 'd')} | {_f(o and o['devices'], 'd')} | "
            f"{_f(o and o['devices_packed'], 'd')} | {_f(r['ratio'], '.3f')} | {_f(r['ratio_packed'], '.3f')} | "
            f"{_f(m and m['device_s_per_request'], '.0f')} | {_f(o and o['device_s_per_request'], '.0f')} | "
            f"{_f(m and m['utilisation'], '.2f')} | {_f(o and o['utilisation'], '.2f')} | "
            f"{_f(m and m['latency_p50_s'], '.0f')}/{_f(m and m['latency_p99_s'], '.0f')} | "
            f"{_f(o and o['latency_p50_s'], '.0f')}/{_f(o and o['latency_p99_s'], '.0f')} |")
    return lines


def _md_assumptions(result: dict[str, Any]) -> list[str]:
    if not result.get("assumptions"):
        return []
    lines = ["", f"Which assumptions produce which ratio (at the rate a {result['sensitivity_devices']}-device "
             "monolith serves fully busy):", "", "| assumption | monolithic | OnePiece | packed | ratio | ratio packed "
             "| note |", "|---|---:|---:|---:|---:|---:|---|"]
    for r in result["assumptions"]:
        m, o = r.get("monolithic"), r.get("onepiece")
        lines.append(f"| {r['assumption']} | {_f(m and m['devices'], 'd')} | {_f(o and o['devices'], 'd')} | "
                     f"{_f(o and o['devices_packed'], 'd')} | {_f(r['ratio'], '.3f')} | "
                     f"{_f(r['ratio_packed'], '.3f')} | {r.get('note', '')} |")
    return lines


def _md_sensitivity(result: dict[str, Any]) -> list[str]:
    sens = result.get("sensitivity")
    if not sens:
        return []
    lines = ["", f"Sensitivity (at the rate a {result['sensitivity_devices']}-device monolith serves fully busy; "
             f"'idle light' = light stages at occupancy {result['light_occupancy']}, packed):", ""]
    lines += ["| diffusion share | monolithic | OnePiece | packed | ratio | ratio packed | ratio packed, idle light |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in sens["diffusion_share"]:
        lines.append(f"| {r['diffusion_share']:.3f} | {_dev(r)} | {_f(r['ratio'], '.3f')} | "
                     f"{_f(r['ratio_packed'], '.3f')} | {_f(r['ratio_packed_idle_light'], '.3f')} |")
    for key, label in (("steps", "steps"), ("frames", "frames"), ("mix", "request mix")):
        lines += ["", f"| {label} | diffusion share | monolithic | OnePiece | packed | ratio | ratio packed "
                  "| ratio packed, idle light |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in sens[key]:
            lines.append(f"| {r[key]} | {r['diffusion_share']:.3f} | {_dev(r)} | {_f(r['ratio'], '.3f')} | "
                         f"{_f(r['ratio_packed'], '.3f')} | {_f(r['ratio_packed_idle_light'], '.3f')} |")
    return lines


def _md_validation(result: dict[str, Any]) -> list[str]:
    v = result.get("validation")
    if not v:
        return []
    lines = ["", f"Validation against the real engine ({v['workflow']}, tiny models, stage times stretched to "
             f"{v['stage_seconds']}, instances {v['instances']}; calibrated service "
             f"{ {k: round(x * 1e3, 1) for k, x in v['calibrated_service_s'].items()} } ms, hop transit "
             f"{ {k: round(x * 1e3, 1) for k, x in v['calibrated_transit_s'].items()} } ms; "
             f"{v['requests_per_load']} requests per load):", "",
             "| load x capacity | offered req/s | throughput measured | simulated | diff | p50 ms measured | "
             "simulated | diff | p99 ms measured | simulated | within 10% |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for p in v["points"]:
        me, si = p["measured"], p["simulated"]
        lines.append(f"| {p['load_x_capacity']:.2f} | {p['offered_rps']:.2f} | {me['throughput_rps']:.2f} | "
                     f"{si['throughput_rps']:.2f} | {p['throughput_diff_pct']:+.1f}% | "
                     f"{me['latency_p50_s'] * 1e3:.0f} | {si['latency_p50_s'] * 1e3:.0f} | {p['p50_diff_pct']:+.1f}% | "
                     f"{me['latency_p99_s'] * 1e3:.0f} | {si['latency_p99_s'] * 1e3:.0f} | "
                     f"{'yes' if p['within_10pct'] else 'NO'} |")
    return lines


def _markdown_new(result: dict[str, Any]) -> list[str]:
    lines: list[str] = []
    rows = result.get("batching")
    if rows:
        lines += ["", f"Batching (at the rate a {result['sensitivity_devices']}-device monolith serves fully busy at "
                  f"batch 1; denoise gains by latent tokens from {result['batching_source']}; a free instance takes "
                  "up to the maximum batch of the waiting requests, never waiting for more; each side at its best "
                  "maximum of 1, 2, 4, 8):", "",
                  "| request shape | denoise gain at 2/4/8 | batch 1: monolithic | OnePiece | ratio | batched: monolithic "
                  "(best max) | OnePiece (best max) | ratio | monolith batched / 1 | OnePiece batched / 1 |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            a, b = r["batched"], r["batch1"]
            gains = "/".join(f"{v:.2f}" for v in r["denoise_speedup"].values())
            m, o = a.get("monolithic"), a.get("onepiece")
            lines.append(f"| {r['shape']} | {gains} | {_dev2(b)} | {_f(b['ratio'], '.3f')} | "
                         f"{_f(m and m['devices'], 'd')} ({r['monolith_best_batch']}) | "
                         f"{_f(o and o['devices'], 'd')} ({r['onepiece_best_batch']}) | {_f(a['ratio'], '.3f')} | "
                         f"{_f(r['monolith_batched_vs_batch1'], '.2f')}x | {_f(r['onepiece_batched_vs_batch1'], '.2f')}x |")
    rows = result.get("shared_pools")
    if rows:
        lines += ["", "Shared pools: Wan2.1 T2V-14B and I2V-14B, half the requests each (480p, 81 frames, 40 steps), "
                  "one monolithic deployment per workflow vs OnePiece with one pool per workflow and stage "
                  "(unshared) and with the umT5 encoder, VAE decoder and mp4 encoder pools shared:", "",
                  "| target req/h | monoliths (t2v + i2v) | OnePiece unshared | OnePiece shared | ratio unshared "
                  "| ratio shared | p99 s monoliths | OnePiece shared |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            m, u, sh = r["monoliths"], r["onepiece_unshared"], r["onepiece_shared"]
            by = m and " + ".join(str(v["devices"]) for v in m["by_workflow"].values())
            lines.append(f"| {r['rate_rps'] * 3600:.0f} | {_f(m and m['devices'], 'd')} ({by}) | "
                         f"{_f(u and u['devices'], 'd')} | {_f(sh and sh['devices'], 'd')} | "
                         f"{_f(r['ratio_unshared'], '.3f')} | {_f(r['ratio_shared'], '.3f')} | "
                         f"{_f(m and m['latency_p99_s'], '.0f')} | {_f(sh and sh['latency_p99_s'], '.0f')} |")
    rows = result.get("wan22_a14b")
    if rows:
        lines += ["", "Wan2.2 T2V A14B (480p, 81 frames; the high-noise expert runs 26 of 40 steps): a monolith holding "
                  "both experts when they fit, else swapping them per request over PCIe, else offloading every "
                  "component, vs OnePiece with each expert a stage (one expert per instance), same p99 objective:",
                  "", "| device | steps | denoise activation GiB | monolith memory | swap s/request | request device-s "
                  "| target req/h | monolithic | OnePiece | ratio mono/OnePiece |",
                  "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            m, o = r["monolithic"], r["onepiece"]
            lines.append(f"| {r['device']} | {r['steps']} | {r['denoise_activation_gib']:.0f} | {r['monolith_memory']} | "
                         f"{r['swap_s_per_request']:.2f} | {r['request_device_s']:.0f} | {r['rate_rps'] * 3600:.0f} | "
                         f"{_f(m and m['devices'], 'd')} | {_f(o and o['devices'], 'd')} | {_f(r['ratio'], '.3f')} |")
    return lines


def _dev2(r: dict[str, Any]) -> str:
    m, o = r.get("monolithic"), r.get("onepiece")
    return f"{_f(m and m['devices'], 'd')} | {_f(o and o['devices'], 'd')}"


def _dev(r: dict[str, Any]) -> str:
    m, o = r.get("monolithic"), r.get("onepiece")
    return f"{_f(m and m['devices'], 'd')} | {_f(o and o['devices'], 'd')} | {_f(o and o['devices_packed'], 'd')}"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3 if result.get("sensitivity") else 2, figsize=(16 if result.get("sensitivity") else 11, 4.6))
    rows = [r for r in result["curve"] if r["monolithic"] and r["onepiece"]]
    x = [r["rate_rps"] * 3600 for r in rows]
    ax = axes[0]
    ax.plot(x, [r["monolithic"]["devices"] for r in rows], "o-", label="monolithic (diffusers-style)")
    ax.plot(x, [r["onepiece"]["devices"] for r in rows], "s-", label="OnePiece, one instance per device")
    ax.plot(x, [r["onepiece"]["devices_packed"] for r in rows], "^--", label="OnePiece, light stages packed")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("target throughput (requests/hour)")
    ax.set_ylabel(f"devices meeting p99 <= {result['slo_x']}x idle latency")
    ax.set_title(f"{result['profile']['name']}\n({result['profile']['kind']})", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    ax = axes[1]
    ax.plot(x, [r["ratio"] for r in rows], "s-", label="ratio, one instance per device")
    ax.plot(x, [r["ratio_packed"] for r in rows], "^--", label="ratio, light stages packed")
    ax.axhline(CLAIM, color="red", linestyle=":", label="the paper's claim (16x)")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("target throughput (requests/hour)")
    ax.set_ylabel("monolithic devices / OnePiece devices")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    if result.get("sensitivity"):
        ds = result["sensitivity"]["diffusion_share"]
        s = [r["diffusion_share"] for r in ds]
        ax = axes[2]
        ax.plot(s, [r["ratio"] for r in ds], "s-", label="one instance per device")
        ax.plot(s, [r["ratio_packed"] for r in ds], "^--", label="light stages packed")
        ax.plot(s, [r["ratio_packed_idle_light"] for r in ds], "v-.",
                label=f"packed, light stages occupancy {result['light_occupancy']}")
        ax.plot(s, [1 / v for v in s], ":", color="black", label="bound: 1 / diffusion share (light stages free)")
        ax.axvline(result["base_share"], color="grey", linewidth=0.8)
        ax.annotate(f"profile: {result['base_share']:.3f}", (result["base_share"], 1.3), fontsize=7, ha="right",
                    rotation=90)
        ax.axhline(CLAIM, color="red", linestyle=":", label="16x")
        ax.set_yscale("log")
        ax.set_xlabel("diffusion stage's share of device time")
        ax.set_ylabel("ratio")
        ax.set_title(f"at {result['sensitivity_devices']} monolithic devices' worth of load", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: Any, log: Any = print) -> dict[str, Any]:
    t0 = time.perf_counter()
    profile = load(_resolve(args.profile))
    mix: Mix = [(1.0, profile.reference)]
    sc = Scenario(profile, mix, slo_x=args.slo_x, batch=args.batch, hop_s=args.hop_ms / 1e3, requests=args.requests)
    result: dict[str, Any] = {
        "profile": {"name": profile.name, "kind": profile.kind, "device": profile.device,
                    "stages": {s.name: {"seconds": s.seconds, "per": s.per, "kind": s.kind, "source": s.source,
                                        "memory_gib": s.memory_gib, "device": s.device} for s in profile.stages},
                    "sources": list(profile.sources)},
        "mix": "all at the reference shape " + str(profile.reference.__dict__), "slo_x": args.slo_x,
        "slo_s": slo_seconds(profile, mix, args.slo_x), "hop_ms": args.hop_ms, "requests": args.requests,
        "batch": args.batch, "base_share": _share(profile, mix), "sensitivity_devices": args.sensitivity_devices, "light_occupancy": args.light_occupancy,
    }
    if not args.no_validate:
        from engine.bench.resources_validate import ValidationConfig
        from engine.bench.resources_validate import run as validate

        vc = ValidationConfig(requests=args.validate_requests, loads=tuple(args.validate_loads))
        result["validation"] = validate(vc, log=log)
    log(f"simulating {len(args.sizes)} cluster sizes ...")
    result["curve"] = curve(sc, args.sizes)
    if not args.no_sensitivity:
        log("assumptions and sensitivity ...")
        result["assumptions"] = assumptions(sc, args.sensitivity_devices, args.light_occupancy)
        result["sensitivity"] = sensitivity(sc, args.sensitivity_devices, args.light_occupancy)
    if not args.no_batching:
        log("batching with the published gains ...")
        result["batching"] = batching(sc, args.sensitivity_devices)
        result["batching_source"] = BATCH_SOURCE
    if not args.no_pools:
        log("shared pools: Wan2.1 T2V-14B and I2V-14B ...")
        result["shared_pools"] = shared_pools(_cluster(args), args.pool_sizes)
    if not args.no_experts:
        log("Wan2.2 A14B: experts as stages ...")
        a14b = load(_resolve(A14B_PROFILE))
        result["wan22_a14b"] = experts(a14b, args.expert_sizes, requests=args.requests, slo_x=args.slo_x,
                                       hop_s=args.hop_ms / 1e3)
        result["wan22_a14b_profile"] = {"name": a14b.name, "sources": list(a14b.sources),
                                        "stages": {s.name: {"seconds": s.seconds, "per": s.per,
                                                            "step_share": s.step_share, "weights_gib": s.weights_gib,
                                                            "activation_gib": s.activation_gib, "source": s.source}
                                                   for s in a14b.stages}}
    result["seconds"] = time.perf_counter() - t0
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``onepiece bench resources``."""
    p.add_argument("--profile", default="benchmarks/resources/profiles/wan2.1-i2v-14b-480p-h200-published.json",
                     help="stage profile JSON (benchmarks/wan_fullsize_profile.py's output, or a hand-written one)")
    p.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128, 256, 512],
                     help="target throughputs, as the devices a fully busy monolith would need for them")
    p.add_argument("--slo-x", type=float, default=2.0,
                     help="latency objective: p99 <= this x the idle end-to-end time of the longest request")
    p.add_argument("--batch", type=int, default=1, help="monolithic batch size")
    p.add_argument("--hop-ms", type=float, default=20.0, help="OnePiece cost per stage hop, besides the bytes")
    p.add_argument("--requests", type=int, default=2000, help="simulated requests per point (at least)")
    p.add_argument("--sensitivity-devices", type=int, default=64,
                     help="cluster size (in fully busy monolithic devices) for the sensitivity sweeps")
    p.add_argument("--light-occupancy", type=float, default=0.25,
                     help="what-if share of the device the light stages keep busy (the paper's idle GPUs)")
    p.add_argument("--no-sensitivity", action="store_true", help="skip the assumption and sensitivity sweeps")
    p.add_argument("--no-validate", action="store_true", help="skip the real-engine validation")
    p.add_argument("--validate-requests", type=int, default=60, help="requests per validation load")
    p.add_argument("--validate-loads", type=float, nargs="+", default=[0.3, 0.6, 0.85, 1.2],
                     help="validation loads as fractions of the engine's calibrated capacity")
    p.add_argument("--no-batching", action="store_true", help="skip the published-batching rows")
    p.add_argument("--no-pools", action="store_true", help="skip Wan2.1 T2V + I2V with shared stage pools")
    p.add_argument("--pool-sizes", type=int, nargs="+", default=[4, 16, 64, 256],
                   help="shared pools: target throughputs, as fully busy monolithic devices")
    p.add_argument("--no-experts", action="store_true", help="skip Wan2.2 A14B's experts as stages")
    p.add_argument("--expert-sizes", type=int, nargs="+", default=[8, 64, 256],
                   help="Wan2.2 A14B: target throughputs, as fully busy monolithic devices")
    p.add_argument("--out-dir", default="benchmarks/resources", help="where the PNG, JSON and results.md go")
    p.add_argument("--json", action="store_true", help="print JSON instead of the tables")


def main(args: Any) -> int:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = run(args, log=(lambda s: None) if args.json else (lambda s: print(s, flush=True)))
    png = out / "resources.png"
    plot(result, png)
    (out / "resources.json").write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(result)
    (out / "results.md").write_text(text)
    result["files"] = [str(png), str(out / "resources.json"), str(out / "results.md")]
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(text)
        print(f"wrote {', '.join(result['files'])} in {result['seconds']:.0f} s")
    return 0
