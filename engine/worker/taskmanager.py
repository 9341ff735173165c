"""TaskManager: one per node; keeps the node's TaskWorker processes matching its assignment.

Each tick (``tick()``, every ``interval`` seconds) it reconciles desired state
(the assignment in etcd, or a static one) with actual state (its worker
processes), in the manner of a controller loop that never dies: an error in
one tick is logged and the next tick starts afresh.

- Membership: the node registers ``/onepiece/nodes/<node>`` bound to an etcd
  lease that the loop refreshes; the value is the node's report (per-instance
  pid, readiness, restarts, requests, busy and last stage seconds, CPU threads
  and niceness).
- Priority: every worker runs ``worker_nice`` nice levels below the node, so
  the control plane is not queued behind a stage (:mod:`engine.worker.priority`).
- Workers: one process per instance (:mod:`engine.worker.proc`). A worker
  that dies is restarted with exponential backoff (0.5 s doubling to 10 s).
- Rings: each instance's inbox is ``shm://<ring_prefix><instance>`` (or, with
  ``transport`` tcp/verbs, ``tcp://<data_host>:<port>/<ring_prefix><instance>``,
  reachable from other hosts; its memory is still a segment here); the worker
  is its consumer (see :mod:`engine.worker.taskworker` for why). The route
  stays published while a dead worker restarts: the ring survives the crash,
  so upstream stages keep handing requests to it and the new worker serves
  them after recovery. At start and at shutdown the manager unlinks every
  segment under its prefix, so nothing is left in /dev/shm.
- Routes: published (bound to the node's lease) once a worker reports ready;
  withdrawn when its instance is removed from the assignment or the node stops.
- Moves: an instance removed from the assignment is drained, not killed: its
  route goes first, then the worker serves what its ring still holds and
  exits (SIGUSR1); its ring is unlinked after. Start-up (process, model load,
  ring connect, until ready) and drain times are in the report's ``moves``.
- Fencing: an assignment the Node Manager wrote carries its leader's
  ``fence_token``; one with a token older than the newest seen is ignored.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine import envs
from engine.coord import etcd_client
from engine.coord.keys import Keyspace
from engine.coord.routes import Route, publish_route, withdraw_route
from engine.coord.watch import ChangeFlag
from engine.embedded import children
from engine.embedded.services import free_port
from engine.store import JobStore
from engine.telemetry.devices import DeviceSampler
from engine.transport.layout import max_payload
from engine.worker import priority
from engine.worker.config import Assignment, Batching, Calibration, InstanceSpec, StageTiming
from engine.worker.threads import apply_env, budget_for, inherited, is_cuda
from engine.workflow import get_workflow

log = logging.getLogger("onepiece.node")

SHM_DIR = "/dev/shm"
SHM_PREFIX = "onepiece-"  # engine.transport.shm's prefix; not imported, to keep this process light
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 10.0
DRAIN_TIMEOUT_S = 300.0  # a worker still serving its queue after this long is killed


@dataclass
class _Instance:
    spec: InstanceSpec
    address: str
    model_dir: str
    deliver: str
    proc: subprocess.Popen[bytes] | None = None
    ready: bool = False
    restarts: int = 0
    next_start: float = 0.0
    published: bool = False
    generation: int = field(default_factory=time.time_ns)  # a new ring for each new instance (see Route)
    history: list[float] = field(default_factory=list)
    collab: str = ""  # Collaboration mode: the instance's second ring (see engine.worker.collab)
    spawned: float = 0.0  # when the current process was started (the TaskManager's clock)
    startup: dict[str, Any] = field(default_factory=dict)  # the last start-up's timings
    drain_started: float = 0.0
    busy: tuple[float, float] = (0.0, 0.0)  # (busy seconds, when) at the last report: utilisation baseline
    threads: int = 0  # the CPU thread budget of the current process (engine.worker.threads)


@dataclass(frozen=True)
class NodeSettings:
    """Where the node's services are and how it sizes its rings."""

    node: str
    etcd_url: str
    redis_url: str
    run_dir: Path
    ring_prefix: str = ""
    ring_slots: int = 256
    ring_bytes: int = 64 << 20
    lease_ttl_s: int = 10
    deliver: str = "least-outstanding"
    progress_interval_s: float = 0.25
    result_ttl_s: int = 3600
    route_refresh_s: float = 1.0
    timing: StageTiming = field(default_factory=StageTiming)  # stretched stage times (benchmarks, tests)
    batching: Batching = field(default_factory=Batching)  # step-level batching per stage (engine.worker.batching)
    calibration: Calibration = field(default_factory=Calibration)  # warm-up calibration budgets (engine.worker.calibrate)
    transport: str = "shm"  # the inbox rings: "shm" (one host), "tcp" or "verbs" (reachable from other hosts)
    data_host: str = "127.0.0.1"  # tcp/verbs: the address peers reach this node's rings at
    workflow_set: str = "default"  # the node's home Workflow Set (the Node Manager may lend it to another)
    threads_per_instance: int | None = None  # CPU threads per instance; None: auto (engine.worker.threads)
    worker_nice: int = priority.DEFAULT  # workers run this many nice levels below the node (engine.worker.priority)


class TaskManager:
    """Reconciles the node's worker processes with its assignment; see the module docstring."""

    def __init__(self, settings: NodeSettings, static: Assignment | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.s = settings
        self.keys = Keyspace.from_env()  # where its assignment, report and routes live in etcd
        self.static = static
        self.clock = clock
        self.prefix = settings.ring_prefix or f"{settings.node}-"
        self.instances: dict[str, _Instance] = {}
        self.desired = Assignment()
        self.client: Any = None
        self.store: Any = None
        self.lease: Any = None
        self._lease_refreshed = 0.0
        self._reported = 0.0
        self.tick_seconds = 0.0
        self.fence_token = 0  # newest Node Manager token seen on this node's assignment
        self.logs = settings.run_dir / "logs"
        self._devices: Any = None  # DeviceSampler, made on first report
        self.draining: list[_Instance] = []  # removed from the assignment, finishing what their rings hold
        self.moves: list[dict[str, Any]] = []  # the last drains and start-ups, with their timings
        self._limits_cache: dict[tuple[str, str], dict[str, Any]] = {}  # (workflow, model folder) -> limits
        self._nice_warned = False  # a host refusing the workers' lower priority is said once, not per start
        self._assignment_changes: Any = None  # engine.coord.watch.ChangeFlag on the assignment, once started

    # -- life cycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        self._unlink_segments()
        self.client = etcd_client(self.s.etcd_url)
        self.store = JobStore.from_url(self.s.redis_url, ttl=self.s.result_ttl_s)
        self.lease = self.client.lease(self.s.lease_ttl_s)
        self._lease_refreshed = self.clock()
        if self.static is not None:
            self.client.put(self.keys.assignment(self.s.node), self.static.to_json())
        self._assignment_changes = ChangeFlag(self.client, self.keys.assignment(self.s.node),
                                              name="onepiece-node-assignment")
        self._report(force=True)

    def run(self, should_stop: Callable[[], bool], interval: float = 0.2) -> None:
        """Tick until ``should_stop()``; a failing tick is logged, never fatal."""
        while not should_stop():
            t0 = time.monotonic()
            try:
                self.tick()
            except Exception:  # the control loop must not die
                log.exception("tick failed")
            self.tick_seconds = time.monotonic() - t0
            time.sleep(max(0.0, interval - self.tick_seconds))

    def tick(self) -> None:
        now = self.clock()
        if now - self._lease_refreshed > self.s.lease_ttl_s / 3:
            self.lease.refresh()
            self._lease_refreshed = now
        self._read_assignment()
        wanted = {i.id: i for i in self.desired.instances}
        for iid, inst in list(self.instances.items()):
            if iid not in wanted or wanted[iid] != inst.spec:
                self._drain(inst, now)
        draining = {d.spec.id for d in self.draining}
        for iid, spec in wanted.items():
            if iid not in self.instances and iid not in draining:  # a re-made id waits for its drain
                cfg_parallel = get_workflow(spec.workflow).stage(spec.stage).cfg_parallel
                self.instances[iid] = _Instance(
                    spec, self._address(iid), self.desired.model_dirs[spec.workflow],
                    self.desired.deliver.get(spec.workflow, self.s.deliver),
                    collab=self._address(iid + ".cfg") if cfg_parallel else "")
        for inst in self.instances.values():
            self._supervise(inst, now)
        self._supervise_drains(now)
        self._report()

    def shutdown(self, timeout: float = 15.0) -> None:
        """Stop every worker (SIGTERM, then SIGKILL), withdraw routes, drop the lease, unlink rings."""
        for inst in self.draining:
            self.instances.setdefault(f"{inst.spec.id}#draining", inst)
        self.draining = []
        for inst in self.instances.values():
            if inst.proc is not None and inst.proc.poll() is None:
                inst.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for inst in self.instances.values():
            if inst.proc is not None:
                try:
                    inst.proc.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    inst.proc.kill()
                    inst.proc.wait()
        if self.client is not None:
            for inst in self.instances.values():
                for route in self._routes(inst):
                    self._try(withdraw_route, self.client, route)
            if self.static is not None:
                self._try(self.client.delete, self.keys.assignment(self.s.node))
            self._try(self.client.delete, self.keys.node(self.s.node))
            if self.lease is not None:
                self._try(self.lease.revoke)
        self.instances.clear()
        if self._assignment_changes is not None:
            self._assignment_changes.stop()
        self._unlink_segments()
        if self.store is not None:
            self.store.close()

    # -- reconciliation ----------------------------------------------------------------------------
    def _read_assignment(self) -> None:
        """Read the node's assignment when it changed (an etcd watch: a tick no longer reads etcd five times a
        second), when the watch is down, and every 10 s as a safety net."""
        if self._assignment_changes is not None and not self._assignment_changes.take():
            return
        try:
            values = self.client.get(self.keys.assignment(self.s.node))
        except Exception as exc:  # etcd unreachable: keep the last desired state
            log.warning("cannot read the assignment (%s); keeping the last one", exc)
            return
        if not values:
            self.desired = Assignment()
            return
        try:
            obj = json.loads(values[0])
            token = int(obj.get("fence_token", 0))
            if token < self.fence_token:
                # a deposed Node Manager's late write: the newer leader's assignment stands
                log.warning("ignoring an assignment fenced by token %d < %d", token, self.fence_token)
                return
            self.desired = Assignment.from_obj(obj)
            self.fence_token = token
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            log.error("ignoring a malformed assignment: %s", exc)

    def _supervise(self, inst: _Instance, now: float) -> None:
        if inst.proc is not None and inst.proc.poll() is not None:
            code = inst.proc.returncode
            inst.proc, inst.ready = None, False
            delay = min(BACKOFF_MAX_S, BACKOFF_MIN_S * 2 ** min(inst.restarts, 5))
            inst.next_start = now + delay
            inst.restarts += 1
            log.warning("worker %s exited with %s; restarting in %.1fs", inst.spec.id, code, delay)
        if inst.proc is None and now >= inst.next_start:
            self._spawn(inst)
        if inst.proc is not None and not inst.ready and self._ready_pid(inst) == inst.proc.pid:
            inst.ready = True
            inst.startup = dict(self._ready_info(inst), ready_s=round(now - inst.spawned, 3))
            self._log_move({"event": "ready", "instance": inst.spec.id, **inst.startup})
            self._check_nice(inst)
            if not inst.published:  # one route per (workflow, stage) it serves: a shared pool's members each
                for route in self._routes(inst):
                    publish_route(self.client, route, self.lease, self.keys)
                inst.published = True
            log.info("worker %s ready (pid %d)", inst.spec.id, inst.proc.pid)

    def _spawn(self, inst: _Instance) -> None:
        from engine.worker.proc import CONFIG_ENV, config_to_json
        from engine.worker.taskworker import WorkerConfig

        ready = self._ready_file(inst)
        ready.unlink(missing_ok=True)
        inst.threads = self.thread_budget(inst)
        floor_s, factor = self.s.timing.for_stage(inst.spec.workflow, inst.spec.stage)
        max_batch, wait_ms = self.s.batching.for_stage(inst.spec.workflow, inst.spec.stage)
        cfg = WorkerConfig(
            instance=inst.spec.id, workflow=inst.spec.workflow, stage=inst.spec.stage, model_dir=inst.model_dir,
            address=inst.address, redis_url=self.s.redis_url, etcd_url=self.s.etcd_url,
            ring_slots=self.s.ring_slots, ring_bytes=self.s.ring_bytes, deliver=inst.deliver,
            device=inst.spec.device,
            step_delay_s=max(inst.spec.step_delay_s, self.s.timing.step_for(inst.spec.workflow, inst.spec.stage)),
            progress_interval_s=self.s.progress_interval_s, result_ttl_s=self.s.result_ttl_s,
            route_refresh_s=self.s.route_refresh_s, ready_file=str(ready),
            stage_time_s=floor_s, stage_stretch=factor, collab_address=inst.collab,
            workflow_set=inst.spec.workflow_set, threads=inst.threads, nice=self.s.worker_nice,
            max_batch=max_batch, batch_wait_ms=wait_ms, also=inst.spec.also,
            max_held=self.s.batching.held_for(inst.spec.workflow, inst.spec.stage),
            calibrate_s=self.s.calibration.for_stage(inst.spec.workflow, inst.spec.stage),
        )
        env = apply_env(dict(os.environ), inst.threads)  # before the worker loads torch
        # its configuration holds the Redis and etcd passwords: in its environment, never on its command line
        env[CONFIG_ENV] = config_to_json(cfg)
        with open(self.logs / f"{inst.spec.id}.log", "ab") as out:
            # own session (Ctrl-C reaches the node, which stops workers in order); SIGTERM if the node dies,
            # so a killed node leaves no worker serving its ring with nobody to restart or stop it
            inst.proc = children.popen([sys.executable, "-m", "engine.worker.proc", inst.spec.id],
                                       stdout=out, stderr=subprocess.STDOUT, env=env)
        inst.history.append(time.time())
        inst.spawned = self.clock()
        log.info("started worker %s (pid %d, %d CPU threads)", inst.spec.id, inst.proc.pid, inst.threads)

    def thread_budget(self, inst: _Instance) -> int:
        """CPU threads for a worker started now: the node's cores shared among the instances placed on it
        (or the explicit ``threads_per_instance``); see :mod:`engine.worker.threads`."""
        placed = len(self.desired.instances) or len(self.instances)
        explicit = self.s.threads_per_instance or inherited()
        return budget_for(placed, is_cuda(inst.spec.device, envs.DEVICE or "auto"), explicit)

    def _check_nice(self, inst: _Instance) -> None:
        """Warn once when a worker came up above the priority it was given (the host refused the change):
        the control plane then competes with the stages for the cores."""
        got, base = inst.startup.get("nice"), priority.niceness()
        if self._nice_warned or not isinstance(got, int) or base is None:
            return
        want = priority.expected(base, self.s.worker_nice)
        if got < want:
            self._nice_warned = True
            log.warning("worker %s runs at niceness %d, not %d (the host refused a lower priority; see its log): "
                        "stage workers compete with the control plane for the CPU", inst.spec.id, got, want)

    def _drain(self, inst: _Instance, now: float) -> None:
        """Take an instance out of service without losing what its ring holds: withdraw its route (senders
        stop choosing it within one route refresh), then SIGUSR1: the worker serves what is queued and exits
        once its ring stayed empty past the senders' refresh. The slot is free when the process is gone."""
        self.instances.pop(inst.spec.id, None)
        if inst.published:
            for route in self._routes(inst):
                self._try(withdraw_route, self.client, route)
            inst.published = False
        if inst.proc is None or inst.proc.poll() is not None:
            self._forget(inst)
            return
        inst.proc.send_signal(signal.SIGUSR1)
        inst.drain_started = now
        self.draining.append(inst)
        log.info("draining worker %s (pid %d)", inst.spec.id, inst.proc.pid)

    def _supervise_drains(self, now: float) -> None:
        for inst in list(self.draining):
            assert inst.proc is not None
            if inst.proc.poll() is None and now - inst.drain_started < DRAIN_TIMEOUT_S:
                continue
            if inst.proc.poll() is None:
                log.error("worker %s did not drain within %.0fs; killing it", inst.spec.id, DRAIN_TIMEOUT_S)
                inst.proc.kill()
                inst.proc.wait()
            self.draining.remove(inst)
            self._log_move({"event": "drained", "instance": inst.spec.id, "exit": inst.proc.returncode,
                            "drain_s": round(now - inst.drain_started, 3)})
            self._forget(inst)

    def _forget(self, inst: _Instance) -> None:
        self._unlink(inst.address)
        if inst.collab:
            self._unlink(inst.collab)

    def _log_move(self, entry: dict[str, Any]) -> None:
        entry["at"] = time.time()
        self.moves = [*self.moves[-19:], entry]
        log.info("%s", json.dumps(entry))

    # -- reporting ---------------------------------------------------------------------------------
    def _report(self, force: bool = False) -> None:
        now = self.clock()
        if not force and now - self._reported < 2.0:
            return
        self._reported = now
        report = {
            "node": self.s.node, "pid": os.getpid(), "ts": time.time(), "tick_seconds": self.tick_seconds,
            "set": self.s.workflow_set, "nice": priority.niceness(), "worker_nice": self.s.worker_nice,
            "instances": {iid: self._instance_report(i) for iid, i in self.instances.items()},
            "draining": [i.spec.id for i in self.draining], "moves": self.moves,
            "devices": self._device_report(),
        }
        self.client.put(self.keys.node(self.s.node), json.dumps(report), lease=self.lease)

    def _device_report(self) -> list[dict[str, Any]]:
        """This host's devices (NVML, or CPU figures labelled as such in each sample's ``source``)."""
        try:
            if self._devices is None:
                self._devices = DeviceSampler()
            return [d.as_dict() for d in self._devices.sample()]
        except Exception as exc:  # telemetry must never stop the node
            log.warning("device sampling failed: %s", exc)
            return []

    def _instance_report(self, inst: _Instance) -> dict[str, Any]:
        """Identity and health, plus what the worker measured: requests, busy seconds, last stage time,
        and utilisation (busy fraction since the previous report)."""
        from engine.transport.ring.base import local_backlog

        out: dict[str, Any] = {"workflow": inst.spec.workflow, "stage": inst.spec.stage, "address": inst.address,
                               "serves": ["/".join(m) for m in inst.spec.members],
                               "pid": inst.proc.pid if inst.proc else None, "ready": inst.ready,
                               "restarts": inst.restarts, "startup": inst.startup, "threads": inst.threads,
                               # read live: what the scheduler applies now (an operator's renice included)
                               "nice": priority.niceness(inst.proc.pid) if inst.proc else None,
                               # step-level batching: the most requests that may share a step here
                               "max_batch": self.s.batching.for_stage(inst.spec.workflow, inst.spec.stage)[0],
                               "ring": local_backlog(inst.address) if inst.ready else None}
        try:
            stats = self.store.instances.read(inst.spec.id) if self.store is not None else {}
        except Exception:  # Redis unreachable: report what the node itself knows
            return out
        busy, now = float(stats.get("busy_s", 0.0)), time.monotonic()
        prev_busy, prev_t = inst.busy
        out.update(requests=int(stats.get("requests", 0)), busy_s=busy,
                   last_stage_s=float(stats.get("last_stage_s", 0.0)),
                   # per workflow served: a shared pool's members cost differently (the Node Manager sums them)
                   service_s={k.split(".", 1)[1]: float(v) for k, v in stats.items() if k.startswith("last_stage_s.")},
                   adapters=json.loads(stats.get("adapters") or "null"),  # LoRA adapters loaded (engine.adapters.hot)
                   utilisation=min(1.0, (busy - prev_busy) / (now - prev_t)) if prev_t and now > prev_t else 0.0)
        inst.busy = (busy, now)
        return out

    # -- helpers ---------------------------------------------------------------------------------------
    def _routes(self, inst: _Instance) -> list[Route]:
        """The instance's routes: one per (workflow, stage) it serves, each with its workflow's limits."""
        dirs = self.desired.model_dirs
        return [Route(w, st, inst.spec.id, inst.address, self.s.node, inst.generation, inst.collab,
                      inst.spec.workflow_set, self._limits(w, dirs.get(w, inst.model_dir)), max_payload(self.s.ring_bytes))
                for w, st in inst.spec.members]

    def _limits(self, workflow: str, model_dir: str) -> dict[str, Any]:
        """What the model folder allows (engine.workflow.limits), read once per folder: JSON only."""
        key = (workflow, model_dir)
        if key not in self._limits_cache:
            try:
                self._limits_cache[key] = get_workflow(workflow).limits_of(model_dir)
            except Exception:  # an unreadable config: the spec's own limits apply, and the stage will say
                log.exception("reading the limits of %s from %s failed", workflow, model_dir)
                self._limits_cache[key] = {}
        return self._limits_cache[key]

    def _ready_file(self, inst: _Instance) -> Path:
        return self.s.run_dir / f"{inst.spec.id}.ready"

    def _ready_info(self, inst: _Instance) -> dict[str, Any]:
        """What the worker wrote when it became ready: its pid and how long its start-up parts took."""
        try:
            info = json.loads(self._ready_file(inst).read_text())
        except (FileNotFoundError, ValueError):
            return {}
        return info if isinstance(info, dict) else {"pid": info}

    def _ready_pid(self, inst: _Instance) -> int | None:
        pid = self._ready_info(inst).get("pid")
        return pid if isinstance(pid, int) else None

    def _address(self, iid: str) -> str:
        """A new instance's inbox. tcp/verbs get a port of their own, kept across the worker's restarts
        so producers on other hosts reconnect to the same address."""
        name = f"{self.prefix}{iid}"
        if self.s.transport == "shm":
            return f"shm://{name}"
        return f"{self.s.transport}://{self.s.data_host}:{free_port(self.s.data_host)}/{name}"

    def _unlink(self, address: str) -> None:
        # every transport keeps the ring's memory in a segment on this host named after the address path
        name = address.split("://", 1)[1]
        name = name.split("/", 1)[1] if "/" in name else name
        Path(SHM_DIR, SHM_PREFIX + name).unlink(missing_ok=True)

    def _unlink_segments(self) -> None:
        try:
            names = os.listdir(SHM_DIR)
        except FileNotFoundError:
            return
        for n in names:
            if n.startswith(SHM_PREFIX + self.prefix):
                Path(SHM_DIR, n).unlink(missing_ok=True)

    @staticmethod
    def _try(fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # best effort during shutdown
            log.warning("%s failed during shutdown: %s", getattr(fn, "__name__", fn), exc)
