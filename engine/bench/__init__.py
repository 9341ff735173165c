"""``onepiece bench``: benchmarks that print ratios against baselines run in the same process and run."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    t = sub.add_parser(
        "transport",
        help="ring vs memcpy, pyzmq ipc and multiprocessing.Queue between two processes",
        description="One-way throughput and round trip of the ring against memcpy (the limit), pyzmq over "
        "ipc and multiprocessing.Queue, interleaved in one run; plus CAS rate and 1-vs-4 producers.",
    )
    t.add_argument("--json", action="store_true", help="print a JSON list of records instead of a table")
    t.add_argument("--sizes", nargs="+", help="message sizes in bytes (default: 4 KiB, 64 KiB, 1, 16, 64 MiB)")
    t.add_argument("--transports", nargs="+", choices=["memcpy", "ring", "zmq-ipc", "mp-queue"])
    t.add_argument("--repeat", type=int, default=3, help="interleaved repetitions per size (median reported)")
    t.add_argument("--budget-mib", type=int, default=512, help="bytes per throughput run, in MiB")
    t.add_argument("--skip-contention", action="store_true", help="skip the CAS and multi-producer figures")


    r = sub.add_parser(
        "rebalance",
        help="allocator decisions at cluster scale: static vs rebalanced after a load shift (simulation)",
        description="Sizes the stages of wan2.1-i2v for two request mixes with the Node Manager's allocator, "
        "simulates the second mix on both allocations, and times a decision at 1,000 devices.",
    )
    r.add_argument("--devices", type=int, default=64, help="device budget for the two allocations")
    r.add_argument("--requests", type=int, default=4000, help="simulated requests per run")
    r.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace) -> int:
    if args.bench == "transport":
        from engine.bench.transport import main

        return main(args)
    if args.bench == "rebalance":
        from engine.bench.rebalance import main as rebalance_main

        return rebalance_main(args)
    raise SystemExit(f"unknown benchmark {args.bench!r}")
