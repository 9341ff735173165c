"""``onepiece manager``: one Node Manager replica (run two or more; one leads)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import threading


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--etcd-url", "--etcd", dest="etcd", default=None, help="etcd client URL (default: ONEPIECE_ETCD_URL)")
    p.add_argument("--name", default=None, help="this replica's name (default: host-pid)")
    p.add_argument("--workflow", action="append", default=[], metavar="NAME=MODEL_DIR",
                   help="a workflow to serve and its model folder on the nodes (repeatable)")
    p.add_argument("--slots-per-node", type=int, default=6, help="instances one node holds")
    p.add_argument("--ttl", type=int, default=3, help="leader lease TTL in seconds")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between control-loop ticks")
    p.add_argument("--min-gain", type=float, default=0.10, help="rebalance only for at least this throughput gain")
    p.add_argument("--cooldown", type=float, default=30.0, help="seconds between two rebalances")
    p.add_argument("--metrics-port", type=int, default=0, help="serve Prometheus /metrics here (0: off)")
    p.add_argument("--root", default=None,
                   help="etcd key prefix of this cluster (default: ONEPIECE_ETCD_ROOT, else /onepiece); every "
                        "process of the cluster must use the same one (ONEPIECE_ETCD_ROOT)")


def run(args: argparse.Namespace) -> int:
    from engine import envs
    from engine.coord import redact
    from engine.coord.keys import keyspace
    from engine.manager.election import Election, connect
    from engine.manager.node_manager import ManagerConfig, NodeManager
    from engine.workflow import get_workflow

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    etcd = args.etcd or envs.ETCD_URL
    if not etcd:
        print("error: no etcd: pass --etcd-url URL or set ONEPIECE_ETCD_URL", flush=True)
        return 2
    workflows = {}
    for item in args.workflow:
        name, sep, folder = item.partition("=")
        if not sep or not folder:
            print(f"error: --workflow takes NAME=MODEL_DIR, got {item!r}", flush=True)
            return 2
        try:
            get_workflow(name)
        except KeyError as exc:
            print(f"error: {exc}", flush=True)
            return 2
        workflows[name] = folder
    if not workflows:
        print("error: give at least one --workflow NAME=MODEL_DIR", flush=True)
        return 2
    name = args.name or f"{socket.gethostname()}-{os.getpid()}"
    client = connect(etcd)

    def elected(ship) -> None:
        print(f"leader: {name} (fencing token {ship.token})", flush=True)

    def deposed(ship) -> None:
        print(f"standby: {name} lost the leadership (token {ship.token})", flush=True)

    election = Election(client, name, ttl=args.ttl, key=keyspace(args.root).leader(), on_elected=elected,
                        on_deposed=deposed)
    nm = NodeManager(client, election, ManagerConfig(workflows, args.slots_per_node, min_gain=args.min_gain,
                                                     cooldown=args.cooldown, root=keyspace(args.root).root))
    if args.metrics_port:
        _serve_metrics(nm, args.metrics_port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    nm.start(args.interval)
    print(f"manager: {name} campaigning on {redact(etcd)}", flush=True)
    stop.wait()
    nm.stop()
    print("stopped", flush=True)
    return 0


def _serve_metrics(nm, port: int) -> None:
    from prometheus_client import Gauge, start_http_server

    tick = Gauge("onepiece_manager_tick_seconds", "duration of the last control-loop tick")
    leader = Gauge("onepiece_manager_is_leader", "1 while this replica leads")
    tick.set_function(lambda: nm.last_tick_seconds)
    leader.set_function(lambda: 1.0 if nm.election.is_leader else 0.0)
    start_http_server(port)
