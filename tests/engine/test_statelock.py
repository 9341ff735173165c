"""One onepiece up per state folder: the second is told plainly, and the lock goes with its holder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.embedded import ServiceError
from engine.embedded.statelock import StateInUse, StateLock


def test_a_second_holder_is_refused_with_the_first_ones_pid(tmp_path: Path) -> None:
    with StateLock(tmp_path):
        with pytest.raises(StateInUse, match=f"pid {os.getpid()}") as exc:
            StateLock(tmp_path).acquire()
        assert isinstance(exc.value, ServiceError) and str(tmp_path) in str(exc.value)
        assert "another onepiece up" in str(exc.value)
    with StateLock(tmp_path):  # released: free again
        pass


def test_the_lock_goes_with_a_killed_holder(tmp_path: Path) -> None:
    code = ("import sys, time; from engine.embedded.statelock import StateLock; StateLock(sys.argv[1]).acquire();"
            "print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(StateInUse, match=f"pid {holder.pid}"):
            StateLock(tmp_path).acquire()
    finally:
        holder.kill()
        holder.wait(10)
        if holder.stdout is not None:
            holder.stdout.close()
    with StateLock(tmp_path):
        pass


def test_onepiece_up_on_a_held_state_folder_says_so_and_starts_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    with StateLock(state):
        r = subprocess.run([sys.executable, "-m", "engine.cli", "up", "--state-dir", str(state), "--web-port", "0",
                            "--proxy-port", "0", "--exit-after-ready"], capture_output=True, text=True, timeout=120,
                           cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"another onepiece up (pid {os.getpid()})" in r.stdout, r.stdout
    assert not (state / "redis").exists() and not (state / "etcd").exists()  # refused before starting anything
