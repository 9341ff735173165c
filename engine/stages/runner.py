"""Run one request through every stage of a workflow in one process.

Used by ``onepiece run``, the bit-identity tests and the stage profiler. Values
cross stage boundaries exactly as they would between workers: each stage's
outputs (plus what later stages still need) are encoded into a Workflow
Message and the next stage reads zero-copy views of it, so the bytes measured
here are the bytes a ring would carry.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.stages.base import StageContext, StageExecutor
from engine.stages.layout import check_components
from engine.stages.registry import executor_class, needed
from engine.workflow import get_workflow
from engine.workflow import message as wm
from engine.workflow.options import Options


@dataclass
class StageStats:
    """What one stage cost for one request."""

    load_s: float = 0.0
    compute_s: float = 0.0
    out_bytes: int = 0  # bytes of the message handed to the next stage
    payload_bytes: int = 0  # tensor/blob bytes inside it


@dataclass
class RunResult:
    outputs: dict[str, Any]
    header: wm.Header
    stats: dict[str, StageStats] = field(default_factory=dict)


def validate_request(
    workflow: str, model_dir: str | Path, params: Mapping[str, Any], inputs: Mapping[str, Any]
) -> dict[str, Any]:
    """Everything checkable before a stage runs: params and input files (the workflow spec's one check,
    :meth:`engine.workflow.spec.WorkflowSpec.validate_request`), then the model folder.

    Returns resolved params. Raises ``InvalidRequest`` (params and inputs) or ``MissingComponent``
    (model folder). Limits and defaults are the loaded model's, as the Proxy's intake binds them
    (:meth:`engine.workflow.spec.WorkflowSpec.bound`): a size the folder's transformer cannot run is refused
    here, naming the field, and the default request is one it can.
    """
    spec = get_workflow(workflow)
    spec = spec.bound(spec.limits_of(str(model_dir)))
    resolved = spec.validate_request(params, inputs)
    check_components(model_dir, needed(spec.name))
    return resolved


class LocalRunner:
    """All of a workflow's executors, loaded once, run in sequence in this process."""

    def __init__(
        self, workflow: str, model_dir: str | Path, device: str | None = None,
        load_hook: Callable[[str, Callable[[], StageExecutor]], StageExecutor] | None = None,
    ) -> None:
        """Load every stage. ``load_hook(stage, load)`` may wrap each load (the profiler measures it)."""
        self.spec = get_workflow(workflow)
        self.model_dir = Path(model_dir)
        self.executors: dict[str, StageExecutor] = {}
        self.load_s: dict[str, float] = {}
        check_components(model_dir, needed(self.spec.name))
        for stage in self.spec.stages:

            def load(name: str = stage.name) -> StageExecutor:
                ex = executor_class(self.spec.name, name)()
                ex.served_workflow = self.spec.name
                ex.load(self.model_dir, device)
                return ex

            t0 = time.perf_counter()
            self.executors[stage.name] = load_hook(stage.name, load) if load_hook else load()
            self.load_s[stage.name] = time.perf_counter() - t0

    def run(
        self, params: Mapping[str, Any], inputs: Mapping[str, Any],
        progress: Callable[[str, int, int], None] | None = None, deadline: float | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> RunResult:
        """Run one request; ``params`` must already be resolved by the spec (its options among them go
        into the message's ``options``, as the Proxy sends them: engine.workflow.options).

        ``progress(stage, step, total)`` reports denoising steps; returns the
        final message's values (e.g. ``{"video": memoryview}``) and per-stage stats.
        """
        from engine.stages.components import to_torch, values_to_message

        route = self.spec.route()
        params, options = Options.split(params)
        header = wm.Header(uid=uuid.uuid4().hex, workflow=self.spec.name, stage=route[0], route=route,
                           deadline=deadline, params=params, options=options.to_json())
        buf = wm.encode(header, {}, {k: bytes(v) for k, v in self.spec.message_inputs(inputs).items()})
        stats: dict[str, StageStats] = {}
        for name in route:
            msg = wm.decode(buf)
            values: dict[str, Any] = {k: to_torch(t) for k, t in msg.tensors.items()}
            values.update(msg.blobs)
            stage = self.spec.stage(name)
            ctx = StageContext(
                progress=(lambda s, n, _name=name: progress(_name, s, n)) if progress else None,
                cancelled=cancelled, deadline=deadline, options=Options.from_json(msg.header.options),
            )
            t0 = time.perf_counter()
            out = self.executors[name].run({k: values[k] for k in stage.inputs}, params, ctx)
            compute = time.perf_counter() - t0
            values.update(out)
            carried = {k: values[k] for k in self.spec.carried_after(name)}
            tensors, blobs = values_to_message(carried)
            # Every stage's outputs must match the spec's dtype/shape rules:
            # a worker on the other side of a ring relies on them.
            compute_dtype = getattr(self.executors[name], "dtype_name", "float32")
            bound: dict[str, int] = {}
            for k, t in tensors.items():
                if k in {o.name for o in stage.outputs}:
                    self.spec.check_tensor(k, t.dtype, t.shape, params, compute_dtype, bound)
            header.timestamps[name] = time.time()
            nxt = route.index(name) + 1
            header.stage = route[nxt] if nxt < len(route) else name
            buf = wm.encode(header, tensors, blobs)
            stats[name] = StageStats(self.load_s[name], compute, len(buf),
                                     sum(t.nbytes for t in tensors.values()) + sum(len(b) for b in blobs.values()))
        final = wm.decode(buf)
        outputs: dict[str, Any] = dict(final.blobs)
        outputs.update({k: to_torch(t) for k, t in final.tensors.items()})
        return RunResult(outputs, final.header, stats)
