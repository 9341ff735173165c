"""The TaskWorker process shell: ``python -m engine.worker.proc INSTANCE_ID`` with its configuration (JSON)
in ``ONEPIECE_WORKER_CONFIG``, or ``python -m engine.worker.proc CONFIG_JSON`` by hand.

The configuration holds the Redis and etcd URLs with their passwords, so its TaskManager passes it in
the environment, which only the same user can read, never on the command line, which ``ps`` shows to
everyone on the host; the command line names the instance only.

Wraps :class:`engine.worker.taskworker.TaskWorker` with what a process needs:
logging, signals (SIGTERM/SIGINT stop it after the current request; SIGUSR1
drains it: it serves what its ring holds, then exits), the
ready file its TaskManager waits for, and an exit when its TaskManager dies
(the parent pid changes), so no worker outlives its node.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine import envs
from engine.worker import priority

if TYPE_CHECKING:  # imported in main, after the priority is lowered: the import alone takes most of a second
    from engine.worker.taskworker import WorkerConfig


def config_to_json(config: WorkerConfig) -> str:
    return json.dumps(asdict(config), sort_keys=True)


CONFIG_ENV = "ONEPIECE_WORKER_CONFIG"


def _write_ready(path: str, info: dict[str, object]) -> None:
    """The ready file the TaskManager waits for (none when ``path`` is empty)."""
    if path:
        tmp = Path(path + ".tmp")
        tmp.write_text(json.dumps(info))
        tmp.replace(path)  # atomic: the manager never reads a half-written file


def _take_config() -> str:
    """The configuration the TaskManager passed in the environment, removed from it so that nothing this
    worker starts inherits it."""
    raw = envs.WORKER_CONFIG
    os.environ.pop(CONFIG_ENV, None)
    return raw


def _fields(args: list[str]) -> dict[str, Any] | None:
    """The configuration's fields from the command line or the environment; None (after saying why) when
    there is none."""
    if len(args) != 1:
        print(f"usage: python -m engine.worker.proc INSTANCE_ID (config in {CONFIG_ENV}) | CONFIG_JSON",
              file=sys.stderr)
        return None
    raw = args[0] if args[0].lstrip().startswith("{") else _take_config()
    if not raw:
        print(f"engine.worker.proc {args[0]}: no configuration in {CONFIG_ENV}", file=sys.stderr)
        return None
    fields: dict[str, Any] = json.loads(raw)
    return fields


def _on_signals() -> dict[str, float | bool | None]:
    """SIGTERM/SIGINT set ``flag`` (stop after the current request); SIGUSR1 sets ``drain`` to when it came
    (serve what the ring holds, then exit)."""
    stop: dict[str, float | bool | None] = {"flag": False, "drain": None}

    def _on_signal(signum: int, frame: object) -> None:
        stop["flag"] = True

    def _on_drain(signum: int, frame: object) -> None:
        stop["drain"] = time.monotonic()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGUSR1, _on_drain)
    return stop


def _import_runtime() -> None:
    """The worker's heavy imports, here, in the worker, never in the TaskManager; timed on their own (the
    ready file's ``process_s``), apart from the model load that follows."""
    import engine.coord
    import engine.coord.routes
    import engine.stages.registry
    import engine.store
    import engine.transport.ring
    import engine.worker.stretch
    import engine.worker.taskworker
    import engine.worker.threads  # noqa: F401


def _load(config: WorkerConfig) -> tuple[Any, Any, int]:
    """(the stage's executor, loaded; what serves: the same executor, maybe stretched; the thread budget)."""
    from engine.stages.registry import executor_class
    from engine.worker.stretch import stretched
    from engine.worker.threads import apply_torch

    executor_type = executor_class(config.workflow, config.stage)  # imports torch if the stage uses it
    threads = config.threads
    if "torch" in sys.modules:  # torch's pools sized to the budget before the first op (its env vars are set)
        threads = apply_torch(config.threads or None)
    executor = executor_type()
    executor.served_workflow = config.workflow  # per-workflow settings (engine.stages.caching)
    executor.load(config.model_dir, config.device)
    # test and benchmark hook, off in production: the same executor, its runs slept to a chosen profile
    return executor, stretched(executor, config.stage_time_s, config.stage_stretch, config.step_delay_s), threads


def _connect(config: WorkerConfig, executor: Any, served: Any) -> tuple[Any, Any, Any]:
    """(the job store, the started route table, the TaskWorker over its ring and its CFG helper, if any)."""
    from engine.coord import etcd_client
    from engine.coord.routes import RouteTable
    from engine.store import JobStore
    from engine.store.objects import from_config
    from engine.transport.ring import RingConfig
    from engine.worker.taskworker import TaskWorker, open_ring

    # a final stage writes its output to the object store, when one is configured and the output is not under
    # ONEPIECE_OBJECT_INLINE_BYTES (engine.store.jobs)
    store = JobStore.from_url(config.redis_url, ttl=config.result_ttl_s, objects=from_config(envs.OBJECT_STORE),
                              inline_bytes=envs.OBJECT_INLINE_BYTES)
    routes = RouteTable(etcd_client(config.etcd_url), config.route_refresh_s,
                        workflow_set=config.workflow_set).start()
    consumer = open_ring(config.address, RingConfig(slots=config.ring_slots, buffer_bytes=config.ring_bytes))
    collab = None
    if config.collab_address:
        from engine.worker.collab import CfgService

        ring = open_ring(config.collab_address, RingConfig(slots=64, buffer_bytes=config.ring_bytes))
        collab = CfgService(config.instance, config.collab_address, ring, executor,
                            on_helped=lambda n: store.instances.count(config.instance, "cfg_halves", n)).start()
    return store, routes, TaskWorker(config, store, routes, served, consumer, collab)


def _should_stop(stop: dict[str, float | bool | None], parent: int, worker: Any,
                 quiet: float) -> Callable[[], bool]:
    """Stop on a signal or when the TaskManager died (the pid of the ``parent`` changed); a drained worker
    once its ring stayed empty for ``quiet`` seconds."""

    def should_stop() -> bool:
        if stop["flag"] or os.getppid() != parent:
            return True
        since = stop["drain"]
        return isinstance(since, float) and time.monotonic() - max(since, worker.last_active) >= quiet

    return should_stop


def main(argv: list[str] | None = None) -> int:
    fields = _fields(sys.argv[1:] if argv is None else argv)
    if fields is None:
        return 2
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {fields.get('instance')} %(levelname)s %(message)s")
    log = logging.getLogger("onepiece.worker")
    # below the control plane before any import starts a thread: every later thread inherits the niceness
    nice = priority.lower(int(fields.get("nice", 0)), log)
    from engine.worker.taskworker import WorkerConfig

    config = WorkerConfig(**fields)
    stop = _on_signals()
    parent = os.getppid()  # taken before the slow start-up, so that a TaskManager dying during it shows
    t_start = time.monotonic()
    _import_runtime()
    t_load = time.monotonic()
    executor, served, threads = _load(config)
    t_ring = time.monotonic()
    store, routes, worker = _connect(config, executor, served)
    t_ready = time.monotonic()
    # a drained worker exits once its ring stayed empty for longer than senders take to see its route gone
    should_stop = _should_stop(stop, parent, worker, 2 * config.route_refresh_s + 0.5)
    try:
        # start-up parts: imports (process_s), model load (load_s), rings, store and routes (ring_s)
        _write_ready(config.ready_file, {"pid": os.getpid(), "threads": threads, "nice": nice,
                                         "process_s": round(t_load - t_start, 3), "load_s": round(t_ring - t_load, 3),
                                         "ring_s": round(t_ready - t_ring, 3)})
        log.info("serving %s/%s on %s", config.workflow, config.stage, config.address)
        worker.serve(should_stop)
    finally:
        worker.close()
        routes.stop()
        store.close()
    log.info("stopped after %d requests", worker.handled)
    return 0


if __name__ == "__main__":
    sys.exit(main())
