"""The figures of ``onepiece bench e2e`` on synthetic samples (issue 35 item 2): goodput over the busy period,
the cost per hop from paired samples, the ETA's p50 by relative error, proportional memory, and the
provenance every JSON carries. Each test states the old formula's answer, which it would have accepted."""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import textwrap

import pytest

from engine.bench import figures
from engine.bench.cpu import tree_peak_rss_mb, tree_pss_mb


def test_goodput_counts_the_backlog_over_the_busy_period_not_the_send_window() -> None:
    """10 s of sending; 10 requests end inside the window, 10 more (the backlog) drain in the 10 s after,
    all within their 30 s deadline. The old figure, 20 / 10 s = 2.0 rps, claimed twice what the engine
    served; over the busy period (20 s) it is 1.0, and inside the window 10 / 10 s."""
    start, seconds = 100.0, 10.0
    ends = [("completed", start + i, start + i + 0.5) for i in range(10)]
    ends += [("completed", start + i + 0.2, start + seconds + i + 1.0) for i in range(10)]  # last ends at +20 s
    ends += [("refused", start + 3, start + 3.01), ("expired", start + 4, start + 15.0)]
    g = figures.goodput(ends, start, seconds, deadline_s=30.0)
    old = sum(1 for st, at, end in ends if st == "completed" and end - at <= 30.0) / seconds
    assert old == 2.0
    assert g["busy_period_s"] == pytest.approx(20.0)
    assert g["goodput_busy_rps"] == pytest.approx(1.0)
    assert g["goodput_in_window_rps"] == pytest.approx(1.0) and g["completed_in_deadline_in_window"] == 10


def test_goodput_leaves_out_completions_past_their_deadline() -> None:
    start = 0.0
    ends = [("completed", 0.0, 2.0), ("completed", 1.0, 9.0), ("completed", 2.0, 3.0)]  # the second took 8 s
    g = figures.goodput(ends, start, 5.0, deadline_s=5.0)
    assert g["busy_period_s"] == 9.0 and g["goodput_busy_rps"] == pytest.approx(2 / 9)
    # nothing ended after the window: the busy period is the window itself
    assert figures.goodput([("completed", 0.0, 1.0)], 0.0, 5.0, 5.0)["busy_period_s"] == 5.0


def test_the_cost_per_hop_is_the_median_of_paired_differences() -> None:
    """The one-call run beside the third staged request was fast (the host was quiet then): paired, every
    staged request cost 50 ms more than its neighbour; the old difference of the two medians gave 1,050 ms."""
    pairs = [(1.0, 0.95), (2.0, 1.95), (2.1, 0.5)]
    hops = 1
    old = (statistics.median(s for s, _ in pairs) - statistics.median(b for _, b in pairs)) / hops * 1e3
    got = figures.paired_hop(pairs, hops)
    assert old == pytest.approx(1050.0)
    assert got["added_per_hop_ms"] == pytest.approx(50.0) and got["pairs"] == 3
    assert got["added_per_hop_p10_ms"] == pytest.approx(50.0) and got["added_per_hop_p90_ms"] == pytest.approx(1600.0)
    assert figures.paired_hop([(0.5, 0.2)], 3)["added_per_hop_ms"] == pytest.approx(100.0)
    assert figures.paired_hop([], 3)["added_per_hop_ms"] is None


def test_a_constant_eta_fails_the_relative_check_that_the_old_one_passed() -> None:
    """Jobs of 0.2-0.9 s told 0 s: the old check (within max(1 s, 50%) of the p50) passed every one of
    them; by relative error none is within 50%, and neither the constant 0 nor the best constant in
    hindsight (the median actual time) beats the best constant."""
    from engine.proxy import eta

    actual = [0.2, 0.3, 0.5, 0.6, 0.9]
    zero = [(0.0, 0.0, a) for a in actual]
    assert eta.calibration(zero)["within_p50_share"] == 1.0  # the old check
    e = figures.eta_p50_error(zero)
    assert e["eta_p50_within_50pct_share"] == 0.0 and e["eta_p50_median_rel_error"] == 1.0
    assert e["eta_p50_beats_constant"] is False
    median = figures.eta_p50_error([(0.5, 0.0, a) for a in actual])
    assert median["eta_p50_beats_constant"] is False  # the best constant does not beat itself
    assert median["eta_constant_median_rel_error"] == median["eta_p50_median_rel_error"]
    good = figures.eta_p50_error([(a * 1.1, 0.0, a) for a in actual])
    assert good["eta_p50_within_50pct_share"] == 1.0 and good["eta_p50_beats_constant"] is True
    assert good["eta_p50_median_rel_error"] == pytest.approx(0.1)


def test_pss_is_read_from_smaps_rollup() -> None:
    text = textwrap.dedent("""\
        55d6c5a2a000-7ffd2b3f2000 ---p 00000000 00:00 0                          [rollup]
        Rss:              102400 kB
        Pss:               51234 kB
        Pss_Anon:          10000 kB
        Shared_Clean:      80000 kB
        """)
    assert figures.parse_pss_kb(text) == 51234  # the Pss line, not Pss_Anon nor Rss
    with pytest.raises(ValueError):
        figures.parse_pss_kb("Rss: 1 kB\n")


_SHARER = """
import mmap, os, sys
size = 96 << 20
m = mmap.mmap(-1, size)  # anonymous and shared: a forked child maps the same pages
m.write(b"x" * size)
pid = os.fork()
if pid == 0:
    assert sum(m[i] for i in range(0, size, 4096)) == ord("x") * (size // 4096)  # touch every page
    print("child ready", flush=True)
    sys.stdin.read()
    os._exit(0)
print(pid, flush=True)
sys.stdin.read()
os.waitpid(pid, 0)
"""


def test_proportional_memory_counts_a_shared_mapping_once() -> None:
    """Two processes map the same 96 MiB: summed peak RSS (the old figure) counts it twice, PSS once."""
    p = subprocess.Popen([sys.executable, "-c", _SHARER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        lines = {p.stdout.readline().strip(), p.stdout.readline().strip()}
        assert "child ready" in lines and any(re.fullmatch(r"\d+", x) for x in lines), lines
        roles = {"sharer": p.pid}
        rss, pss = sum(tree_peak_rss_mb(roles).values()), sum(tree_pss_mb(roles).values())
    finally:
        assert p.stdin is not None
        p.stdin.close()
        p.wait(30)
    assert rss >= 2 * 96  # each process's RSS holds the whole mapping
    assert 96 <= pss < rss - 80  # proportional: the mapping once, each process's own pages beside it


def test_provenance_says_which_tree_cpu_and_load() -> None:
    p = figures.provenance(["onepiece", "bench", "e2e", "--json"])
    assert re.fullmatch(r"[0-9a-f]{40}", p["commit"] or ""), p
    assert isinstance(p["tree_clean"], bool) and p["cpu_model"] and p["host_cores"] >= p["usable_cores"] >= 1
    assert len(p["load_average"]) == 3 and p["command"] == ["onepiece", "bench", "e2e", "--json"]


def test_the_monolith_encodes_what_the_staged_side_hands_the_client() -> None:
    """The one-call baselines' outputs go through the same encoders as the staged last stages: a png per
    image, with the levels diffusers' own conversion gives, and an mp4 per video."""
    import io
    from types import SimpleNamespace

    import numpy as np
    from PIL import Image

    from engine.bench.harness import encode_outputs

    images = np.random.RandomState(0).rand(2, 8, 12, 3).astype(np.float32)
    pngs = encode_outputs(SimpleNamespace(images=images, frames=None))
    assert len(pngs) == 2
    for png, img in zip(pngs, images, strict=True):
        got = np.asarray(Image.open(io.BytesIO(png)))
        assert got.shape == (8, 12, 3) and np.array_equal(got, (img * 255).round().astype(np.uint8))
    frames = np.random.RandomState(1).rand(1, 5, 16, 16, 3).astype(np.float32)
    (mp4,) = encode_outputs(SimpleNamespace(frames=frames))
    assert mp4[4:8] == b"ftyp" and len(mp4) > 100
