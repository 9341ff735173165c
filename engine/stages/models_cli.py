"""``onepiece models``: build tiny test checkpoints, check a model folder.

Importing this module is light; torch/diffusers are imported inside ``run``.
"""

from __future__ import annotations

import argparse
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.stages.registry import adaptable
    from engine.workflow import workflows

    sub = parser.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    make = sub.add_parser(
        "make-tiny", help="write deterministic tiny random-weight checkpoints (nothing is downloaded)",
        description="Write tiny random-weight checkpoints in the published weights' folder layout. "
                    "With --workflow, --out is that model folder; without it, one sub-folder per workflow.",
    )
    make.add_argument("--out", required=True, help="output folder")
    make.add_argument("--workflow", default=None, help=f"only this workflow ({', '.join(sorted(workflows()))})")
    make.add_argument("--seed", type=int, default=0, help="weight seed (same seed -> identical files)")
    lora = sub.add_parser(
        "make-tiny-lora", help="write a deterministic random LoRA for a workflow's denoise model",
        description="Write DIR/pytorch_lora_weights.safetensors: a random LoRA (diffusers/PEFT format) on the "
                    "attention projections of the component the workflow's adapters target.",
    )
    lora.add_argument("--workflow", required=True, help=", ".join(f"{w} ({c})" for w, (c, _) in adaptable().items()))
    lora.add_argument("--out", required=True, help="output folder")
    lora.add_argument("--seed", type=int, default=0, help="weight seed (same seed -> identical file)")
    lora.add_argument("--rank", type=int, default=4, help="LoRA rank (default 4)")
    lora.add_argument("--model", default=None, help="the model folder to fit (default: the workflow's tiny model)")
    check = sub.add_parser("check", help="check that a model folder has every component a workflow needs")
    check.add_argument("model_dir", help="model folder (diffusers layout)")
    check.add_argument("--workflow", required=True, help="workflow name")


def run(args: argparse.Namespace) -> int:
    if args.models_command == "make-tiny":
        return _make_tiny(args)
    if args.models_command == "make-tiny-lora":
        return _make_tiny_lora(args)
    return _check(args)


def _make_tiny(args: argparse.Namespace) -> int:
    from engine.stages.quiet import quiet_libraries
    from engine.stages.tiny import BUILDERS, make_tiny

    quiet_libraries()  # one bar per workflow (ours), not the libraries' bar and warnings per file they write
    if args.workflow is not None and args.workflow not in BUILDERS:
        print(f"error: no tiny model for workflow {args.workflow!r}; known: {', '.join(BUILDERS)}", file=sys.stderr)
        return 2
    for name, folder in make_tiny(args.out, args.workflow, args.seed).items():
        print(f"{name}: {folder}")
    return 0


def _make_tiny_lora(args: argparse.Namespace) -> int:
    from engine.adapters.registry import AdapterError
    from engine.adapters.tiny import make_tiny_lora
    from engine.stages.quiet import quiet_libraries

    quiet_libraries()
    try:
        print(make_tiny_lora(args.workflow, args.out, args.seed, args.rank, args.model))
    except AdapterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _check(args: argparse.Namespace) -> int:
    from engine.stages.base import MissingComponent
    from engine.stages.layout import check_components
    from engine.stages.registry import needed
    from engine.workflow import get_workflow

    try:
        spec = get_workflow(args.workflow)
        components = needed(spec.name)
        check_components(args.model_dir, components)
    except KeyError as exc:
        print(f"error: {exc.args[0]}", file=sys.stderr)
        return 2
    except MissingComponent as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"ok: {args.model_dir} has every component of {spec.name}: {', '.join(components)}")
    return 0
