"""The ``onepiece`` command line.

Each subcommand lives in its own module and is imported only when it runs, so
``onepiece --help`` stays fast and never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from engine import __version__

# name -> (module that defines ``add_arguments(parser)`` and ``run(args) -> int``, help)
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("onepiece_launcher.up", "run everything on this machine with embedded defaults"),
    "node": ("engine.worker.node_cli", "run this machine's TaskManager (stage instances and their rings)"),
    "proxy": ("engine.proxy.cli", "serve the request intake (UIDs, admission control, status, cancel)"),
    "manager": ("engine.manager.cli", "run a Node Manager replica (leader-elected through etcd)"),
    "etcd-auth": ("engine.coord.auth", "enable etcd authentication for the engine (a deployment's one-time step)"),
    "bench": ("engine.bench", "benchmarks that print ratios against baselines run side by side"),
    "models": ("engine.stages.models_cli", "build tiny test checkpoints; check a model folder"),
    "run": ("engine.stages.run_cli", "run one request through a workflow's stages in this process"),
    "adapters": ("engine.adapters.cli", "the operators' LoRA adapter registry: add, list, remove"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="onepiece",
        description="OnePiece: serving multi-stage AIGC workflows (image-to-video, text-to-image).",
    )
    parser.add_argument("--version", action="version", version=f"onepiece {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        # Argument definitions are cheap functions on the module; importing the
        # module must therefore stay light too (heavy imports go inside run()).
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_module", None):
        parser.print_help()
        return 2
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
