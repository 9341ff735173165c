"""``onepiece up``'s supervisor: the restart policy (pure), and the watch over real child processes with the
clock passed in (no sleeps: each step is a tick at a chosen instant)."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest

from engine.embedded.supervisor import Child, RestartPolicy, Supervisor, describe_exit, read_status


def test_backoff_doubles_up_to_its_cap_and_a_long_run_forgives_earlier_failures() -> None:
    p = RestartPolicy(initial_s=1.0, factor=2.0, max_s=30.0, reset_after_s=60.0)
    assert [p.delay(n) for n in range(1, 8)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert p.delay(0) == 1.0  # never less than the first wait
    failures = 0
    for ran_s in (0.1, 3.0, 59.9):  # a crash loop: each exit counts
        failures = p.failures_after_exit(failures, ran_s)
    assert failures == 3 and p.delay(failures) == 4.0
    assert p.failures_after_exit(failures, 60.0) == 1  # it ran long enough: the next wait is the first again
    assert RestartPolicy(initial_s=0.5, factor=3.0, max_s=2.0).delay(3) == 2.0


def test_exit_descriptions_name_the_signal() -> None:
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(3) == "exited with 3"
    assert describe_exit(None) == "did not start"


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "600"])


@pytest.fixture
def sup(tmp_path: Path) -> Supervisor:
    (tmp_path / "logs").mkdir()
    said: list[str] = []
    s = Supervisor(tmp_path, said.append, RestartPolicy(initial_s=1.0, max_s=8.0, up_after_s=5.0))
    s.said = said  # type: ignore[attr-defined]
    return s


def _states(sup: Supervisor) -> dict[str, str]:
    got = read_status(sup.status_path)
    assert got is not None
    return {name: p["state"] for name, p in got.items()}


def test_a_killed_child_is_down_then_restarted_after_its_wait_then_up(sup: Supervisor) -> None:
    child = sup.watch(Child("reconciler", _sleeper, _sleeper(), sup.status_path.parent / "logs" / "r.log"))
    try:
        assert _states(sup) == {"reconciler": "up"}
        t = child.started_at + 100.0
        assert sup.tick(t) == []
        first = child.proc
        first.send_signal(signal.SIGKILL)
        first.wait()
        [line] = sup.tick(t)
        assert "reconciler: killed by SIGKILL; restarting in 1.0 s" in line and "r.log" in line
        assert _states(sup) == {"reconciler": "down"}
        assert read_status(sup.status_path)["reconciler"]["last_exit"] == -9  # type: ignore[index]
        assert sup.tick(t + 0.9) == []  # still waiting
        [line] = sup.tick(t + 1.0)
        assert line.startswith("reconciler: restarted (pid ") and child.proc is not first
        assert child.proc.poll() is None and child.restarts == 1
        assert _states(sup) == {"reconciler": "starting"}  # degraded until it has run up_after_s
        assert sup.tick(t + 5.9) == []
        assert sup.tick(t + 6.0) == ["reconciler: up again after restart 1"]
        assert _states(sup) == {"reconciler": "up"}
        # dying again at once (within reset_after_s) doubles the wait
        child.proc.send_signal(signal.SIGKILL)
        child.proc.wait()
        [line] = sup.tick(t + 7.0)
        assert "restarting in 2.0 s (failure 2 in a row" in line
        log = (sup.status_path.parent / "logs" / "supervisor.log").read_text()
        assert log.count("reconciler:") == 4 and len(sup.said) == 4  # type: ignore[attr-defined]
    finally:
        child.terminate()


def test_a_child_that_cannot_start_is_retried_on_the_schedule_and_never_given_up(sup: Supervisor) -> None:
    attempts: list[int] = []

    def broken() -> subprocess.Popen[bytes]:
        attempts.append(1)
        raise OSError("port in use")

    dead = subprocess.Popen(["true"])
    dead.wait()
    child = sup.watch(Child("proxy", broken, dead))
    t = child.started_at + 1.0
    [line] = sup.tick(t)
    assert "proxy: exited with 0; restarting in 1.0 s" in line
    [line] = sup.tick(t + 1.0)
    assert "could not be started again (OSError: port in use); restarting in 2.0 s" in line and attempts == [1]
    [line] = sup.tick(t + 3.0)
    assert "restarting in 4.0 s" in line and _states(sup) == {"proxy": "down"}
    for step in range(10):  # capped at max_s, tried for ever
        sup.tick(t + 100.0 * (step + 1))
    assert len(attempts) == 12 and "restarting in 8.0 s" in sup.said[-1]  # type: ignore[attr-defined]


def test_status_file_of_a_supervisor_that_is_gone_says_so(tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    path = tmp_path / "processes.json"
    path.write_text(json.dumps({"supervisor_pid": gone.pid, "updated": 1.0,
                                "processes": {"web": {"state": "up"}}}))
    assert read_status(path) == {"web": {"state": "up"}, "supervisor": {
        "state": "down", "pid": None, "restarts": 0, "last_exit": None, "since": 1.0}}
    assert read_status(tmp_path / "missing.json") is None
    path.write_text("{half")
    assert read_status(path) is None
