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
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

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


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(f"usage: python -m engine.worker.proc INSTANCE_ID (config in {CONFIG_ENV}) | CONFIG_JSON",
              file=sys.stderr)
        return 2
    raw = args[0] if args[0].lstrip().startswith("{") else _take_config()
    if not raw:
        print(f"engine.worker.proc {args[0]}: no configuration in {CONFIG_ENV}", file=sys.stderr)
        return 2
    fields = json.loads(raw)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {fields.get('instance')} %(levelname)s %(message)s")
    log = logging.getLogger("onepiece.worker")
    # below the control plane before any import starts a thread: every later thread inherits the niceness
    nice = priority.lower(int(fields.get("nice", 0)), log)
    from engine.worker.taskworker import WorkerConfig

    config = WorkerConfig(**fields)
    stop: dict[str, float | bool | None] = {"flag": False, "drain": None}

    def _on_signal(signum: int, frame: object) -> None:
        stop["flag"] = True

    def _on_drain(signum: int, frame: object) -> None:
        stop["drain"] = time.monotonic()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGUSR1, _on_drain)  # drain: serve what the ring holds, then exit
    parent = os.getppid()
    t_start = time.monotonic()

    # Heavy imports happen here, in the worker, never in the TaskManager.
    from engine.coord import etcd_client
    from engine.stages.registry import executor_class
    from engine.store import JobStore
    from engine.transport.ring import RingConfig
    from engine.worker.routes import RouteTable
    from engine.worker.stretch import stretched
    from engine.worker.taskworker import TaskWorker, open_ring
    from engine.worker.threads import apply_torch

    t_load = time.monotonic()
    executor_type = executor_class(config.workflow, config.stage)  # imports torch if the stage uses it
    threads = config.threads
    if "torch" in sys.modules:  # torch's pools sized to the budget before the first op (its env vars are set)
        threads = apply_torch(config.threads or None)
    executor = executor_type()
    executor.load(config.model_dir, config.device)
    # test and benchmark hook, off in production: the same executor, its runs slept to a chosen profile
    served = stretched(executor, config.stage_time_s, config.stage_stretch, config.step_delay_s)
    t_ring = time.monotonic()
    store = JobStore.from_url(config.redis_url, ttl=config.result_ttl_s)
    routes = RouteTable(etcd_client(config.etcd_url), config.route_refresh_s,
                        workflow_set=config.workflow_set).start()
    consumer = open_ring(config.address, RingConfig(slots=config.ring_slots, buffer_bytes=config.ring_bytes))
    collab = None
    if config.collab_address:
        from engine.worker.collab import CfgService

        ring = open_ring(config.collab_address, RingConfig(slots=64, buffer_bytes=config.ring_bytes))
        collab = CfgService(config.instance, config.collab_address, ring, executor,
                            on_helped=lambda n: store.count_instance(config.instance, "cfg_halves", n)).start()
    worker = TaskWorker(config, store, routes, served, consumer, collab)
    t_ready = time.monotonic()
    # a drained worker exits once its ring stayed empty for longer than senders take to see its route gone
    quiet = 2 * config.route_refresh_s + 0.5

    def should_stop() -> bool:
        if stop["flag"] or os.getppid() != parent:
            return True
        since = stop["drain"]
        return isinstance(since, float) and time.monotonic() - max(since, worker.last_active) >= quiet

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
