"""``onepiece adapters add|list|remove``: the operators' LoRA registry (engine.adapters.registry).

Torch-free: adding validates the file (or the weights file of a diffusers LoRA
folder) from its safetensors header against the workflow's denoise model
weights, copies it into the adapter store and records its digest; a client then
names it in a request's ``lora`` field. A refused file is one ``error:`` line on
stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", default=None,
                        help="adapter store folder (default: ONEPIECE_ADAPTER_STORE or <state dir>/adapters)")
    sub = parser.add_subparsers(dest="adapters_command", metavar="ACTION", required=True)
    add = sub.add_parser("add", help="validate a LoRA file (or diffusers LoRA folder) and register it for a "
                                     "workflow")
    add.add_argument("name", help="the name clients use (a-z, 0-9, '_', '.', '-'; at most 64)")
    add.add_argument("path", help="the adapter's .safetensors file (diffusers/PEFT LoRA format), or the folder "
                                  "diffusers' save_lora_weights writes (its pytorch_lora_weights.safetensors, else "
                                  "its one .safetensors file)")
    add.add_argument("--workflow", required=True, help="the workflow whose denoise model it adapts")
    add.add_argument("--scale-default", type=float, default=1.0,
                     help="the scale a request that names no scale gets (default 1.0)")
    add.add_argument("--model", default=None,
                     help="the workflow's model folder to check the targets against (default: "
                          "<state dir>/models/<workflow>, where onepiece up keeps it)")
    ls = sub.add_parser("list", help="the registered adapters")
    ls.add_argument("--workflow", default=None, help="only this workflow's")
    ls.add_argument("--json", action="store_true", help="JSON lines, with the stored file")
    rm = sub.add_parser("remove", help="forget an adapter (its file goes with it)")
    rm.add_argument("name")


def run(args: argparse.Namespace) -> int:
    from engine import envs
    from engine.adapters.registry import AdapterError, store

    reg = store(args.store)
    if args.adapters_command == "add":
        model = Path(args.model) if args.model else envs.STATE_DIR / "models" / args.workflow
        try:
            a = reg.add(args.name, args.path, args.workflow, model, args.scale_default)
        except AdapterError as exc:
            print(f"error: {exc.field}: {exc}", file=sys.stderr)
            return 2
        print(f"added {a.name} for {a.workflow}: rank {a.rank}, {len(a.targets)} target modules, "
              f"sha256 {a.digest}")
        return 0
    if args.adapters_command == "list":
        for a in reg.list(args.workflow):
            if args.json:
                print(json.dumps({**a.public(), "file": str(reg.root / a.file), "bytes": a.bytes}))
            else:
                print(f"{a.name}\t{a.workflow}\trank {a.rank}\t{len(a.targets)} targets\tscale {a.scale_default:g}"
                      f"\t{a.digest[:12]}")
        return 0
    if not reg.remove(args.name):
        print(f"error: no adapter named {args.name!r}", file=sys.stderr)
        return 2
    print(f"removed {args.name}")
    return 0
