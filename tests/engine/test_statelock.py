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


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not yet reaped by its new parent
    except FileNotFoundError:
        return True


LAUNCHER = """
import sys, time
from engine.embedded import children
from engine.embedded.statelock import StateLock
lock = StateLock(sys.argv[1]).acquire()
children.hold_in_children(lock.fd)
plain = children.popen(["sleep", "120"])
stubborn = children.popen(["sh", "-c", "trap '' TERM; exec sleep 120"])  # ignores SIGTERM
print(plain.pid, stubborn.pid, flush=True)
time.sleep(120)
"""


def test_children_of_a_killed_launcher_get_sigterm_and_hold_the_folder_until_they_exit(tmp_path: Path) -> None:
    """``onepiece up`` killed with SIGKILL: what it started is sent SIGTERM by the kernel, and the next
    ``onepiece up`` is refused, naming the ones still running, instead of starting a second redis over
    the same data folder."""
    import signal
    import time

    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                                cwd=Path(__file__).resolve().parents[2])
    stubborn = 0
    try:
        assert launcher.stdout is not None
        plain, stubborn = (int(p) for p in launcher.stdout.readline().split())
        with pytest.raises(StateInUse, match=f"another onepiece up \\(pid {launcher.pid}\\)"):
            StateLock(tmp_path).acquire()
        launcher.kill()
        launcher.wait(10)
        deadline = time.monotonic() + 10
        while not _gone(plain):
            assert time.monotonic() < deadline, "a child outlived its killed launcher"
            time.sleep(0.05)
        assert not _gone(stubborn)
        # the folder stays locked by the child that ignored SIGTERM, and the refusal names it
        with pytest.raises(StateInUse) as exc:
            StateLock(tmp_path).acquire()
        message = str(exc.value)
        assert f"earlier onepiece up (pid {launcher.pid})" in message and f"{stubborn} (sleep 120)" in message
        assert f"kill {stubborn}" in message
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
        if launcher.stdout is not None:
            launcher.stdout.close()
        if stubborn:
            try:
                os.kill(stubborn, signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 10
    while not _gone(stubborn):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with StateLock(tmp_path):  # the last holder gone: free again
        pass


def test_children_start_in_their_own_session_reading_nothing_from_the_terminal() -> None:
    from engine.embedded import children

    child = children.popen([sys.executable, "-c", "import os, sys; print(os.getsid(0), len(sys.stdin.read()))"],
                           stdout=subprocess.PIPE)
    out, _ = child.communicate(timeout=30)
    sid, read = (int(x) for x in out.split())
    assert sid == child.pid and sid != os.getsid(0)  # Ctrl-C in the terminal reaches the parent alone
    assert read == 0 and child.returncode == 0  # stdin is /dev/null


GRANDPARENT = """
import sys
from engine.embedded import children
# a node starting a stage worker: the worker holds the lock its parent was handed
worker = children.popen(["sh", "-c", "trap '' TERM; exec sleep 120"])
print(worker.pid, flush=True)
"""


def test_the_launcher_releasing_leaves_the_folder_locked_while_children_and_theirs_run(tmp_path: Path) -> None:
    """The launcher's own release (its stop path, after a child outlived its terminate) does not free the
    folder under a child still running, nor under the processes that child started (a node's workers)."""
    import signal
    import time

    from engine.embedded import children

    lock = StateLock(tmp_path).acquire()
    children.hold_in_children(lock.fd)
    worker = 0
    try:
        node = children.popen([sys.executable, "-c", GRANDPARENT], stdout=subprocess.PIPE,
                              cwd=Path(__file__).resolve().parents[2])
        assert node.stdout is not None
        worker = int(node.stdout.readline())  # not communicate(): the worker holds the pipe open too
        node.wait(30)
        node.stdout.close()
    finally:
        children.hold_in_children(None)
        lock.release()
    try:
        assert node.returncode == 0 and not _gone(worker)  # the node exited; its worker ignored SIGTERM
        with pytest.raises(StateInUse) as exc:
            StateLock(tmp_path).acquire()
        assert f"{worker} (sleep 120)" in str(exc.value)
    finally:
        if worker:
            os.kill(worker, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not _gone(worker):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    with StateLock(tmp_path):
        pass
