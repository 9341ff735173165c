"""``onepiece bench e2e``'s figures as lines for a reader (``--json`` prints them whole)."""

from __future__ import annotations

from typing import Any

from engine.bench import stream
from engine.workflow.options import LOSSLESS


def print_text(r: dict[str, Any]) -> None:
    """The figures as lines for a reader (``--json`` prints them whole)."""
    if "provenance" in r:
        p = r["provenance"]
        print(f"commit {p['commit'] or '?'}{'' if p['tree_clean'] else ' (tree not clean)'}; {p['cpu_model']}, "
              f"{p['usable_cores']} of {p['host_cores']} cores; load average {p['load_average_before'][0]:.2f} before, "
              f"{p['load_average_after'][0]:.2f} after")
    hog = f", {r['hog']} core hog(s) running" if r["hog"] else ""
    print(f"{r['workflow']} at quality {r.get('quality', LOSSLESS)}: {_request_line(r)}")
    print(f"{r['workflow']} on {r['cores']} cores{hog}: staged p50 {r['staged_latency_p50_s'] * 1e3:.1f} ms vs "
          f"one-call {r['one_call_latency_p50_s'] * 1e3:.1f} ms interleaved ({r['one_call_threads']} threads, its "
          f"best) = {r['staged_vs_one_call']:.2f}x; per stage hop ({r['stage_hops']} hops): "
          f"{r['added_per_hop_ms']:.1f} ms median of {r['pairs']} paired differences (p10 "
          f"{r['added_per_hop_p10_ms']:.1f}, p90 {r['added_per_hop_p90_ms']:.1f}); "
          f"{r['added_per_hop_vs_isolated_ms']:.1f} ms against the isolated one-call "
          f"{r['one_call_isolated_p50_s'] * 1e3:.1f} ms")
    if r["hog"]:
        print(f"isolation (interleaved pairs both times): staged p50 quiet {r['staged_latency_p50_quiet_s'] * 1e3:.1f}"
              f" ms, with the hog(s) {r['staged_latency_p50_s'] * 1e3:.1f} ms = {r['hog_vs_quiet_p50']:.2f}x "
              f"(one-call {r['one_call_hog_vs_quiet_p50']:.2f}x)")
    print(f"capacity: {r['capacity_rps']:.2f} requests/s at saturation ({r['saturate_in_flight']} in flight) vs "
          f"monolith {r['monolith_capacity_rps']:.2f} requests/s ({r['monolith_processes']} process(es)) = "
          f"{r['staged_vs_monolith_capacity']:.2f}x; open-loop requests carry a {r['deadline_s']:.0f} s deadline")
    _print_baselines(r)
    if r.get("control_plane_cpu_ms_per_request") is not None:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in r["control_plane_breakdown"].items())
        print(f"control plane: {r['control_plane_cpu_ms_per_request']:.1f} ms CPU per completed request at "
              f"saturation ({parts}); stage workers {r['stage_workers_cpu_ms_per_request']:.1f} ms")
    if r.get("first_fragment_vs_complete") is not None:
        print(f"streamed video ({stream.WORKFLOW}, {r['stream_runs']} runs): first playable fragment after "
              f"{r['first_fragment_s']:.2f} s, complete after {r['stream_complete_s']:.2f} s: "
              f"first_fragment_vs_complete {r['first_fragment_vs_complete']:.2f} (goal <= 0.5)")
    print_priority_and_eta(r)
    _print_open_loop(r["open_loop"])


def _request_line(r: dict[str, Any]) -> str:
    """The measured request in a few words: its size, steps and input files."""
    p = r["params"]
    size = f"{p['width']}x{p['height']}" + (f", {p['num_frames']} frames" if "num_frames" in p else "")
    files = "".join(f", {name}: {what}" for name, what in r.get("inputs", {}).items())
    return f"{size}, {p['num_inference_steps']} steps, seed {p['seed']}{files} (both sides)"


def _print_baselines(r: dict[str, Any]) -> None:
    if r.get("staged_vs_batched_monolith_capacity") is not None:
        print(f"batched monolith: {r['batched_monolith_capacity_rps']:.2f} requests/s at batch "
              f"{r['batched_monolith_batch']} (its best of {', '.join(r['batched_monolith_rps_by_batch'])}) = "
              f"{r['staged_vs_batched_monolith_capacity']:.2f}x")
    if r.get("staged_vs_single_stage_capacity") is not None:
        print(f"single stage: {r['single_stage_capacity_rps']:.2f} requests/s with the whole pipeline in one stage "
              f"({r['single_stage_instances']} instance(s)) vs staged {r['single_stage_staged_capacity_rps']:.2f} "
              f"on the same private engine = {r['staged_vs_single_stage_capacity']:.2f}x; outputs "
              f"{'equal' if r['single_stage_output_equal'] else 'DIFFER'}")
    if r.get("mixed_vs_monolith_capacity") is not None:
        print(f"mixed ({', '.join(r['mixed_workflows'])}, equal shares): staged {r['mixed_capacity_rps']:.2f} "
              f"requests/s ({r['mixed_instances']} instances) vs the best monolith deployment "
              f"{r['monolith_mix_capacity_rps']:.2f} ({r['monolith_mix_config']}: {r['monolith_mix_processes']} "
              f"process(es) x {r['monolith_mix_threads']} thread(s)) = {r['mixed_vs_monolith_capacity']:.2f}x; "
              f"memory staged {r['staged_pss_mb']:.0f} MiB PSS ({r['staged_rss_mb']:.0f} MiB summed peak RSS) vs "
              f"monolith {r['monolith_pss_mb']:.0f} MiB PSS ({r['monolith_rss_mb']:.0f} MiB)")


def _fmt(v: float | None, spec: str) -> str:
    return format(v, spec) if v is not None else "-"


def _print_open_loop(rows: list[dict[str, Any]]) -> None:
    f = _fmt
    print(f"{'load':>6} {'offered':>8} {'accepted':>8} {'in dl':>6} {'late':>5} {'expired':>7} {'refused':>7} "
          f"{'busy s':>6} {'goodput':>8} {'x cap':>6} {'in win':>6} {'p50 s':>7} {'p99 s':>7} {'refuse p99 ms':>13}")
    for row in rows:
        print(f"{row['load_x_capacity']:>5}x {row['offered']:8d} {row['accepted']:8d} "
              f"{row['completed_in_deadline']:6d} {row['completed_late']:5d} {row['expired']:7d} "
              f"{row['refused']:7d} {row['busy_period_s']:6.1f} {row['goodput_busy_rps']:8.2f} "
              f"{row['goodput_busy_x_capacity']:6.2f} {row['goodput_in_window_x_capacity']:6.2f} "
              f"{f(row['latency_p50_s'], '7.2f')} {f(row['latency_p99_s'], '7.2f')} "
              f"{f(row['reject_latency_p99_ms'], '13.1f')}")


def print_priority_and_eta(r: dict[str, Any]) -> None:
    """The text lines of ``priority_2x`` and ``eta_calibration``."""
    f = _fmt
    pr = r["priority_2x"]
    print(f"priority at 2x load ({pr['high_share']:.0%} high): high p99 {f(pr['high_p99_s'], '.2f')} s vs unloaded "
          f"p99 {f(pr['unloaded_p99_s'], '.2f')} s = {f(pr['high_p99_vs_unloaded_p99'], '.2f')}x (goal <= 1.5x); "
          f"high {pr['high_completed']}/{pr['high_offered']} completed, {pr['high_refused']} refused; low "
          f"{pr['low_completed']}/{pr['low_accepted']} accepted completed, {pr['low_refused']} refused, max "
          f"{f(pr['low_max_s'], '.2f')} s")
    for load, c in r["eta_calibration"].items():
        print(f"eta at {load}: p50 within 50% of the actual time for {f(c['eta_p50_within_50pct_share'], '.0%')} "
              f"(goal >= 80%), median relative error {f(c['eta_p50_median_rel_error'], '.2f')} vs "
              f"{f(c['eta_constant_median_rel_error'], '.2f')} for the best constant; p90 coverage "
              f"{f(c['eta_p90_coverage'], '.0%')} (goal 85-95%) over {c['eta_jobs']} jobs")
