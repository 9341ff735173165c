"""``onepiece node``: run this machine's TaskManager until SIGINT/SIGTERM.

With ``--assignment FILE`` the node writes that static assignment (JSON, see
:mod:`engine.worker.config`) to etcd before it starts; without it, it serves
whatever ``/onepiece/assignments/<node>`` holds and follows its changes.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from engine import envs

if TYPE_CHECKING:
    from engine.worker.taskmanager import NodeSettings


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--node", default=None, help="node name in etcd (default: ONEPIECE_NODE_NAME or the host name)")
    p.add_argument("--etcd-url", default=None, help="etcd client URL (default: ONEPIECE_ETCD_URL)")
    p.add_argument("--redis-url", default=None, help="Redis URL (default: ONEPIECE_REDIS_URL)")
    p.add_argument("--run-dir", type=Path, default=None, help="ready files and worker logs (default: STATE_DIR/node)")
    p.add_argument("--assignment", type=Path, default=None, help="a static assignment to serve (JSON file)")
    p.add_argument("--ring-prefix", default="", help="shared-memory name prefix of this node's rings")
    p.add_argument("--ring-bytes", type=int, default=None, help="buffer bytes per inbox ring")
    p.add_argument("--ring-slots", type=int, default=None, help="slots per inbox ring")
    p.add_argument("--deliver", default=None, help="default ResultDeliver policy")
    p.add_argument("--transport", choices=["shm", "tcp", "verbs"], default=None,
                   help="inbox rings: shm (one host) or tcp/verbs, reachable from other hosts (default: ONEPIECE_TRANSPORT)")
    p.add_argument("--data-host", default=None,
                   help="tcp/verbs: this node's data-plane address, where peers reach its rings "
                   "(default: ONEPIECE_BIND_HOST)")
    p.add_argument("--set", dest="workflow_set", default=None,
                   help="this node's home Workflow Set (default: ONEPIECE_WORKFLOW_SET or 'default')")
    p.add_argument("--threads-per-instance", default=None, metavar="N|auto",
                   help="CPU threads each stage instance may use (torch intra-op, OpenMP, MKL, OpenBLAS); auto "
                   "shares the node's usable cores among its instances, 1-2 on CUDA "
                   "(default: ONEPIECE_THREADS_PER_INSTANCE or auto)")
    p.add_argument("--worker-nice", default=None, metavar="N",
                   help="run every stage worker N nice levels below this node (0..19, 0: off), so the Proxy, the "
                   "reconciler and the web process are not queued behind a stage (default: ONEPIECE_WORKER_NICE or 10)")
    p.add_argument("--max-batch", default=None, metavar="STAGE=N,...",
                   help="step-level batching: at most N requests share a step of STAGE or WORKFLOW/STAGE (1: one "
                   "at a time; default: the spec's, measured per stage: 7 for sd-t2i's denoise, 4 for FLUX.1's and "
                   "Wan2.1's, 8 for Qwen-Image's and the text encoders; ONEPIECE_MAX_BATCH)")
    p.add_argument("--batch-wait-ms", default=None, metavar="STAGE=T,...",
                   help="a new batch waits up to T ms after its oldest request for more (default 0: later ones "
                   "join at the next step; ONEPIECE_BATCH_WAIT_MS)")
    p.add_argument("--max-held", default=None, metavar="STAGE=H,...",
                   help="a batching stage keeps at most H requests active at once: the highest priority's step "
                   "group and lower ones paused between steps (at least its max batch; default: twice it; "
                   "ONEPIECE_MAX_HELD)")
    p.add_argument("--calibrate-s", default=None, metavar="S|STAGE=S,...",
                   help="seconds each stage may spend, once ready and idle, measuring one step at a spread of "
                   "sizes, so a first request at a new size is priced from measurements (0: off; default 2; "
                   "ONEPIECE_CALIBRATE_S)")
    p.add_argument("--max-adapters", type=int, default=None, metavar="N",
                   help="LoRA adapters each denoise instance keeps loaded (an LRU; default: ONEPIECE_MAX_ADAPTERS or 8)")
    p.add_argument("--stage-time", default=None, metavar="STAGE=S,...",
                   help="benchmarks/tests: each run of a stage takes at least S seconds (default: ONEPIECE_STAGE_TIME_S)")
    p.add_argument("--stage-stretch", default=None, metavar="STAGE=F,...",
                   help="benchmarks/tests: multiply a stage's compute time by F (default: ONEPIECE_STAGE_STRETCH)")
    p.add_argument("--step-time", default=None, metavar="STAGE=S,...",
                   help="benchmarks/tests: add S seconds after each denoising step (default: ONEPIECE_STEP_TIME_S)")


def settings_from(args: argparse.Namespace, etcd_url: str, redis_url: str) -> NodeSettings:
    """The node's settings: each option, else its ``ONEPIECE_*`` variable, else the default. Raises
    ValueError (or KeyError) for a value that does not parse."""
    from engine.worker.config import Batching, Calibration, StageTiming
    from engine.worker.priority import parse_nice
    from engine.worker.taskmanager import NodeSettings
    from engine.worker.threads import parse_threads

    timing = StageTiming.parse(args.stage_time or envs.STAGE_TIME_S, args.stage_stretch or envs.STAGE_STRETCH,
                               args.step_time or envs.STEP_TIME_S)
    threads = parse_threads(args.threads_per_instance if args.threads_per_instance is not None
                            else envs.THREADS_PER_INSTANCE)
    nice = parse_nice(args.worker_nice if args.worker_nice is not None else envs.WORKER_NICE)
    return NodeSettings(
        node=args.node or envs.NODE_NAME or socket.gethostname(), etcd_url=etcd_url, redis_url=redis_url,
        run_dir=(args.run_dir or envs.STATE_DIR / "node").resolve(), ring_prefix=args.ring_prefix,
        ring_slots=args.ring_slots or min(envs.RING_SLOTS, 256), ring_bytes=args.ring_bytes or envs.RING_BYTES,
        lease_ttl_s=envs.NODE_LEASE_TTL_S, deliver=args.deliver or envs.DELIVER,
        progress_interval_s=envs.PROGRESS_INTERVAL_MS / 1000, result_ttl_s=envs.RESULT_TTL_S,
        route_refresh_s=envs.ROUTE_REFRESH_S, timing=timing, transport=args.transport or envs.TRANSPORT,
        data_host=args.data_host or envs.BIND_HOST, workflow_set=args.workflow_set or envs.WORKFLOW_SET,
        threads_per_instance=threads, worker_nice=nice,
        batching=Batching.parse(args.max_batch or envs.MAX_BATCH, args.batch_wait_ms or envs.BATCH_WAIT_MS,
                                 args.max_held or envs.MAX_HELD),
        calibration=Calibration.parse(args.calibrate_s if args.calibrate_s is not None else envs.CALIBRATE_S),
    )


def run(args: argparse.Namespace) -> int:
    import logging

    from engine.coord import redact
    from engine.worker.config import Assignment
    from engine.worker.taskmanager import TaskManager

    logging.basicConfig(level=logging.INFO, format="%(asctime)s node %(levelname)s %(message)s")
    etcd_url, redis_url = args.etcd_url or envs.ETCD_URL, args.redis_url or envs.REDIS_URL
    if not etcd_url or not redis_url:
        print("error: --etcd-url and --redis-url (or ONEPIECE_ETCD_URL / ONEPIECE_REDIS_URL) are required")
        return 2
    try:
        settings = settings_from(args, etcd_url, redis_url)
    except (ValueError, KeyError) as exc:
        print(f"error: {exc}")
        return 2
    if settings.transport == "verbs":  # the device proves itself (loopback atomics) before anything starts
        from engine.transport.verbs import preflight
        from engine.transport.verbs_selftest import SelfTestFailed

        try:
            print(f"node: {preflight().summary()}", flush=True)
        except SelfTestFailed as exc:
            print(f"error: {exc}")
            return 2
    if args.max_adapters is not None:  # the stage workers read it (engine.envs.MAX_ADAPTERS) from the environment
        if args.max_adapters < 1:
            print("error: --max-adapters must be at least 1")
            return 2
        os.environ["ONEPIECE_MAX_ADAPTERS"] = str(args.max_adapters)
    node = settings.node
    static = Assignment.from_json(args.assignment.read_text()) if args.assignment else None
    stop = {"flag": False}

    def _on_signal(signum: int, frame: object) -> None:
        stop["flag"] = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    manager = TaskManager(settings, static)
    manager.start()
    print(f"node: {node} (etcd {redact(etcd_url)}, logs {settings.run_dir / 'logs'})", flush=True)
    try:
        manager.run(lambda: stop["flag"])
    finally:
        manager.shutdown()
    print("node stopped", flush=True)
    return 0
