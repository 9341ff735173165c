"""Priorities and the ETA on the live engine, through the Proxy's public API: under overload, high
requests are admitted where low ones are refused, finish ahead of the low ones queued before them, every
admitted low one still completes, and unfinished jobs report their ETA and place in line."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tests.fixtures.runtime import Cluster

SD = dict(prompt="a cat on the moon", height=64, width=64, num_inference_steps=4, seed=7)
LOWS = 48  # more than the low share of the Proxy's queue budget (half of its 64) at once
HIGHS = 4


def _submit(one_node: Cluster, priority: str) -> tuple[int, dict[str, Any], float]:
    status, doc, _ = one_node.call("POST", "/v1/requests?workflow=sd-t2i",
                                  {"workflow": "sd-t2i", "params": SD, "priority": priority})
    return status, doc, time.monotonic()


def _ended_at(one_node: Cluster, uid: str) -> tuple[str, float]:
    """(terminal state, its event's time) once the job ends."""
    done = one_node.wait(uid, {"completed", "failed", "cancelled", "expired"}, timeout=240)
    ends = [e for e in one_node.events(uid) if e.get("type") == done["state"]]
    return done["state"], float(ends[-1]["ts"])


def test_under_overload_high_is_admitted_and_served_ahead_of_low_and_low_still_completes(one_node: Cluster) -> None:
    with ThreadPoolExecutor(16) as pool:
        lows = list(pool.map(lambda _: _submit(one_node, "low"), range(LOWS)))
    admitted_low = [doc["uid"] for status, doc, _ in lows if status == 202]
    refused_low = [doc for status, doc, _ in lows if status == 503]
    assert refused_low, "no low request was refused: the overload did not reach the low share"
    assert all("low priority" in d["error"] for d in refused_low), refused_low[:2]
    assert len(admitted_low) <= 32 + 2, len(admitted_low)  # the low share, give or take those already done

    # a low job at the back of the line and a high one: both report an ETA; the high one has fewer ahead
    _, back_low, _ = one_node.call("GET", f"/v1/requests/{admitted_low[-1]}")
    highs = [_submit(one_node, "high") for _ in range(HIGHS)]
    assert all(status == 202 for status, _, _ in highs), [d for s, d, _ in highs if s != 202]
    status, first_high, headers = one_node.call("GET", f"/v1/requests/{highs[0][1]['uid']}")
    assert status == 200 and first_high["state"] in ("queued", "in_progress")
    for doc in (back_low, first_high):
        assert doc["eta_s"] > 0 and doc["eta_p90_s"] >= doc["eta_s"] and isinstance(doc["provisional"], bool)
    assert headers["OnePiece-ETA"].startswith("p50=")
    assert first_high["queue_ahead"] < back_low["queue_ahead"], (first_high, back_low)

    with ThreadPoolExecutor(16) as pool:
        low_ends = list(pool.map(lambda u: _ended_at(one_node, u), admitted_low))
        high_ends = list(pool.map(lambda h: _ended_at(one_node, h[1]["uid"]), highs))
    # none starves: every admitted low request completes
    assert all(state == "completed" for state, _ in low_ends), low_ends
    assert all(state == "completed" for state, _ in high_ends), high_ends
    # served ahead: the high ones, submitted after every low one, finish before most of them
    last_high = max(t for _, t in high_ends)
    after = sum(1 for _, t in low_ends if t > last_high)
    assert after >= len(admitted_low) // 2, (after, len(admitted_low))


def test_a_cancelled_job_no_longer_counts_ahead_of_the_jobs_behind_it(one_node: Cluster) -> None:
    """The stage holding a cancelled job drops it only when it reaches it; the ETA's line drops it at the
    cancel, so the jobs behind it are told they wait for fewer."""
    slow = dict(SD, num_inference_steps=20)
    with ThreadPoolExecutor(8) as pool:
        docs = list(pool.map(lambda _: one_node.call("POST", "/v1/requests?workflow=sd-t2i",
                                                    {"workflow": "sd-t2i", "params": slow})[1], range(16)))
    uids = [d["uid"] for d in docs]
    _, back, _ = one_node.call("GET", f"/v1/requests/{uids[-1]}")
    before = back["queue_ahead"]
    cancelled = uids[-9:-1]  # the eight just ahead of the last one: still queued behind the others
    for uid in cancelled:
        status, _, _ = one_node.call("DELETE", f"/v1/requests/{uid}")
        assert status in (202, 409)
    _, back, _ = one_node.call("GET", f"/v1/requests/{uids[-1]}")
    # ahead of it now: at most the uncancelled jobs submitted before it (without the fix, the cancelled
    # ones still queued counted too)
    assert back["queue_ahead"] <= len(uids) - 1 - len(cancelled), (before, back)
    for uid in uids:
        one_node.wait(uid, {"completed", "failed", "cancelled", "expired"}, timeout=240)
