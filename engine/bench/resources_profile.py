"""Stage profiles for ``onepiece bench resources``: per-stage time, memory and hand-on bytes.

A profile is JSON. It is either what ``benchmarks/wan_fullsize_profile.py``
writes (measured on a device: ``shape`` gives the reference request, each stage
``seconds`` per ``request`` or per denoising ``step``, ``peak_gib`` and
``hands_on_bytes``), or a hand-written file of the same shape with a few more
optional keys (``benchmarks/resources/profiles/*.json``)::

    {"name": "...", "kind": "published" | "measured" | "estimate",
     "device": "H200", "device_memory_gib": 141, "link_gbps": 200,
     "shape": {"height": 480, "width": 832, "frames": 81, "steps": 40},
     "stages": {"denoise": {"seconds": 8.8, "per": "step", "weights_gib": 32.8,
                            "activation_gib": 20, "hands_on_bytes": 8388608,
                            "batch_gain": 0.05, "kind": "estimate", "source": "..."}, ...},
     "sources": ["..."]}

How a stage's time scales with the request (``scales``, defaulted by stage name):

- ``const``: the same for every request (text and image encoders);
- ``pixels``: with frames x height x width (VAE encode/decode, mp4 encode);
- ``tokens``: the denoiser, per step, with latent tokens
  T_lat x (H/16) x (W/16): time ~ (1 - a) x + a x^2 with x = tokens / tokens_ref
  and ``a`` = ``attention_share`` (the share of attention in a step at the
  reference shape; quadratic in tokens), times the number of steps.

``batch_gain`` g in [0, 1] says what batching buys a stage: a batch of k
requests takes (1 - g) x sum(times) + g x max(times); 0 for compute-bound work
(no gain), 1 for a stage whose batch costs no more than its longest member.
``occupancy`` in (0, 1] is the share of the device a stage keeps busy while it
runs (the paper's "the GPU idles in the light stages"): a monolithic replica
holds its device for the whole request regardless; OnePiece may pack light
stages' instances onto shared devices by it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

_DEFAULT_SCALES = {"denoise": "tokens", "vae_encode": "pixels", "vae_decode": "pixels", "video_encode": "pixels",
                   "image_encode_png": "pixels"}
_CPU_STAGES = {"video_encode"}


@dataclass(frozen=True)
class Request:
    """What sets a request's cost: resolution, frames, denoising steps."""

    height: int = 480
    width: int = 832
    frames: int = 81
    steps: int = 40

    @property
    def tokens(self) -> float:
        return ((self.frames - 1) // 4 + 1) * (self.height / 16) * (self.width / 16)

    @property
    def pixels(self) -> float:
        return float(self.frames * self.height * self.width)


@dataclass(frozen=True)
class Stage:
    name: str
    seconds: float  # at the reference request; per step when per == "step"
    per: str = "request"
    scales: str = "const"
    weights_gib: float = 0.0
    activation_gib: float = 0.0
    hands_on_bytes: float = 0.0
    batch_gain: float = 0.0
    occupancy: float = 1.0  # share of the device the stage keeps busy while it runs (1: saturates it)
    device: str = "gpu"  # "cpu": runs on host cores, holds no accelerator
    kind: str = "estimate"
    source: str = ""
    # share of the request's denoising steps this stage runs (a Wan2.2 A14B expert runs the steps on its side
    # of the boundary); 1 for every other stage
    step_share: float = 1.0
    # stages of one swap group take turns on a monolithic replica's device when they do not fit together (the
    # two experts of Wan2.2 A14B): one resident at a time, the others swapped in from host memory per request
    swap_group: str = ""
    # what makes two workflows' stages one shared pool: the same executor on the same weights (their content
    # digest in the engine; here the published component's name); "" for a stage of its workflow alone
    pool: str = ""

    @property
    def memory_gib(self) -> float:
        return self.weights_gib + self.activation_gib


@dataclass(frozen=True)
class Profile:
    name: str
    stages: tuple[Stage, ...]
    reference: Request
    kind: str = "estimate"
    device: str = "unknown"
    device_memory_gib: float = 80.0
    link_gbps: float = 200.0  # RDMA link, gigabits per second
    pcie_gbps: float = 200.0  # host-to-device link (weights swapped in by a monolith that cannot hold them), Gb/s
    attention_share: float = 0.5
    sources: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.stages]

    def seconds(self, stage: str | Stage, req: Request) -> float:
        """One request's time at ``stage`` on one device (batch of one)."""
        s = self.stage(stage) if isinstance(stage, str) else stage
        ref = self.reference
        t = s.seconds
        if s.scales == "pixels":
            t *= req.pixels / ref.pixels
        elif s.scales == "tokens":
            x = req.tokens / ref.tokens
            a = self.attention_share
            t *= (1 - a) * x + a * x * x
        if s.per == "step":
            t *= req.steps * s.step_share
        return t

    def transfer_seconds(self, stage: str, req: Request) -> float:
        s = self.stage(stage)
        scale = req.pixels / self.reference.pixels if s.scales == "pixels" or stage == "vae_encode" else 1.0
        return s.hands_on_bytes * scale * 8 / (self.link_gbps * 1e9)

    def total_seconds(self, req: Request, device: str | None = None) -> float:
        return sum(self.seconds(s, req) for s in self.stages if device is None or s.device == device)

    def with_stage_seconds(self, seconds: Mapping[str, float]) -> Profile:
        return replace(self, stages=tuple(replace(s, seconds=seconds.get(s.name, s.seconds)) for s in self.stages))

    def with_occupancy(self, occupancy: float, keep: str = "denoise") -> Profile:
        """Every accelerator stage but ``keep`` set to ``occupancy``."""
        return replace(self, stages=tuple(replace(s, occupancy=occupancy) if s.name != keep and s.device == "gpu"
                                          else s for s in self.stages))

    def with_diffusion_share(self, share: float, req: Request | None = None, stage: str = "denoise") -> Profile:
        """The same profile with the other accelerator stages scaled so ``stage`` takes ``share``
        of the accelerator time of ``req`` (the reference request by default)."""
        req = req or self.reference
        d = self.seconds(stage, req)
        rest = self.total_seconds(req, "gpu") - d
        if not 0 < share < 1 or rest <= 0:
            raise ValueError(f"share must be in (0, 1) and the profile needs other stages; got {share}")
        k = d * (1 - share) / share / rest
        return replace(self, stages=tuple(
            replace(s, seconds=s.seconds * k) if s.name != stage and s.device == "gpu" else s for s in self.stages))


def _stage(name: str, d: Mapping[str, Any]) -> Stage:
    weights = d.get("weights_gib")
    act = d.get("activation_gib", 0.0)
    if weights is None:  # a measured profile gives the peak only
        weights, act = float(d.get("peak_gib") or d.get("memory_gib") or 0.0), 0.0
    return Stage(
        name=name, seconds=float(d["seconds"]), per=str(d.get("per", "request")),
        scales=str(d.get("scales", _DEFAULT_SCALES.get(name, "const"))), weights_gib=float(weights),
        activation_gib=float(act), hands_on_bytes=float(d.get("hands_on_bytes", 0.0)),
        batch_gain=float(d.get("batch_gain", 0.0)), occupancy=float(d.get("occupancy", 1.0)),
        device=str(d.get("device", "cpu" if name in _CPU_STAGES else "gpu")),
        kind=str(d.get("kind", "measured" if "runs" in d else "estimate")), source=str(d.get("source", "")),
        step_share=float(d.get("step_share", 1.0)), swap_group=str(d.get("swap_group", "")),
        pool=str(d.get("pool", "")),
    )


def from_obj(obj: Mapping[str, Any], name: str = "profile") -> Profile:
    shape = dict(obj.get("shape", {}))
    # a measured profile (wan_fullsize_profile.py) times one step; requests default to the pipeline's 50
    ref = Request(int(shape.get("height", 480)), int(shape.get("width", 832)), int(shape.get("frames", 81)),
                  int(shape.get("steps", obj.get("steps", 50))))
    stages = tuple(_stage(n, d) for n, d in obj["stages"].items())
    if not stages:
        raise ValueError("a profile needs at least one stage")
    measured = "runs" in next(iter(obj["stages"].values()))
    return Profile(
        name=str(obj.get("name", name)), stages=stages, reference=ref,
        kind=str(obj.get("kind", "measured" if measured else "estimate")), device=str(obj.get("device", "unknown")),
        device_memory_gib=float(obj.get("device_memory_gib", 80.0)), link_gbps=float(obj.get("link_gbps", 200.0)),
        pcie_gbps=float(obj.get("pcie_gbps", 200.0)),
        attention_share=float(obj.get("attention_share", 0.5)), sources=tuple(obj.get("sources", ())),
        notes=tuple(obj.get("notes", ())),
    )


def load(path: str | Path) -> Profile:
    p = Path(path)
    return from_obj(json.loads(p.read_text()), name=p.stem)


def stretched(stage_seconds: Mapping[str, float], name: str = "stretched") -> Profile:
    """A profile of fixed per-request stage times (the real-engine validation's stretched stages)."""
    return Profile(name, tuple(Stage(n, float(t), kind="chosen") for n, t in stage_seconds.items()),
                   Request(steps=1), kind="chosen", device="cpu (stretched)")
