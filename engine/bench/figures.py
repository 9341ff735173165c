"""The figures ``onepiece bench e2e`` derives from raw samples, as pure functions.

Each one states what it divides by what, so that a reader of the JSON can recompute it, and each replaces a
formula that flattered the engine:

- :func:`goodput`: completions within their deadline divided by the **busy period** (first scheduled send
  to the last request's end), and, apart, those that also ended inside the send window divided by the
  window. The old figure divided every in-deadline completion, the backlog drained after sending stopped
  included, by the send window alone.
- :func:`paired_hop`: the cost per stage hop as the median of paired differences (each staged request
  against the one-call run next to it), with its spread; the old figure was the difference of two medians.
- :func:`eta_p50_error`: the ETA's p50 judged by relative error, beside the best constant estimate's (the
  median of the actual times, known only afterwards), so a constant cannot pass; the old check, within
  max(1 s, 50%), was met by any estimate when every job took under a second.
- :func:`pss_kb`: proportional memory from ``/proc/PID/smaps_rollup``: shared pages (torch's libraries,
  mapped by every worker) are split between the processes that map them instead of counted once each.
- :func:`provenance`: what the run was: commit, clean tree or not, CPU, cores, load, command line.

And the rows of a run, from its samples: :func:`latency_figures` (interleaved staged and one-call pairs),
:func:`open_loop_row` (one open-loop load), :func:`eta_fields` and :func:`priority_figure`. The harness that
takes the samples is :mod:`engine.bench.e2e`; the text it prints, :mod:`engine.bench.e2e_report`.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REL_GOAL = 0.5  # the ETA's p50 counts as right when within 50% of the actual time


def pct(values: Sequence[float], q: float) -> float | None:
    """The ``q`` quantile by rank (the smallest value with at least ``q`` of the samples at or below it)."""
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * q))]


def goodput(ends: Sequence[tuple[str, float, float]], start: float, seconds: float, deadline_s: float) -> dict[str, Any]:
    """Goodput of an open-loop row from each request's ``(state, scheduled send, end)`` (absolute seconds on
    one clock; a refusal ends when it is answered). ``start`` is when sending began, ``seconds`` how long it
    went on.

    - ``goodput_busy_rps``: completions within their deadline / busy period (``start`` to the last end);
    - ``goodput_in_window_rps``: completions within their deadline that also ended before sending stopped /
      ``seconds``.
    """
    good = [(at, end) for st, at, end in ends if st == "completed" and end - at <= deadline_s]
    last = max((end for _, _, end in ends), default=start + seconds)
    busy = max(seconds, last - start)
    in_window = sum(1 for _, end in good if end <= start + seconds)
    return {"busy_period_s": busy, "goodput_busy_rps": len(good) / busy,
            "goodput_in_window_rps": in_window / seconds, "completed_in_deadline_in_window": in_window}


def paired_hop(pairs: Sequence[tuple[float, float]], hops: int) -> dict[str, Any]:
    """Milliseconds added per stage hop from ``(staged s, one-call s)`` pairs measured next to each other:
    the median of the per-pair differences over ``hops``, with the 10th and 90th percentiles of the same."""
    if not pairs:
        return {"added_per_hop_ms": None, "added_per_hop_p10_ms": None, "added_per_hop_p90_ms": None, "pairs": 0}
    diffs = [(s - b) / hops * 1e3 for s, b in pairs]
    return {"added_per_hop_ms": statistics.median(diffs), "added_per_hop_p10_ms": pct(diffs, 0.1),
            "added_per_hop_p90_ms": pct(diffs, 0.9), "pairs": len(diffs)}


def eta_p50_error(told: Sequence[tuple[float, float, float]]) -> dict[str, Any]:
    """The ETA's p50 over ``(p50 told, p90 told, actual)`` triples, by relative error ``|actual - p50| /
    actual``: the median error, the share within :data:`REL_GOAL`, and the same two for the best constant
    estimate in hindsight (the median actual time). ``eta_p50_beats_constant``: the ETA's median error is
    below the constant's (a constant estimate, however chosen, fails it)."""
    rows = [(p50, actual) for p50, _, actual in told if actual > 0]
    if not rows:
        return {"eta_p50_median_rel_error": None, "eta_p50_within_50pct_share": None,
                "eta_constant_median_rel_error": None, "eta_constant_within_50pct_share": None,
                "eta_p50_beats_constant": None}
    const = statistics.median(a for _, a in rows)

    def errors(est: Sequence[float]) -> list[float]:
        return [abs(a - e) / a for e, (_, a) in zip(est, rows, strict=True)]

    eta, flat = errors([p for p, _ in rows]), errors([const] * len(rows))
    return {"eta_p50_median_rel_error": statistics.median(eta),
            "eta_p50_within_50pct_share": sum(e <= REL_GOAL for e in eta) / len(eta),
            "eta_constant_median_rel_error": statistics.median(flat),
            "eta_constant_within_50pct_share": sum(e <= REL_GOAL for e in flat) / len(flat),
            "eta_p50_beats_constant": statistics.median(eta) < statistics.median(flat)}


def parse_pss_kb(smaps_rollup: str) -> int:
    """The ``Pss:`` line of a ``/proc/PID/smaps_rollup`` text, in kB."""
    for line in smaps_rollup.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    raise ValueError("no Pss: line in smaps_rollup")


def pss_kb(pid: int) -> int:
    """A running process's proportional set size (kB); 0 when it is gone or unreadable."""
    try:
        return parse_pss_kb(Path(f"/proc/{pid}/smaps_rollup").read_text())
    except (OSError, ValueError):
        return 0


def _git(*args: str) -> str | None:
    root = Path(__file__).resolve().parents[2]
    try:
        r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def cpu_model() -> str:
    """The host CPU's model name, from /proc/cpuinfo ("" where it says none)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    return next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "")


def provenance(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Where a figure came from: the commit and whether the tree was clean (tracked files unchanged), the
    host's CPU model and core count, the load average now, and the command line."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": _git("rev-parse", "HEAD"), "tree_clean": None if status is None else status == "",
            "cpu_model": cpu_model(), "host_cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
            "load_average": list(os.getloadavg()), "command": list(sys.argv if argv is None else argv)}


def one_thread_provenance() -> dict[str, Any]:
    """A benchmark on one torch thread: ``OMP_NUM_THREADS=1`` (unless set) before torch loads, torch's own
    budget 1; then its :func:`provenance`, taken before any model loads (the load average is the host's own)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    return provenance()


# -- the rows of a run, from its samples ---------------------------------------------------------------

def latency_figures(pairs: list[tuple[float, float]], isolated: float, hops: int) -> dict[str, Any]:
    """The latency fields from interleaved pairs: the staged and one-call medians, their ratio, the cost per
    hop from the pairs (:func:`engine.bench.figures.paired_hop`) and, beside it, the same against the
    isolated one-call median (``isolated``: calls in a row, nothing between them)."""
    staged, base = [s for s, _ in pairs], [b for _, b in pairs]
    med = statistics.median(staged)
    return {"staged_latency_p50_s": med, "staged_latency_p99_s": pct(staged, 0.99),
            "one_call_latency_p50_s": statistics.median(base), "one_call_isolated_p50_s": isolated,
            "staged_vs_one_call": med / statistics.median(base), **paired_hop(pairs, hops),
            "added_per_hop_vs_isolated_ms": (med - isolated) / hops * 1e3}


def open_loop_row(outcomes: list[tuple[str, float, float]], served: list[float], lag: list[float], start: float,
         seconds: float, deadline_s: float) -> dict[str, Any]:
    """An open-loop row's counts, goodput (:func:`engine.bench.figures.goodput`: over the busy period, and
    inside the send window) and latencies from its outcomes (state, scheduled send, end)."""
    completed = [end - at for st, at, end in outcomes if st == "completed"]
    in_deadline = [s for s in completed if s <= deadline_s]
    refused = [end - at for st, at, end in outcomes if st == "refused"]
    states: dict[str, int] = {}
    for st, _, _ in outcomes:
        states[st] = states.get(st, 0) + 1
    accepted = len(outcomes) - len(refused) - sum(n for st, n in states.items() if st.startswith("error"))
    return {
        "accepted": accepted,
        "completed": len(completed), "completed_in_deadline": len(in_deadline),
        "completed_late": len(completed) - len(in_deadline), "expired": states.get("expired", 0),
        "failed": states.get("failed", 0), "not_finished": states.get("timeout", 0),
        "refused": len(refused), "errors": {st: n for st, n in states.items() if st.startswith("error")},
        **goodput(outcomes, start, seconds, deadline_s),
        "latency_p50_s": pct(completed, 0.5), "latency_p99_s": pct(completed, 0.99),
        "reject_latency_p50_ms": (pct(refused, 0.5) or 0) * 1e3 if refused else None,
        "reject_latency_p99_ms": (pct(refused, 0.99) or 0) * 1e3 if refused else None,
        "reject_service_p99_ms": (pct(served, 0.99) or 0) * 1e3 if served else None,
        "client_send_lag_p99_ms": (pct(lag, 0.99) or 0) * 1e3,
    }


def eta_fields(told: list[tuple[float, float, float]], provisional: list[bool]) -> dict[str, Any]:
    """The ETA's calibration over completed jobs: the share within their p90 (goal 85-95%), the share told
    the estimate was still provisional, and the p50 judged by relative error against the best constant
    estimate (:func:`engine.bench.figures.eta_p50_error`; goal: at least 80% within 50%, and below the
    constant's error). ``eta_within_p50_share`` is the Proxy's own gate (engine.proxy.eta.calibration: within
    max(1 s, 50%)), kept for the gate's record; with jobs under a second any estimate meets it."""
    from engine.proxy import eta

    cal = eta.calibration(told)
    return {"eta_jobs": cal["jobs"], "eta_within_p50_share": cal["within_p50_share"] if told else None,
            "eta_p90_coverage": cal["p90_coverage"] if told else None,
            "eta_provisional_share": sum(provisional) / len(provisional) if provisional else None,
            **eta_p50_error(told)}


def priority_figure(rows: dict[str, dict[str, Any]], unloaded: list[float], rate: float,
                    high_share: float) -> dict[str, Any]:
    """``priority_2x``: the goal, high's p99 under a 2x overload at most 1.5x its unloaded p99
    (``unloaded``: the sequential staged latencies), every accepted low one completed."""
    high, low = rows["high"], rows["low"]
    un50, un99 = statistics.median(unloaded), pct(unloaded, 0.99)
    ratio = high["p99_s"] / un99 if high["p99_s"] is not None and un99 else None
    return {"rate_rps": rate, "high_share": high_share, "unloaded_p50_s": un50, "unloaded_p99_s": un99,
            **{f"high_{k}": v for k, v in high.items()}, **{f"low_{k}": v for k, v in low.items()},
            "high_p99_vs_unloaded_p99": ratio,
            "goal_met": ratio is not None and ratio <= 1.5 and low["completed"] == low["accepted"] > 0}
