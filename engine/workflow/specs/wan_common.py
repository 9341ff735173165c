"""What the Wan2.1 workflows (image-to-video and text-to-video) share: limits, dimensions, parameters,
and the stages that are the same code on the same components (umT5, the Wan VAE, the mp4 encoder)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from engine.workflow import limits
from engine.workflow.spec import CostModel, InvalidRequest, ParamSpec, StageSpec, TensorSpec, WorkflowSpec
from engine.workflow.specs.common import (
    MAX_PROMPT_CHARS,
    require_multiple,
    require_pixels,
    require_prompt,
)

# Wan2.1's VAE compresses 4x in time and 8x in space; its transformer patches
# 2x2 latent pixels, so pixel sizes must be multiples of 16.
TEMPORAL = 4
SPATIAL = 8
SIZE_MULTIPLE = 16
MAX_PIXELS = 1280 * 720
MAX_FRAMES = 129
MAX_STEPS = 100
P = "engine.stages.wan"
LATENT = (1, "C_lat", "T_lat", "H_lat", "W_lat")


def derive(p: Mapping[str, Any], spatial: int = SPATIAL) -> dict[str, int]:
    """The dimensions of a request; ``spatial``: the VAE's spatial compression (Wan2.2's VAE: 16)."""
    return {
        "F": p["num_frames"], "H": p["height"], "W": p["width"], "L_text": p["max_sequence_length"],
        "T_lat": (p["num_frames"] - 1) // TEMPORAL + 1, "H_lat": p["height"] // spatial,
        "W_lat": p["width"] // spatial, "S": p["num_inference_steps"],
    }


def checker(workflow: str, multiple: int = SIZE_MULTIPLE,
            max_pixels: int = MAX_PIXELS) -> Callable[[Mapping[str, Any]], None]:
    """The request rules of a Wan workflow named ``workflow`` (named in its messages); ``multiple``: what
    sides must be multiples of (the VAE's spatial factor times the patch), ``max_pixels``: the largest frame."""
    def check(p: Mapping[str, Any]) -> None:
        require_prompt(p)
        if (p["num_frames"] - 1) % TEMPORAL:
            raise InvalidRequest("num_frames", f"num_frames - 1 must be divisible by {TEMPORAL} (e.g. 5, 9, ..., 81), "
                                 f"got {p['num_frames']}")
        require_multiple(p, "height", multiple)
        require_multiple(p, "width", multiple)
        require_pixels(p, max_pixels, workflow)

    return check


def model_limits(configs: limits.Configs, params: tuple[ParamSpec, ...] | None = None,
                 multiple: int = SIZE_MULTIPLE) -> limits.Overrides:
    """What the loaded Wan transformer and VAE allow: its rotary embedding covers ``rope_max_seq_len``
    patches per axis (frames, height, width), so a side may span at most ``rope_max_seq_len x patch x
    the VAE's spatial factor`` pixels and a clip ``(rope_max_seq_len / patch_t - 1) x temporal + 1``
    frames. Defaults that do not fit (the pipeline's 832x480; ``params``' defaults where given) shrink to fit,
    keeping their aspect, to sides that are multiples of ``multiple``."""
    out: limits.Overrides = {}
    tr, vae = configs.get("transformer") or {}, configs.get("vae") or {}
    rope = tr.get("rope_max_seq_len")
    if not isinstance(rope, int) or rope < 1:
        return out
    pt, ph, pw = (list(tr.get("patch_size") or (1, 2, 2)) + [1, 2, 2])[:3]
    spatial = int(vae.get("scale_factor_spatial") or 2 ** len(vae.get("temperal_downsample") or [0, 0, 0]))
    temporal = int(vae.get("scale_factor_temporal") or 2 ** sum(bool(x) for x in vae.get("temperal_downsample") or []))
    src = f"the loaded transformer's rope_max_seq_len is {rope}"
    for name, patch in (("height", ph), ("width", pw)):
        limits.tighten(out, name, rope * patch * spatial, f"{src}: at most {rope} patches of {patch * spatial} px")
    frames = (rope // max(1, pt) - 1) * temporal + 1
    limits.tighten(out, "num_frames", frames, f"{src}: at most {rope // max(1, pt)} latent frames")
    default = {p.name: p.default for p in (PARAMS if params is None else params)}
    height, width = default["height"], default["width"]
    scale = min(1.0, out["width"]["maximum"] / width, out["height"]["maximum"] / height)
    if scale < 1.0:  # both sides shrink by the same factor: the default clip keeps its shape
        out["width"]["default"] = limits.fit_default(int(width * scale), out["width"]["maximum"], multiple)
        out["height"]["default"] = limits.fit_default(int(height * scale), out["height"]["maximum"], multiple)
    out["num_frames"]["default"] = min(default["num_frames"], frames)
    return out


# the components whose configs size the values that cross stages (model_dims), besides the limits' own
DIM_COMPONENTS = ("vae", "text_encoder", "scheduler")


def model_dims(configs: limits.Configs) -> dict[str, int]:
    """The model dimensions of the Wan value shapes, from the loaded configs: the VAE's latent channels
    (``C_lat``; the I2V condition adds one mask channel per frame the VAE folds in time: ``C_cond``), the
    umT5 width (``D_text``) and the number of model outputs UniPC keeps (``N_order``: its solver order).
    Wan2.1 I2V's CLIP tokens (``N_img``, ``D_img``) are not bound: its hops are sized without them."""
    vae, text, scheduler = (configs.get(c) or {} for c in DIM_COMPONENTS)
    out: dict[str, int] = {}
    z, temporal = vae.get("z_dim"), vae.get("scale_factor_temporal", TEMPORAL)
    if isinstance(z, int) and isinstance(temporal, int):
        out["C_lat"], out["C_cond"] = z, z + temporal
    if isinstance(text.get("d_model"), int):
        out["D_text"] = text["d_model"]
    if isinstance(scheduler.get("solver_order"), int):
        out["N_order"] = scheduler["solver_order"]
    return out


def tokens(d: Mapping[str, int]) -> float:
    # Latent tokens after 2x2 patching; attention makes cost superlinear, but
    # within the supported sizes a linear fit is within the measurement noise.
    return d["T_lat"] * (d["H_lat"] // 2) * (d["W_lat"] // 2)


TEXT_ENCODE = StageSpec(
    "text_encode", f"{P}.encoders.WanTextEncode", inputs=(),
    outputs=(TensorSpec("prompt_embeds", shape=(1, "L_text", "D_text")),
             TensorSpec("negative_prompt_embeds", shape=(1, "L_text", "D_text"))),
    doc="umT5 prompt and negative-prompt embeddings",
    # requests of one max_sequence_length encode together, each item its solo bytes
    # (tests/engine/stages/test_light_batching.py; gain: benchmarks/light_batching.md)
    max_batch=8,
)
VAE_DECODE = StageSpec(
    "vae_decode", f"{P}.decoders.WanVaeDecode", inputs=("denoised",),
    outputs=(TensorSpec("frames", "uint8", ("F", "H", "W", 3)),),
    doc="de-normalised VAE decode to uint8 RGB frames",
)
VIDEO_ENCODE = StageSpec(
    "video_encode", f"{P}.video.WanVideoEncode", inputs=("frames",),
    outputs=(TensorSpec("video", kind="blob", doc="mp4 (H.264) bytes"),), doc="frames to mp4",
)

PARAMS = (
    ParamSpec("prompt", str, None, doc="what the video shows", max_length=MAX_PROMPT_CHARS),
    ParamSpec("negative_prompt", str, "", doc="what it should not show", max_length=MAX_PROMPT_CHARS),
    ParamSpec("height", int, 480, SIZE_MULTIPLE, 1280),
    ParamSpec("width", int, 832, SIZE_MULTIPLE, 1280),
    ParamSpec("num_frames", int, 81, 1, MAX_FRAMES, doc="frames; num_frames - 1 divisible by 4"),
    ParamSpec("num_inference_steps", int, 50, 1, MAX_STEPS),
    ParamSpec("guidance_scale", float, 5.0, 0.0, 50.0),
    ParamSpec("seed", int, 0, 0, 2**63 - 1),
    ParamSpec("fps", int, 16, 1, 60),
    ParamSpec("max_sequence_length", int, 512, 1, 512),
)

# the smallest clip: every stage loads and runs once
WARM_UP = {"prompt": "warm-up", "height": 64, "width": 64, "num_frames": TEMPORAL + 1, "num_inference_steps": 1}

# Priors of the shared stages on one H100-class GPU (see each workflow's costs).
COSTS = {
    "text_encode": CostModel(0.3, 0.0, lambda d: 0.0),
    "vae_decode": CostModel(0.5, 4.0e-5, lambda d: d["F"] * d["H_lat"] * d["W_lat"], growth=2.0),  # attends per frame
    # H.264 on the host's CPU, linear in the pixels: about 1.6 s for 81 frames of 832x480 (5e-8 s a pixel;
    # the 2-core Xeon encodes the tiny model's noise-like 224x128 frames at 1.2e-7)
    "video_encode": CostModel(0.05, 5.0e-8, lambda d: d["F"] * d["H"] * d["W"]),
}


def wan_workflow(name: str, description: str, middle: tuple[StageSpec, ...], costs: Mapping[str, CostModel],
                 request_inputs: tuple[TensorSpec, ...] = (), params: tuple[ParamSpec, ...] = PARAMS,
                 derive: Callable[[Mapping[str, Any]], dict[str, int]] = derive,
                 check: Callable[[Mapping[str, Any]], None] | None = None,
                 model_limits: Callable[[limits.Configs], limits.Overrides] = model_limits,
                 limit_components: tuple[str, ...] = ("transformer", "vae"), default: bool = False) -> WorkflowSpec:
    """A Wan workflow: text_encode, then ``middle`` (ending in denoise), then vae_decode and video_encode;
    ``costs`` covers the stages of ``middle``. Wan2.1's parameters, rules and limits unless given (Wan2.2)."""
    return WorkflowSpec(
        name=name, description=description, request_inputs=request_inputs,
        stages=(TEXT_ENCODE, *middle, VAE_DECODE, VIDEO_ENCODE), params=params, derive=derive,
        check=checker(name) if check is None else check, costs={**COSTS, **costs}, final_output="video",
        frame_step=TEMPORAL, warm_up=WARM_UP, model_limits=model_limits, model_dims=model_dims,
        limit_components=tuple(dict.fromkeys((*limit_components, *DIM_COMPONENTS))),
        step_cache=True,  # engine.stages.caching: TaylorSeer lite, a cache per guidance pass (and expert stage)
        default=default,
    )
