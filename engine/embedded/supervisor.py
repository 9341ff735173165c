"""``onepiece up``'s watch over its children: every one that exits is restarted, with backoff, and said so.

Three parts, so the decision can be tested without processes:

- :class:`RestartPolicy`: pure. How long to wait before the next start after an exit (doubling from
  ``initial_s`` up to ``max_s``), and when a child has run long enough for its earlier failures to be
  forgiven (``reset_after_s``) or to count as up again after a restart (``up_after_s``);
- :class:`Child`: one supervised process and its state: ``up``, ``down`` (exited; restarted at
  ``restart_at``) or ``starting`` (restarted, not yet ``up_after_s`` old: a child that dies at once again
  never shows as up). A child that cannot even be started (a port taken, a binary gone) stays ``down``
  and is tried again on the same schedule; nothing is ever given up on, and nothing is dropped silently;
- :class:`Supervisor`: checks its children (:meth:`Supervisor.tick`), prints every exit, restart and
  recovery through ``say`` (``onepiece up``'s output) and into ``<state>/logs/supervisor.log``, and
  writes the children's states to a status file (:data:`STATUS_FILE` in the state folder, replaced
  atomically) that the web platform's ``/readyz`` and the dashboard read (:func:`read_status`), so an
  operator sees *degraded* while a child is down or starting.

The loop runs on the launcher's main thread: a child's parent-death signal goes when the *thread* that
started it ends (:mod:`engine.embedded.children`), so restarts must come from the thread that lives as
long as the launcher.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STATUS_FILE = "processes.json"
UP, DOWN, STARTING = "up", "down", "starting"


@dataclass(frozen=True)
class RestartPolicy:
    initial_s: float = 1.0
    factor: float = 2.0
    max_s: float = 30.0
    up_after_s: float = 5.0  # a restarted child counts as up once it has run this long
    reset_after_s: float = 60.0  # ... and its earlier failures are forgotten once it has run this long

    def delay(self, failures: int) -> float:
        """Seconds to wait before starting again a child that failed ``failures`` times in a row (>= 1)."""
        return min(self.max_s, self.initial_s * self.factor ** max(0, failures - 1))

    def failures_after_exit(self, failures: int, ran_s: float) -> int:
        """The count of failures in a row once a child that ran ``ran_s`` seconds exited."""
        return 1 if ran_s >= self.reset_after_s else failures + 1


def describe_exit(code: int | None) -> str:
    if code is None:
        return "did not start"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with {code}"


@dataclass
class Child:
    """One supervised process: ``start()`` starts it (again) and returns it."""

    name: str
    start: Callable[[], subprocess.Popen[bytes]]
    proc: subprocess.Popen[bytes]  # the latest started (a dead one while down)
    log: Path | None = None
    stop_timeout: float = 10.0
    state: str = UP
    failures: int = 0
    restarts: int = 0
    last_exit: int | None = None
    started_at: float = field(default_factory=time.monotonic)
    restart_at: float = 0.0
    since: float = field(default_factory=time.time)  # wall clock of the last change of state

    def check(self, policy: RestartPolicy, now: float) -> str | None:
        """Move the child along; returns what to tell the operator when something happened."""
        if self.state in (UP, STARTING) and self.proc.poll() is not None:
            self.last_exit = self.proc.returncode
            self.failures = policy.failures_after_exit(self.failures, now - self.started_at)
            return self._down(policy, now, describe_exit(self.last_exit))
        if self.state == DOWN and now >= self.restart_at:
            try:
                self.proc = self.start()
            except Exception as exc:  # any failure to start is reported and retried on the schedule
                self.failures += 1
                return self._down(policy, now, f"could not be started again ({type(exc).__name__}: {exc})")
            self.started_at, self.state, self.since = now, STARTING, time.time()
            self.restarts += 1
            return f"{self.name}: restarted (pid {self.proc.pid}, restart {self.restarts})"
        if self.state == STARTING and now - self.started_at >= policy.up_after_s:
            self.state, self.since = UP, time.time()
            return f"{self.name}: up again after restart {self.restarts}"
        return None

    def _down(self, policy: RestartPolicy, now: float, why: str) -> str:
        wait = policy.delay(self.failures)
        self.state, self.restart_at, self.since = DOWN, now + wait, time.time()
        where = f"; log: {self.log}" if self.log else ""
        return f"{self.name}: {why}; restarting in {wait:.1f} s (failure {self.failures} in a row{where})"

    def status(self) -> dict[str, Any]:
        pid = self.proc.pid if self.state != DOWN else None
        return {"state": self.state, "pid": pid, "restarts": self.restarts, "last_exit": self.last_exit,
                "since": round(self.since, 3)}

    def terminate(self) -> None:
        """Stop it (SIGTERM, then SIGKILL to its session after ``stop_timeout``); stopped ones are left be."""
        proc = self.proc
        if proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(self.stop_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(self.stop_timeout)


class Supervisor:
    def __init__(self, state_dir: Path, say: Callable[[str], None], policy: RestartPolicy | None = None) -> None:
        self.policy = policy or RestartPolicy()
        self.status_path = state_dir / STATUS_FILE
        self.log_path = state_dir / "logs" / "supervisor.log"
        self.say = say
        self.children: dict[str, Child] = {}

    def watch(self, child: Child) -> Child:
        """Supervise ``child`` (already started and ready) from now on."""
        self.children[child.name] = child
        self.write_status()
        return child

    def tick(self, now: float | None = None) -> list[str]:
        """Check every child once; returns (and reports) what happened."""
        now = time.monotonic() if now is None else now
        said = [line for c in list(self.children.values()) if (line := c.check(self.policy, now))]
        for line in said:
            self.report(line)
        if said:
            self.write_status()
        return said

    def run(self, stop: Callable[[], bool], interval_s: float = 0.2) -> None:
        """Tick until ``stop()`` says so (the launcher's signal handler sets it)."""
        while not stop():
            self.tick()
            time.sleep(interval_s)

    def report(self, line: str) -> None:
        self.say(line)
        try:
            with open(self.log_path, "a") as f:
                f.write(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {line}\n")
        except OSError:  # the operator was told on the terminal; a full disk must not stop the supervision
            pass

    def write_status(self) -> None:
        doc = {"supervisor_pid": os.getpid(), "updated": round(time.time(), 3),
               "processes": {name: c.status() for name, c in self.children.items()}}
        tmp = self.status_path.with_name(self.status_path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(doc))
            os.replace(tmp, self.status_path)  # readers never see half a file
        except OSError as exc:
            self.say(f"supervisor: could not write {self.status_path}: {exc}")

    def forget_status(self) -> None:
        """Remove the status file (on the way out: nothing supervises any more)."""
        try:
            self.status_path.unlink()
        except FileNotFoundError:
            pass


def read_status(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]] | None:
    """The supervised processes' states from a status file (name -> state, pid, restarts, last exit,
    since), or None when there is none or it is unreadable. A file whose supervisor is gone (``onepiece
    up`` killed with SIGKILL leaves it) says so as a process of its own, ``supervisor``, down."""
    try:
        doc = json.loads(Path(path).read_text())
        processes = dict(doc["processes"])
        pid = int(doc["supervisor_pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        processes["supervisor"] = {"state": DOWN, "pid": None, "restarts": 0, "last_exit": None,
                                   "since": doc.get("updated")}
    except PermissionError:  # alive, another user's
        pass
    return processes
