"""``onepiece bench``: benchmarks that print ratios against baselines run in the same process and run.

Each benchmark is a module of this package with ``add_arguments(parser)`` (its flags) and
``main(args) -> int``; modules import only the standard library and light engine modules at the top,
so ``onepiece --help`` stays fast (numpy, torch and clients are imported inside ``main``).
"""

from __future__ import annotations

import argparse
import importlib

# name -> (module, help, description)
BENCHES: dict[str, tuple[str, str, str]] = {
    "transport": (
        "engine.bench.transport",
        "ring vs memcpy, pyzmq ipc and multiprocessing.Queue between two processes",
        "One-way throughput and round trip of the ring against memcpy (the limit), pyzmq over "
        "ipc and multiprocessing.Queue, interleaved in one run; plus CAS rate and 1-vs-4 producers.",
    ),
    "rebalance": (
        "engine.bench.rebalance",
        "allocator decisions at cluster scale: static vs rebalanced after a load shift (simulation)",
        "Sizes the stages of wan2.1-i2v for two request mixes with the Node Manager's allocator, "
        "simulates the second mix on both allocations, and times a decision at 1,000 devices.",
    ),
    "e2e": (
        "engine.bench.e2e",
        "a live engine end to end vs the one-call pipeline; open-loop load at 0.5x-10x capacity",
        "Against a running engine (the proxy: line of `onepiece up`): warm latency through the "
        "stages vs the one-call diffusers pipeline on the same model folder, measured capacity, and open-loop "
        "load at 0.5x, 1x, 2x and 10x of it.",
    ),
    "resources": (
        "engine.bench.resources",
        "devices needed vs target throughput: monolithic vs OnePiece (the paper's 16x claim), simulated "
        "and validated against the real engine",
        "For a stage profile, the fewest devices meeting a p99 latency objective at each target "
        "throughput, monolithic (every device serves the whole pipeline) vs OnePiece (per-stage instances sized "
        "by the Node Manager's allocator), by discrete-event simulation; sensitivity to the diffusion share, "
        "steps, video length and request mix; and the simulation checked against the real engine on this "
        "machine (tiny models, stretched stage times). Writes a table, JSON and a PNG plot to --out-dir.",
    ),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, (module, help_text, description) in BENCHES.items():
        b = sub.add_parser(name, help=help_text, description=description)
        b.set_defaults(_bench_module=module)
        importlib.import_module(module).add_arguments(b)


def run(args: argparse.Namespace) -> int:
    return int(importlib.import_module(args._bench_module).main(args) or 0)
