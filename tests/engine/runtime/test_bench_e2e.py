"""``onepiece bench e2e`` against the session's engine: every figure the issue names is produced, and the
open loop accounts for every request it offered (nothing sent is missing from a row). It lives beside the
other runtime tests so that the session engine starts when they start (earlier proxy tests flush the
session's Redis between tests)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from engine.bench import e2e, e2e_report


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_e2e_reports_every_figure(one_node: Any, tiny_models: dict[str, Path], redis_server: Any,
                                        etcd_server: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Through ``onepiece bench e2e --json`` as a user runs it (its flags; the processes named in a state
    folder's processes.json, as ``onepiece up`` writes it), on small windows."""
    import json

    from engine.embedded.supervisor import STATUS_FILE

    processes = {"proxy": one_node.proxy_proc.pid, "node": one_node.node.pid, "redis": redis_server.proc.pid,
                 "etcd": etcd_server.proc.pid}
    (tmp_path / STATUS_FILE).write_text(json.dumps({"processes": {k: {"pid": v} for k, v in processes.items()}}))
    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)
    args = parser.parse_args(["--proxy", one_node.proxy, "--model-dir", str(tiny_models["sd-t2i"]), "--state",
                              str(tmp_path), "--requests", "3", "--seconds", "1.5", "--deadline-s", "10", "--hog", "1",
                              "--saturate", "6", "--loads", "1,10", "--batches", "2", "--no-single-stage",
                              "--no-mixed", "--no-stream", "--json"])
    capsys.readouterr()
    assert e2e.main(args) == 0
    r = json.loads(capsys.readouterr().out)
    # where the figures came from: the tree, the host and its load, the command
    prov = r["provenance"]
    for name in ("commit", "tree_clean", "cpu_model", "host_cores", "usable_cores", "load_average_before",
                 "load_average_after", "command"):
        assert prov.get(name) is not None, (name, prov)
    assert len(prov["commit"]) == 40 and len(prov["load_average_before"]) == len(prov["load_average_after"]) == 3
    # the control plane's CPU per completed request while saturated, per process, the workers apart
    assert set(r["control_plane_breakdown"]) == set(processes), r["control_plane_breakdown"]
    assert r["control_plane_breakdown"]["proxy"] > 0 and r["stage_workers_cpu_ms_per_request"] > 0
    assert r["control_plane_cpu_ms_per_request"] == pytest.approx(sum(r["control_plane_breakdown"].values()))
    for name in ("staged_latency_p50_s", "staged_latency_p50_quiet_s", "hog_vs_quiet_p50", "one_call_latency_p50_s",
                 "one_call_latency_p50_s_quiet", "one_call_hog_vs_quiet_p50", "one_call_isolated_p50_s",
                 "added_per_hop_ms", "added_per_hop_p10_ms", "added_per_hop_p90_ms", "added_per_hop_vs_isolated_ms",
                 "capacity_rps", "monolith_capacity_rps", "staged_vs_monolith_capacity",
                 "batched_monolith_capacity_rps", "staged_vs_batched_monolith_capacity"):
        assert isinstance(r[name], float), (name, r.get(name))
    # per hop from pairs: every completed staged request has its one-call neighbour; the spread brackets it
    assert r["pairs"] == 3 and r["added_per_hop_p10_ms"] <= r["added_per_hop_ms"] <= r["added_per_hop_p90_ms"]
    # capacity is the last window (the configuration the Node Manager settled on), not the best of several
    assert r["capacity_rps"] == r["capacity_windows_rps"][-1]
    assert r["capacity_rps"] > 0 and r["monolith_capacity_rps"] > 0 and r["hog"] == 1
    assert set(r["one_call_p50_by_threads"]) == {str(t) for t in range(1, r["cores"] + 1)}
    assert len(r["capacity_windows_rps"]) >= 2
    # the one-call pipeline batched: a prompt and a generator per request, in one call
    assert r["batched_monolith_batch"] == 2 and set(r["batched_monolith_rps_by_batch"]) == {"2"}
    for row in r["open_loop"]:
        for name in ("offered", "accepted", "completed_in_deadline", "completed_late", "expired", "refused",
                     "reject_latency_p99_ms", "goodput_busy_x_capacity", "goodput_in_window_x_capacity"):
            assert name in row, (name, row)
        # goodput over the busy period, which lasts at least the send window; inside the window, no more
        assert row["busy_period_s"] >= 1.5 and row["goodput_busy_rps"] == row["completed_in_deadline"] / row["busy_period_s"]
        assert row["completed_in_deadline_in_window"] <= row["completed_in_deadline"]
        assert row["offered"] > 0 and row["errors"] == {} and row["not_finished"] == 0, row
        # the Proxy's scheduling delay over the row (its threads runnable, waiting for a CPU): the hog makes some
        assert row["proxy_cpu_ms_per_s"] > 0 and row["proxy_runqueue_wait_ms_per_s"] >= 0, row
        # every request sent is in exactly one column: refused, or accepted and then ended one way
        assert row["offered"] == row["accepted"] + row["refused"], row
        assert row["accepted"] == row["completed"] + row["expired"] + row["failed"], row
        assert row["completed"] == row["completed_in_deadline"] + row["completed_late"], row
    # issue 28: the ETA's calibration per load (each completed job was told a p50 and a p90 at submit) and
    # the priority figure at 2x, where every request is accounted for and no accepted low one is lost
    cal = r["eta_calibration"]["1.0x"]
    one_x = next(row for row in r["open_loop"] if row["load_x_capacity"] == 1.0)
    assert cal["eta_jobs"] == one_x["completed"] > 0, (cal, one_x)
    assert 0 <= cal["eta_within_p50_share"] <= 1 and 0 <= cal["eta_p90_coverage"] <= 1, cal
    assert 0 <= cal["eta_p50_within_50pct_share"] <= 1 and isinstance(cal["eta_p50_beats_constant"], bool), cal
    assert cal["eta_p50_median_rel_error"] >= 0 and cal["eta_constant_median_rel_error"] >= 0, cal
    pr = r["priority_2x"]
    assert pr["high_offered"] + pr["low_offered"] > 0 and pr["rate_rps"] == pytest.approx(2 * r["capacity_rps"])
    for level in ("high", "low"):
        assert pr[f"{level}_offered"] == pr[f"{level}_accepted"] + pr[f"{level}_refused"], pr
        assert pr[f"{level}_completed"] == pr[f"{level}_accepted"] and pr[f"{level}_not_finished"] == 0, pr
    assert pr["unloaded_p99_s"] >= pr["unloaded_p50_s"] > 0 and isinstance(pr["goal_met"], bool), pr


@pytest.mark.timeout(300)
def test_bench_e2e_measures_another_workflow_with_its_image(one_node: Any, tiny_models: dict[str, Path],
                                                           tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--workflow wan2.1-i2v`` (issue 37, item 6): the run's record says what it measured (workflow, quality
    level, the resolved request, its input file), and both sides ran it: every staged request carried the png
    (one without it would be refused, and the latency pairs would be empty), the one-call baselines, batched
    too, were given it as ``image=``."""
    import json

    wf = "wan2.1-i2v"
    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)
    args = parser.parse_args(["--proxy", one_node.proxy, "--model-dir", str(tiny_models[wf]), "--workflow", wf,
                              "--state", str(tmp_path), "--requests", "2", "--seconds", "1", "--saturate", "3",
                              "--loads", "1", "--batches", "2", "--no-single-stage", "--no-mixed", "--no-stream",
                              "--json"])
    capsys.readouterr()
    assert e2e.main(args) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["workflow"] == wf and r["quality"] == "lossless"
    params, _ = e2e.request(wf, tiny_models[wf])
    assert r["params"] == params and {k: params[k] for k in e2e.PARAMS[wf]} == e2e.PARAMS[wf]
    assert r["inputs"] == {"image": "blank png 32x32"}
    assert r["stage_hops"] == 5 and r["pairs"] == 2  # every sequential staged request completed
    assert r["capacity_rps"] > 0 and r["monolith_capacity_rps"] > 0 and r["batched_monolith_capacity_rps"] > 0
    (row,) = r["open_loop"]
    assert row["offered"] == row["accepted"] + row["refused"] and row["errors"] == {} and row["failed"] == 0, row
    assert r["priority_2x"]["high_completed"] + r["priority_2x"]["low_completed"] > 0
    e2e_report.print_text(r)  # the text names the level and the request
    assert capsys.readouterr().out.splitlines()[1] == (f"{wf} at quality lossless: 32x32, 5 frames, 2 steps, seed 1, "
                                                       "image: blank png 32x32 (both sides)")


def test_bench_e2e_refuses_a_workflow_the_engine_does_not_serve(one_node: Any, tiny_models: dict[str, Path],
                                                               tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The session's engine serves sd-t2i and the Wan2.1 pair: --workflow flux.1-schnell (a valid request for
    its folder) ends at once with exit 2 and how to serve it, rather than after the baselines' minutes."""
    parser = argparse.ArgumentParser()
    e2e.add_arguments(parser)
    args = parser.parse_args(["--proxy", one_node.proxy, "--model-dir", str(tiny_models["flux.1-schnell"]),
                              "--workflow", "flux.1-schnell", "--state", str(tmp_path), "--json"])
    capsys.readouterr()
    assert e2e.main(args) == 2
    out = capsys.readouterr()
    assert f"error: the engine behind {one_node.proxy} does not serve flux.1-schnell (onepiece up --workflows " \
           "flux.1-schnell)" in out.err and out.out == ""
