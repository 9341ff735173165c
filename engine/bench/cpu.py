"""The control plane's CPU per completed request, read from /proc (through psutil) over a window.

Every process of a deployment that is not a stage worker is control plane: the Proxy, the reconciler,
the web process, the webhook deliverer, Redis, etcd, the Node Manager, the TaskManager (``onepiece
node`` itself) and ``onepiece up``'s supervisor. Each is named by a role and a pid; its descendants are
counted with it (uvicorn's or Redis's forks), except stage workers (``engine.worker.proc``), which are
the work and are summed apart. A process that starts inside the window counts from zero; one that ends
inside it is missing from the figure (its CPU cannot be read after it is reaped), and said so.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

WORKER_MARK = "engine.worker.proc"  # a stage worker's command line (the TaskManager's _spawn)
WORKERS = "stage_workers"


def _cpu(p: Any) -> float:
    t = p.cpu_times()
    return float(t.user + t.system)


def _is_worker(p: Any) -> bool:
    return _worker_stage(p) is not None


def _worker_stage(p: Any) -> str | None:
    """A stage worker's stage (``flux.1-dev.denoise.0`` -> ``denoise``: the instance named after the
    module on its command line; ``?`` where none is), or None for a process that is not a stage worker."""
    import psutil

    try:
        argv = p.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    if WORKER_MARK not in " ".join(argv):
        return None
    after = argv[argv.index(WORKER_MARK) + 1:] if WORKER_MARK in argv else []
    parts = after[0].rsplit(".", 2) if after else []
    return parts[1] if len(parts) == 3 else "?"


class ControlPlaneMeter:
    """``begin()`` and ``end(completed)`` around a saturated window; ``report()`` gives the figures."""

    def __init__(self, roles: dict[str, int]) -> None:
        self.roles = dict(roles)
        self._start: dict[tuple[int, float], tuple[str, float]] = {}
        self.stages: dict[tuple[int, float], str] = {}  # a stage worker's (pid, create time) -> its stage
        self.result: dict[str, Any] = {}

    def sample(self) -> dict[tuple[int, float], tuple[str, float]]:
        """(pid, create time) -> (role, CPU seconds so far) for every process of every role, now. A process
        below several roles' processes (the supervisor is everyone's parent) is its nearest one's."""
        import psutil

        by_pid = {pid: role for role, pid in self.roles.items()}
        seen: dict[tuple[int, float], tuple[str, float]] = {}
        for role, pid in self.roles.items():
            try:
                root = psutil.Process(pid)
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue  # gone (restarted by the supervisor under a new pid): not counted
            for p in tree:
                try:
                    nearest = next(a.pid for a in [p, *p.parents()] if a.pid in by_pid)
                    if nearest != pid:
                        continue  # another role's, counted with it
                    key = (p.pid, p.create_time())
                    stage = _worker_stage(p) if p is not root else None
                    if stage is not None:
                        self.stages[key] = stage
                    seen[key] = (WORKERS if stage is not None else role, _cpu(p))
                except (psutil.NoSuchProcess, psutil.ZombieProcess):
                    continue  # ended between the listing and the read
        return seen

    def begin(self) -> None:
        self._start = self.sample()

    def end(self, completed: int, seconds: float) -> None:
        now = self.sample()
        per_role: dict[str, float] = {role: 0.0 for role in self.roles}
        per_role[WORKERS] = 0.0
        for key, (role, cpu) in now.items():
            per_role[role] = per_role.get(role, 0.0) + cpu - self._start.get(key, (role, 0.0))[1]
        ended = [key[0] for key in self._start if key not in now]
        n = max(1, completed)
        by_stage: dict[str, float] = {}  # the stage workers' CPU per stage (its instances summed)
        for key, (role, cpu) in now.items():
            if role == WORKERS:
                stage = self.stages.get(key, "?")
                by_stage[stage] = by_stage.get(stage, 0.0) + cpu - self._start.get(key, (role, 0.0))[1]
        control = {role: s * 1e3 / n for role, s in per_role.items() if role != WORKERS}
        self.result = {
            "control_plane_cpu_ms_per_request": sum(control.values()) if completed else None,
            # unrounded: the total is their sum
            "control_plane_breakdown": dict(sorted(control.items(), key=lambda kv: -kv[1])),
            "stage_workers_cpu_ms_per_request": per_role[WORKERS] * 1e3 / n if completed else None,
            # which stage the workers' CPU went to: the one that bounds a CPU-bound deployment's capacity
            "stage_workers_breakdown": {k: v * 1e3 / n for k, v in sorted(by_stage.items(), key=lambda kv: -kv[1])}
            if completed else {},
            "control_plane_window_s": round(seconds, 3), "control_plane_window_completed": completed,
            "control_plane_cores_busy": {r: round(per_role[r] / seconds, 3) for r in per_role} if seconds else {},
            "control_plane_pids_ended": ended,
        }

    def report(self) -> dict[str, Any]:
        return dict(self.result)


def roles_from_state(state: str | Path) -> dict[str, int]:
    """role -> pid of every process ``onepiece up`` supervises, from ``<state>/processes.json``, and the
    supervisor itself; empty when the file is missing (an engine not started by ``onepiece up``)."""
    from engine.embedded.supervisor import STATUS_FILE

    try:
        doc = json.loads((Path(state) / STATUS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    roles = {name: int(c["pid"]) for name, c in doc.get("processes", {}).items() if c.get("pid")}
    if doc.get("supervisor_pid"):
        roles["supervisor"] = int(doc["supervisor_pid"])
    return roles


def vm_hwm_mb(pid: int) -> float:
    """A process's peak resident memory (``VmHWM`` in ``/proc/PID/status``), MiB; 0 when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _tree_sum(roles: dict[str, int], read: Callable[[int], float]) -> dict[str, float]:
    """role -> ``read(pid)`` summed over its process and descendants, stage workers (``engine.worker.proc``)
    summed apart under ``stage_workers``. Read while the processes run: a reaped one's figure is gone."""
    import psutil

    out: dict[str, float] = {}
    for role, pid in roles.items():
        try:
            root = psutil.Process(pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for p in tree:
            key = WORKERS if p is not root and _is_worker(p) else role
            out[key] = out.get(key, 0.0) + read(p.pid)
    return out


def tree_peak_rss_mb(roles: dict[str, int]) -> dict[str, float]:
    """role -> the summed peak resident memory (VmHWM, MiB) of its processes (:func:`_tree_sum`). A page
    that several processes map (torch's libraries, in every worker) counts once in each."""
    return _tree_sum(roles, vm_hwm_mb)


def tree_pss_mb(roles: dict[str, int]) -> dict[str, float]:
    """role -> the summed proportional set size (MiB, now) of its processes (:func:`_tree_sum`): a shared
    page is split between the processes that map it, so the sum over roles is the memory they take."""
    from engine.bench.figures import pss_kb

    return _tree_sum(roles, lambda pid: pss_kb(pid) / 1024)


def _sched(pid: int) -> tuple[int, int]:
    """(ns on a CPU, ns runnable but waiting for one) summed over the process's threads (/proc schedstat)."""
    run = wait = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            fields = stat.read_text().split()
        except OSError:
            continue  # a thread that ended meanwhile
        run, wait = run + int(fields[0]), wait + int(fields[1])
    return run, wait


class RunQueueMeter:
    """How long one process (the Proxy) was runnable but waiting for a CPU, per second of a window: the
    scheduling delay a refusal meets on a busy host, which its own work (the CPU time) does not show.
    ``None`` figures where /proc has no schedstat (a kernel without schedstats)."""

    def __init__(self, pid: int | None) -> None:
        self.pid = pid
        self._t0 = 0.0
        self._s0 = (0, 0)

    def begin(self) -> None:
        import time

        if self.pid is not None:
            self._t0, self._s0 = time.monotonic(), _sched(self.pid)

    def end(self) -> dict[str, float | None]:
        import time

        if self.pid is None or not Path(f"/proc/{self.pid}/schedstat").exists():
            return {"proxy_cpu_ms_per_s": None, "proxy_runqueue_wait_ms_per_s": None}
        wall = max(1e-9, time.monotonic() - self._t0)
        run, wait = _sched(self.pid)
        return {"proxy_cpu_ms_per_s": (run - self._s0[0]) / 1e6 / wall,
                "proxy_runqueue_wait_ms_per_s": (wait - self._s0[1]) / 1e6 / wall}
