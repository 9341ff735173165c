"""``onepiece run``: one request through a workflow's stage executors, in this process.

For trying a model without any service. Every input is checked before a stage
loads: bad input exits with status 2 and one ``error:`` line. Importing this
module is light; torch/diffusers are imported inside ``run``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from engine.workflow import default_workflow, workflows
    from engine.workflow.registry import takes_image

    specs = workflows()
    parser.add_argument("workflow", help=", ".join(
        f"{n} ({'image + ' if takes_image(s) else ''}prompt -> {s.final_output})" for n, s in sorted(specs.items())))
    parser.add_argument("--model-dir", required=True, help="model folder in the diffusers layout "
                        "(real weights or `onepiece models make-tiny`)")
    parser.add_argument("--out", required=True, help="output file (.mp4 for a video workflow, .png for an image one)")
    parser.add_argument("--image", help="first frame, for a workflow that takes one (" + ", ".join(
        n for n, s in sorted(specs.items()) if any(t.media == "image" for t in s.request_inputs)) + ")")
    parser.add_argument("--prompt", help="text prompt (required)")
    parser.add_argument("--negative-prompt", help="negative prompt")
    parser.add_argument("--seed", type=int, help="random seed (default 0)")
    parser.add_argument("--steps", type=int, help="denoising steps (workflow default if omitted)")
    parser.add_argument("--frames", type=int, help="video workflows: frames, with frames - 1 divisible by 4")
    parser.add_argument("--size", help="WxH in pixels, e.g. 832x480 (workflow default if omitted)")
    parser.add_argument("--guidance", type=float, help="classifier-free guidance scale")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), help="default: ONEPIECE_DEVICE or auto")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    i2v, t2v = default_workflow("video", True), default_workflow("video")
    parser.epilog = (f"tiny demo: onepiece models make-tiny --out m && onepiece run {i2v} --model-dir "
                     f"m/{i2v} --image in.png --prompt 'a cat' --size 64x64 --frames 9 --steps 3 --out o.mp4; "
                     f"text-to-video: onepiece run {t2v} --model-dir m/{t2v} --prompt 'a cat' --size 64x64 "
                     "--frames 9 --steps 3 --out t.mp4")


class UsageError(Exception):
    """Bad command-line input; printed as ``error: ...`` with exit status 2."""


def _parse_size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise UsageError(f"--size must look like WIDTHxHEIGHT (e.g. 832x480), got {text!r}") from None
    return w, h


def build_request(args: argparse.Namespace) -> tuple[str, dict[str, Any], dict[str, bytes]]:
    """Turn arguments into (workflow, params, inputs); raises :class:`UsageError` or spec errors."""
    from engine.workflow import get_workflow

    try:
        spec = get_workflow(args.workflow)
    except KeyError as exc:
        raise UsageError(exc.args[0]) from None
    names = {p.name for p in spec.params}
    params: dict[str, Any] = {}
    for flag, key, value in (
        ("--prompt", "prompt", args.prompt), ("--negative-prompt", "negative_prompt", args.negative_prompt),
        ("--seed", "seed", args.seed), ("--steps", "num_inference_steps", args.steps),
        ("--frames", "num_frames", args.frames), ("--guidance", "guidance_scale", args.guidance),
    ):
        if value is None:
            continue
        if key not in names:
            raise UsageError(f"{spec.name} takes no {flag}")
        params[key] = value
    if args.size is not None:
        params["width"], params["height"] = _parse_size(args.size)
    inputs: dict[str, bytes] = {}
    wants_image = "image" in spec.image_inputs()
    if args.image is not None and not wants_image:
        raise UsageError(f"{spec.name} takes no --image")
    if wants_image and (args.image is not None or "image" in spec.required_inputs()):  # ti2v: optional
        if args.image is None:
            raise UsageError(f"{spec.name} needs --image PATH (the first frame)")
        path = Path(args.image)
        try:
            inputs["image"] = path.read_bytes()
        except OSError as exc:
            raise UsageError(f"cannot read --image {path}: {exc.strerror or exc}") from None
    return spec.name, params, inputs


def run(args: argparse.Namespace) -> int:
    from engine.stages.base import InvalidInput, MissingComponent, StageError
    from engine.workflow import InvalidRequest

    try:
        workflow, params, inputs = build_request(args)
        from engine.stages.runner import validate_request

        resolved = validate_request(workflow, args.model_dir, params, inputs)
    except UsageError as exc:
        return _fail(str(exc))
    except InvalidRequest as exc:
        if exc.field == "image" and args.image:
            return _fail(f"{exc} ({args.image})")
        return _fail(f"{exc} (parameter {exc.field})")
    except MissingComponent as exc:
        return _fail(str(exc))
    try:
        return _execute(args, workflow, resolved, inputs)
    except (InvalidInput, MissingComponent) as exc:
        return _fail(str(exc))
    except StageError as exc:
        return _fail(str(exc), 1)


def _fail(message: str, code: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def _execute(args: argparse.Namespace, workflow: str, params: dict[str, Any], inputs: dict[str, bytes]) -> int:
    import time

    from tqdm import tqdm

    from engine.stages.quiet import quiet_libraries
    from engine.stages.runner import LocalRunner

    quiet_libraries()  # per-component "Loading weights" bars would drown our own progress bar
    t0 = time.perf_counter()
    print(f"loading {workflow} stages from {args.model_dir} ...", file=sys.stderr)
    runner = LocalRunner(workflow, args.model_dir, args.device)
    bar = tqdm(total=params["num_inference_steps"], desc="denoise", unit="step", disable=args.no_progress)

    def progress(stage: str, step: int, total: int) -> None:
        bar.update(step - bar.n)

    try:
        result = runner.run(params, inputs, progress=progress)
    finally:
        bar.close()
    final = runner.spec.final_output
    Path(args.out).write_bytes(bytes(result.outputs[final]))
    for name, s in result.stats.items():
        print(f"  {name:13s} load {s.load_s * 1e3:8.1f} ms  compute {s.compute_s * 1e3:8.1f} ms  "
              f"hands on {s.out_bytes:>10,d} B", file=sys.stderr)
    print(f"wrote {args.out} ({Path(args.out).stat().st_size:,d} bytes) in {time.perf_counter() - t0:.1f} s")
    return 0
