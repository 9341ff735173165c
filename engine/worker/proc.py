"""The TaskWorker process shell: ``python -m engine.worker.proc CONFIG_JSON``.

Wraps :class:`engine.worker.taskworker.TaskWorker` with what a process needs:
logging, signals (SIGTERM/SIGINT stop it after the current request), the
ready file its TaskManager waits for, and an exit when its TaskManager dies
(the parent pid changes), so no worker outlives its node.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from dataclasses import asdict
from pathlib import Path

from engine.worker.taskworker import WorkerConfig


def config_to_json(config: WorkerConfig) -> str:
    return json.dumps(asdict(config), sort_keys=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m engine.worker.proc CONFIG_JSON", file=sys.stderr)
        return 2
    config = WorkerConfig(**json.loads(args[0]))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {config.instance} %(levelname)s %(message)s")
    log = logging.getLogger("onepiece.worker")
    stop = {"flag": False}

    def _on_signal(signum: int, frame: object) -> None:
        stop["flag"] = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    parent = os.getppid()

    # Heavy imports happen here, in the worker, never in the TaskManager.
    from engine.stages.registry import executor_class
    from engine.store import JobStore
    from engine.transport.ring import RingConfig
    from engine.worker.routes import RouteTable, etcd_client
    from engine.worker.taskworker import TaskWorker, open_ring

    executor = executor_class(config.workflow, config.stage)()
    executor.load(config.model_dir, config.device)
    store = JobStore.from_url(config.redis_url, ttl=config.result_ttl_s)
    routes = RouteTable(etcd_client(config.etcd_url), config.route_refresh_s).start()
    consumer = open_ring(config.address, RingConfig(slots=config.ring_slots, buffer_bytes=config.ring_bytes))
    collab = None
    if config.collab_address:
        from engine.worker.collab import CfgService

        ring = open_ring(config.collab_address, RingConfig(slots=64, buffer_bytes=config.ring_bytes))
        collab = CfgService(config.instance, config.collab_address, ring, executor,
                            on_helped=lambda n: store.count_instance(config.instance, "cfg_halves", n)).start()
    worker = TaskWorker(config, store, routes, executor, consumer, collab)
    try:
        if config.ready_file:
            tmp = Path(config.ready_file + ".tmp")
            tmp.write_text(str(os.getpid()))
            tmp.replace(config.ready_file)  # atomic: the manager never reads a half-written file
        log.info("serving %s/%s on %s", config.workflow, config.stage, config.address)
        worker.serve(lambda: stop["flag"] or os.getppid() != parent)
    finally:
        worker.close()
        routes.stop()
        store.close()
    log.info("stopped after %d requests", worker.handled)
    return 0


if __name__ == "__main__":
    sys.exit(main())
