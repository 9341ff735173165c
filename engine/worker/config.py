"""What a node runs: its instances (the assignment) and how their rings are sized.

An assignment is JSON, kept in etcd under ``<root>/assignments/<node>`` (the
keyspace is engine.coord's). The leading Node Manager writes it, fenced with
its token; ``onepiece up`` and ``onepiece node --config`` write a static one
first (:func:`default_assignment`), which the Node Manager takes over::

    {"instances": [{"id": "sd-t2i.denoise.0", "workflow": "sd-t2i", "stage": "denoise",
                    "device": "cpu", "step_delay_s": 0.0, "workflow_set": "default"},
                   {"id": "wan2.1-i2v.text_encode.0", "workflow": "wan2.1-i2v", "stage": "text_encode",
                    "also": ["wan2.1-t2v/text_encode"]}, ...],
     "model_dirs": {"sd-t2i": "/models/sd-t2i", ...}, "deliver": {"sd-t2i": "least-outstanding"}}

An instance with ``also`` serves a stage pool shared across workflows (:mod:`engine.workflow.pools`):
``workflow``/``stage`` name the pool (its first member, whose folder it loads), ``also`` the other members.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.stages.registry import pools
from engine.workflow import get_workflow
from engine.workflow.pools import Pool


@dataclass(frozen=True)
class InstanceSpec:
    """One stage instance. ``step_delay_s`` adds a sleep after every denoising step (demos and tests
    that need a request to stay mid-denoise for a while; 0 in production): the worker process then
    serves its executor through :class:`engine.worker.stretch.StretchedExecutor`."""

    id: str
    workflow: str
    stage: str
    device: str | None = None
    step_delay_s: float = 0.0
    workflow_set: str = "default"  # the Workflow Set it serves (engine.manager.sets): routes stay inside it
    also: tuple[str, ...] = ()  # "workflow/stage" of the pool's other members (a pool shared across workflows)

    def __post_init__(self) -> None:
        get_workflow(self.workflow).stage(self.stage)  # KeyError for an unknown workflow or stage
        if not self.id or "/" in self.id or len(self.id) > 100:
            raise ValueError(f"instance id must be 1-100 characters without '/', got {self.id!r}")
        object.__setattr__(self, "also", tuple(self.also))  # JSON gives a list
        for member in self.also:
            wf, _, st = member.partition("/")
            get_workflow(wf).stage(st)
        if len(set(self.members)) != len(self.members):
            raise ValueError(f"instance {self.id}: a member is listed twice: {self.members}")

    @property
    def members(self) -> tuple[tuple[str, str], ...]:
        """Every (workflow, stage) this instance serves, its own first."""
        return ((self.workflow, self.stage), *(tuple(m.split("/", 1)) for m in self.also))  # type: ignore[misc]

    def workflows(self) -> list[str]:
        return [w for w, _ in self.members]


@dataclass(frozen=True)
class Assignment:
    """The desired instances of one node, their model folders and delivery policies."""

    instances: tuple[InstanceSpec, ...] = ()
    model_dirs: dict[str, str] = field(default_factory=dict)
    deliver: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ids = [i.id for i in self.instances]
        if len(ids) != len(set(ids)):
            raise ValueError(f"duplicate instance ids in assignment: {sorted(ids)}")
        for i in self.instances:
            for w in i.workflows():
                if w not in self.model_dirs:
                    raise ValueError(f"instance {i.id}: no model folder for workflow {w!r}")

    def to_json(self) -> str:
        return json.dumps({"instances": [asdict(i) for i in self.instances], "model_dirs": self.model_dirs,
                           "deliver": self.deliver}, sort_keys=True)

    @classmethod
    def from_obj(cls, obj: dict[str, Any]) -> Assignment:
        return cls(tuple(InstanceSpec(**i) for i in obj.get("instances", ())), dict(obj.get("model_dirs", {})),
                   dict(obj.get("deliver", {})))

    @classmethod
    def from_json(cls, text: str | bytes) -> Assignment:
        return cls.from_obj(json.loads(text))


def parse_stage_map(text: str | None, what: str) -> dict[str, float]:
    """``"denoise=0.2,sd-t2i/vae_decode=0.05"`` -> {"denoise": 0.2, "sd-t2i/vae_decode": 0.05}.

    Keys are a stage name (every workflow) or ``workflow/stage``; values are
    non-negative numbers. Raises ValueError naming ``what`` on bad text.
    """
    out: dict[str, float] = {}
    for part in (text or "").replace(";", ",").split(","):
        part = part.strip()
        if not part:
            continue
        key, eq, value = part.partition("=")
        key = key.strip()
        try:
            number = float(value)
        except ValueError:
            number = -1.0
        if not eq or not key or number < 0:
            raise ValueError(f"{what}: expected STAGE=NUMBER or WORKFLOW/STAGE=NUMBER (>= 0), got {part!r}")
        wf, _, st = key.rpartition("/")
        if wf:
            try:
                get_workflow(wf).stage(st)
            except KeyError as exc:
                raise ValueError(f"{what}: {part!r}: {exc.args[0] if exc.args else exc}") from None
        out[key] = number
    return out


def per_stage(m: dict[str, float], workflow: str, stage: str, default: float) -> float:
    """A per-stage flag's value for one stage: ``workflow/stage`` wins over ``stage``, over ``default``."""
    return m.get(f"{workflow}/{stage}", m.get(stage, default))


@dataclass(frozen=True)
class StageTiming:
    """Stage times stretched to a chosen profile: for benchmarks, the simulation's validation and
    tests where the bottleneck must be clear on a CPU-only machine (0 / 1: off, the production default).

    Each run of a stage takes at least ``floor_s`` seconds and at least ``factor`` times its compute
    time, and each denoising step ``step_s`` seconds more. The TaskManager passes a stage's figures to
    its worker process (``WorkerConfig.stage_time_s``, ``stage_stretch``, ``step_delay_s``), which then
    wraps its executor (:mod:`engine.worker.stretch`): the wrapper sleeps for the difference, so a
    stretched stage occupies its instance (like a GPU kernel would) without taking a CPU core from the
    other workers, and the TaskWorker's loop has no test branches.
    """

    floor_s: dict[str, float] = field(default_factory=dict)
    factor: dict[str, float] = field(default_factory=dict)
    step_s: dict[str, float] = field(default_factory=dict)  # a sleep after every denoising step

    @classmethod
    def parse(cls, floor_text: str | None, factor_text: str | None, step_text: str | None = None) -> StageTiming:
        return cls(parse_stage_map(floor_text, "stage time"), parse_stage_map(factor_text, "stage stretch"),
                   parse_stage_map(step_text, "step time"))

    def step_for(self, workflow: str, stage: str) -> float:
        """Seconds added after each denoising step: a stage time that grows with the request's steps, as
        on a GPU (a load shift from short to long requests moves the bottleneck)."""
        return per_stage(self.step_s, workflow, stage, 0.0)

    def for_stage(self, workflow: str, stage: str) -> tuple[float, float]:
        """(floor seconds, factor) for one stage; ``workflow/stage`` wins over ``stage``."""
        return per_stage(self.floor_s, workflow, stage, 0.0), per_stage(self.factor, workflow, stage, 1.0)


@dataclass(frozen=True)
class Batching:
    """Step-level batching per stage (``onepiece node --max-batch STAGE=N --batch-wait-ms STAGE=T
    --max-held STAGE=H``): at most N requests share a step, a new batch waits T ms after its oldest request
    for more (0: joiners come at step boundaries), and at most H requests are active at once (the higher
    priorities' step groups and the lower ones paused between steps; >= N, default 2N). Keys are a stage or
    ``workflow/stage``; unset stages take the spec's ``max_batch``, 0 and 2N."""

    max_batch: dict[str, float] = field(default_factory=dict)
    wait_ms: dict[str, float] = field(default_factory=dict)
    max_held: dict[str, float] = field(default_factory=dict)

    @classmethod
    def parse(cls, max_batch: str | None, wait_ms: str | None, max_held: str | None = None) -> Batching:
        sizes, held = parse_stage_map(max_batch, "max batch"), parse_stage_map(max_held, "max held")
        for what, m in (("max batch", sizes), ("max held", held)):
            bad = [k for k, v in m.items() if v < 1 or v != int(v)]
            if bad:
                raise ValueError(f"{what}: {bad[0]} needs a whole number >= 1")
        return cls(sizes, parse_stage_map(wait_ms, "batch wait"), held)

    def for_stage(self, workflow: str, stage: str) -> tuple[int, float]:
        """(max batch, wait ms) of one stage: ``workflow/stage`` wins over ``stage``, over the spec."""
        default = get_workflow(workflow).stage(stage).max_batch
        return int(per_stage(self.max_batch, workflow, stage, default)), per_stage(self.wait_ms, workflow, stage, 0.0)

    def held_for(self, workflow: str, stage: str) -> int:
        """Max held of one stage (``workflow/stage`` over ``stage``), never below its max batch; 0: the
        batcher's default (twice the max batch)."""
        held = per_stage(self.max_held, workflow, stage, 0)
        return max(int(held), self.for_stage(workflow, stage)[0]) if held else 0


DEFAULT_CALIBRATE_S = 2.0  # seconds a stage's warm-up calibration may take (engine.worker.calibrate)


@dataclass(frozen=True)
class Calibration:
    """Each stage's warm-up calibration budget (``onepiece node --calibrate-s S,STAGE=S,...``, else
    ``ONEPIECE_CALIBRATE_S``): the seconds its worker may spend, once ready and while idle, measuring one step
    of its stage at a spread of sizes (:mod:`engine.worker.calibrate`). A bare number is every stage's; keys
    are a stage or ``workflow/stage`` (:func:`per_stage`); 0 turns it off."""

    budget_s: dict[str, float] = field(default_factory=dict)
    default_s: float = DEFAULT_CALIBRATE_S

    @classmethod
    def parse(cls, text: str | None) -> Calibration:
        parts = [p.strip() for p in (text or "").replace(";", ",").split(",") if p.strip()]
        bare = [p for p in parts if "=" not in p]
        if len(bare) > 1:
            raise ValueError(f"calibrate-s: one bare number at most (every stage's), got {', '.join(bare)}")
        try:
            default = float(bare[0]) if bare else DEFAULT_CALIBRATE_S
        except ValueError:
            default = -1.0
        if not default >= 0 or default == float("inf"):
            raise ValueError(f"calibrate-s: expected seconds >= 0, got {bare[0]!r}")
        return cls(parse_stage_map(",".join(p for p in parts if "=" in p), "calibrate-s"), default)

    def for_stage(self, workflow: str, stage: str) -> float:
        return per_stage(self.budget_s, workflow, stage, self.default_s)


def default_assignment(model_dirs: dict[str, str], device: str | None = None,
                       step_delay_s: float = 0.0, share: bool = True) -> Assignment:
    """One instance per stage pool of the workflows in ``model_dirs`` (what ``onepiece up`` runs): stages of
    several workflows whose executor and components are the same bytes share one (engine.workflow.pools);
    ``share=False``: one instance per stage of every workflow."""
    found = pools(model_dirs) if share else [Pool(((wf, st),)) for wf in sorted(model_dirs)
                                               for st in get_workflow(wf).route()]
    instances = [
        InstanceSpec(f"{p.workflow}.{p.stage}.0", p.workflow, p.stage, device,
                     step_delay_s if p.stage == "denoise" else 0.0, also=tuple("/".join(m) for m in p.members[1:]))
        for p in found
    ]
    return Assignment(tuple(instances), dict(model_dirs))
