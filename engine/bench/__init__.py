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
    t.add_argument("--transports", nargs="+",
                   choices=["memcpy", "fused", "ring", "ring-batch", "ring-hdr", "zmq-ipc", "mp-queue"],
                   help="fused: the producer's copy-and-checksum alone; ring-batch: send_many/recv_many; "
                   "ring-hdr: a ring that checks record headers only")
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
    e = sub.add_parser(
        "e2e",
        help="a live engine end to end vs the one-call pipeline; open-loop load at 0.5x-10x capacity",
        description="Against a running engine (the proxy: line of `onepiece up`): warm latency through the "
        "stages vs the one-call diffusers pipeline on the same model folder, measured capacity, and open-loop "
        "load at 0.5x, 1x, 2x and 10x of it.",
    )
    e.add_argument("--proxy", required=True, help="the Proxy's URL (onepiece up prints it)")
    e.add_argument("--model-dir", required=True, help="the workflow's model folder, for the one-call baseline")
    e.add_argument("--workflow", default="sd-t2i", choices=["sd-t2i"])
    e.add_argument("--requests", type=int, default=10, help="sequential requests for the latency figure")
    e.add_argument("--seconds", type=float, default=15.0, help="duration of the capacity and each load run")
    e.add_argument("--poll-ms", type=float, default=None, help=argparse.SUPPRESS)  # unused since the long poll
    e.add_argument("--deadline-s", type=float, default=10.0, help="deadline every open-loop request carries")
    e.add_argument("--hog", type=int, default=0, metavar="N",
                   help="run N processes that each keep one core busy beside the engine for the whole run "
                   "(after a quiet latency measurement, reported beside it)")
    e.add_argument("--saturate", type=int, default=16, metavar="N",
                   help="requests kept in flight to measure capacity (enough to keep every stage busy)")
    e.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="device of the one-call baselines")
    e.add_argument("--json", action="store_true", help="print JSON instead of text")
    res = sub.add_parser(
        "resources",
        help="devices needed vs target throughput: monolithic vs OnePiece (the paper's 16x claim), simulated "
        "and validated against the real engine",
        description="For a stage profile, the fewest devices meeting a p99 latency objective at each target "
        "throughput, monolithic (every device serves the whole pipeline) vs OnePiece (per-stage instances sized "
        "by the Node Manager's allocator), by discrete-event simulation; sensitivity to the diffusion share, "
        "steps, video length and request mix; and the simulation checked against the real engine on this "
        "machine (tiny models, stretched stage times). Writes a table, JSON and a PNG plot to --out-dir.",
    )
    res.add_argument("--profile", default="benchmarks/resources/profiles/wan2.1-i2v-14b-480p-h200-published.json",
                     help="stage profile JSON (benchmarks/wan_fullsize_profile.py's output, or a hand-written one)")
    res.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16, 32, 64, 128, 256, 512],
                     help="target throughputs, as the devices a fully busy monolith would need for them")
    res.add_argument("--slo-x", type=float, default=2.0,
                     help="latency objective: p99 <= this x the idle end-to-end time of the longest request")
    res.add_argument("--batch", type=int, default=1, help="monolithic batch size")
    res.add_argument("--hop-ms", type=float, default=20.0, help="OnePiece cost per stage hop, besides the bytes")
    res.add_argument("--requests", type=int, default=2000, help="simulated requests per point (at least)")
    res.add_argument("--sensitivity-devices", type=int, default=64,
                     help="cluster size (in fully busy monolithic devices) for the sensitivity sweeps")
    res.add_argument("--light-occupancy", type=float, default=0.25,
                     help="what-if share of the device the light stages keep busy (the paper's idle GPUs)")
    res.add_argument("--no-sensitivity", action="store_true", help="skip the assumption and sensitivity sweeps")
    res.add_argument("--no-validate", action="store_true", help="skip the real-engine validation")
    res.add_argument("--validate-requests", type=int, default=60, help="requests per validation load")
    res.add_argument("--validate-loads", type=float, nargs="+", default=[0.3, 0.6, 0.85, 1.2],
                     help="validation loads as fractions of the engine's calibrated capacity")
    res.add_argument("--out-dir", default="benchmarks/resources", help="where the PNG, JSON and results.md go")
    res.add_argument("--json", action="store_true", help="print JSON instead of the tables")


def run(args: argparse.Namespace) -> int:
    if args.bench == "transport":
        from engine.bench.transport import main

        return main(args)
    if args.bench == "e2e":
        from engine.bench.e2e import main as e2e_main

        return e2e_main(args)
    if args.bench == "rebalance":
        from engine.bench.rebalance import main as rebalance_main

        return rebalance_main(args)
    if args.bench == "resources":
        from engine.bench.resources import main as resources_main

        return resources_main(args)
    raise SystemExit(f"unknown benchmark {args.bench!r}")
