"""The traffic view's figures: requests per second accepted and rejected (by reason), latency p50/p99.

Computed from what the platform records, never sampled from the engine:
accepted jobs are ledger rows that got a UID (``created_at``), latency is
``finished_at - created_at`` of the jobs that completed (what a client waited,
queueing included), and rejections are :class:`Rejection` rows (the engine's
503, an unreachable engine, a user's quota). Everything is bucketed over a
window of recent minutes; one query per source, bounded by the window.
"""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

from engine.workflow import workflows
from onepiece_platform.engine_link.models import Rejection
from onepiece_platform.jobs.models import COMPLETED, Job

MAX_MINUTES = 60
MAX_BUCKETS = 240


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100) of ``values``; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def traffic(now: dt.datetime, minutes: int = 10, step_s: int = 10) -> dict[str, Any]:
    """Per workflow, one value per bucket of ``step_s`` seconds over the last ``minutes``.

    Returns {"start", "end" (unix s), "step_s", "buckets", "reasons": [...], "workflows": {name:
    {"accepted_rps", "completed_rps": [...], "rejected_rps": {reason: [...]}, "latency_p50_s",
    "latency_p99_s": [... or None], "totals": {"accepted", "completed", "rejected"}}}}.
    """
    minutes = max(1, min(MAX_MINUTES, int(minutes)))
    n = min(MAX_BUCKETS, max(1, math.ceil(minutes * 60 / max(1, int(step_s)))))
    step = minutes * 60 / n
    start = now - dt.timedelta(minutes=minutes)

    def bucket(t: dt.datetime) -> int | None:
        i = int((t - start).total_seconds() // step)
        return i if 0 <= i < n else None

    names = sorted(workflows())
    out: dict[str, dict[str, Any]] = {}

    def wf(name: str) -> dict[str, Any]:
        if name not in out:
            out[name] = {"accepted": [0] * n, "completed": [0] * n, "rejected": {}, "latency": [[] for _ in range(n)]}
        return out[name]

    for name in names:
        wf(name)
    for name, created in Job.objects.filter(uid__isnull=False, created_at__gte=start).values_list(
            "workflow", "created_at"):
        if (i := bucket(created)) is not None:
            wf(name)["accepted"][i] += 1
    for name, created, finished in Job.objects.filter(state=COMPLETED, finished_at__gte=start).values_list(
            "workflow", "created_at", "finished_at"):
        if (i := bucket(finished)) is not None:
            w = wf(name)
            w["completed"][i] += 1
            w["latency"][i].append(max(0.0, (finished - created).total_seconds()))
    reasons: set[str] = set()
    for name, reason, created in Rejection.objects.filter(created_at__gte=start).values_list(
            "workflow", "reason", "created_at"):
        if (i := bucket(created)) is not None:
            reasons.add(reason)
            wf(name)["rejected"].setdefault(reason, [0] * n)[i] += 1

    def rate(counts: list[int]) -> list[float]:
        return [round(c / step, 6) for c in counts]

    result = {}
    for name, w in sorted(out.items()):
        result[name] = {
            "accepted_rps": rate(w["accepted"]),
            "completed_rps": rate(w["completed"]),
            "rejected_rps": {r: rate(c) for r, c in sorted(w["rejected"].items())},
            "latency_p50_s": [percentile(v, 50) for v in w["latency"]],
            "latency_p99_s": [percentile(v, 99) for v in w["latency"]],
            "totals": {"accepted": sum(w["accepted"]), "completed": sum(w["completed"]),
                       "rejected": sum(sum(c) for c in w["rejected"].values())},
        }
    return {"start": start.timestamp(), "end": now.timestamp(), "step_s": step, "buckets": n,
            "reasons": sorted(reasons | {Rejection.ENGINE_BUSY, Rejection.ENGINE_UNREACHABLE, Rejection.QUOTA}),
            "workflows": result}
