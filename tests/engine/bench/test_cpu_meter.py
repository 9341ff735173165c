"""The control plane's CPU meter (``engine.bench.cpu``) over real processes: a role's CPU is its process
tree's, stage workers below it are counted apart, and a window counts only what was spent inside it."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.bench.cpu import WORKER_MARK, ControlPlaneMeter, roles_from_state

# burns CPU until it has spent the seconds given (process time, not wall time), says "done", then waits
BURN = ("import sys, time\n"
        "end = time.process_time() + float(sys.argv[1])\n"
        "while time.process_time() < end: pass\n"
        "print('done', flush=True); sys.stdin.read()\n")
# a TaskManager stand-in: starts a stage worker (its command line carries the worker's module name and its
# instance, as the TaskManager's _spawn gives them) that
# burns 0.4 s, burns 0.1 s itself, and says "done" after the worker said it
NODE = ("import subprocess, sys, time\n"
        f"w = subprocess.Popen([sys.executable, '-c', {BURN!r}, '0.4', '{WORKER_MARK}', 'flux.1-dev.denoise.0'],"
        " stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)\n"
        "assert w.stdout.readline().strip() == 'done'\n"
        "end = time.process_time() + 0.1\n"
        "while time.process_time() < end: pass\n"
        "print('done', flush=True); sys.stdin.read(); w.stdin.close(); w.wait()\n")


def _start(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", code, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    for p in started:
        p.kill()
        p.wait()


# onepiece up's supervisor stand-in: everyone's parent. It starts the two roles' processes (held at a gate),
# says their pids, and on a line of its own input lets both go, waits for each to say "done" and says "done".
# A process of its own, so that its tree holds nothing but them (the test's process has the suite's children).
SUPERVISOR = ("import subprocess, sys\n"
              "gate = 'import sys; sys.stdin.readline()\\n'\n"
              "kids = [subprocess.Popen([sys.executable, '-c', gate + code, *args], stdin=subprocess.PIPE,"
              " stdout=subprocess.PIPE, text=True) for code, args in ((sys.argv[1], ['0.3']), (sys.argv[2], []))]\n"
              "print(*(k.pid for k in kids), flush=True)\n"
              "sys.stdin.readline()\n"
              "for k in kids: k.stdin.write('go\\n'); k.stdin.flush()\n"
              "for k in kids: assert k.stdout.readline().strip() == 'done'\n"
              "print('done', flush=True); sys.stdin.read()\n"
              "for k in kids: k.stdin.close(); k.wait()\n")


def test_roles_trees_and_workers_apart(procs: list[subprocess.Popen[str]]) -> None:
    # started idle: the window opens before any of the work
    supervisor = _start(SUPERVISOR, BURN, NODE)
    procs.append(supervisor)
    assert supervisor.stdout is not None and supervisor.stdin is not None
    proxy, node = (int(pid) for pid in supervisor.stdout.readline().split())
    # the supervisor is everyone's parent, yet each child is its own role's
    meter = ControlPlaneMeter({"supervisor": supervisor.pid, "proxy": proxy, "node": node})
    meter.begin()
    supervisor.stdin.write("go\n")
    supervisor.stdin.flush()
    assert supervisor.stdout.readline().strip() == "done"
    meter.end(completed=10, seconds=1.0)
    r = meter.report()
    b = r["control_plane_breakdown"]
    assert set(b) == {"supervisor", "proxy", "node"}
    # 0.3 s over 10 requests = 30 ms; interpreter start-up and the spawn add a little, never the worker's 40
    assert 29 <= b["proxy"] <= 36, r
    assert 9 <= b["node"] <= 25, r
    assert 39 <= r["stage_workers_cpu_ms_per_request"] <= 50, r
    # per stage, from the instance name on the worker's command line (a workflow name has dots of its own)
    assert r["stage_workers_breakdown"] == {"denoise": r["stage_workers_cpu_ms_per_request"]}, r
    assert r["control_plane_cpu_ms_per_request"] == pytest.approx(sum(b.values()), abs=0.01)


def test_work_before_the_window_is_not_counted(procs: list[subprocess.Popen[str]]) -> None:
    p = _start(BURN, "0.3")
    procs.append(p)
    assert p.stdout is not None and p.stdout.readline().strip() == "done"  # its CPU was spent before begin()
    meter = ControlPlaneMeter({"redis": p.pid})
    meter.begin()
    meter.end(completed=5, seconds=1.0)
    assert meter.report()["control_plane_breakdown"]["redis"] < 2.0


def test_roles_from_state(tmp_path: Path) -> None:
    assert roles_from_state(tmp_path) == {}
    (tmp_path / "processes.json").write_text(json.dumps({
        "supervisor_pid": 10, "processes": {"proxy": {"pid": 11}, "web": {"pid": None}, "redis": {"pid": 12}}}))
    assert roles_from_state(tmp_path) == {"proxy": 11, "redis": 12, "supervisor": 10}


def test_the_run_queue_meter_sees_a_process_wait_for_a_busy_core() -> None:
    """Two busy processes pinned to one core: each waits for the core while the other runs, so the meter
    reports waiting of the order of the running; without /proc figures for a pid it reports none."""
    import os
    import subprocess
    import sys
    import time

    from engine.bench.cpu import RunQueueMeter

    core = str(min(os.sched_getaffinity(0)))
    busy = [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"]
    procs = [subprocess.Popen(busy) for _ in range(2)]
    try:
        meter = RunQueueMeter(procs[0].pid)
        meter.begin()
        deadline = time.monotonic() + 30
        while True:  # until the process has both run and waited a measurable while
            fig = meter.end()
            if fig["proxy_cpu_ms_per_s"] * (time.monotonic() - meter._t0) > 300 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert fig["proxy_cpu_ms_per_s"] > 0 and fig["proxy_runqueue_wait_ms_per_s"] > 0.3 * fig["proxy_cpu_ms_per_s"], fig
    assert RunQueueMeter(None).end() == {"proxy_cpu_ms_per_s": None, "proxy_runqueue_wait_ms_per_s": None}
