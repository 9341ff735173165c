"""Workflow -> stage -> executor class, imported lazily by dotted path; and what the executor classes declare.

An executor class is the one place that says what its stage needs of a model folder (``components``: the
sub-folders it loads; ``reads``: those whose config it reads) and whether it applies LoRA adapters
(``adapts``). Importing the classes loads no torch (engine.lazy), so the Proxy, the Node Manager and the CLI
read these declarations here instead of a list of their own.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from engine.stages.base import StageExecutor
from engine.workflow import get_workflow, workflows
from engine.workflow import pools as _pools


def import_string(path: str) -> type:
    """``"pkg.mod.Class"`` -> the class (imports the module on first use)."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def executor_class(workflow: str, stage: str) -> type[StageExecutor]:
    """The executor class of ``stage`` in ``workflow`` (its module loads torch at its first use, not here)."""
    cls = import_string(get_workflow(workflow).stage(stage).executor)
    if not (isinstance(cls, type) and issubclass(cls, StageExecutor)):
        raise TypeError(f"{workflow}/{stage}: {cls!r} is not a StageExecutor")
    return cls


def components(workflow: str, stage: str) -> tuple[str, ...]:
    """The model sub-folders the stage's executor loads."""
    return tuple(executor_class(workflow, stage).components)


def needed(workflow: str) -> tuple[str, ...]:
    """Every sub-folder a model folder of ``workflow`` must hold: what its stages load and whose config they
    read, in stage order, each once."""
    found: dict[str, None] = {}
    for s in get_workflow(workflow).stages:
        cls = executor_class(workflow, s.name)
        found.update(dict.fromkeys((*cls.components, *cls.reads)))
    return tuple(found)


def pools(model_dirs: Mapping[str, str]) -> list[_pools.Pool]:
    """The stage pools of the workflows in ``model_dirs`` (engine.workflow.pools.pools), each stage digested
    by what its executor loads."""
    return _pools.pools(model_dirs, components)


def adaptable() -> dict[str, tuple[str, str]]:
    """Workflow -> (the component its LoRA adapters target, the diffusers pipeline whose loader reads them):
    the workflows one of whose stages' executors declares ``adapts``."""
    out: dict[str, tuple[str, str]] = {}
    for name, spec in sorted(workflows().items()):
        found = {a for s in spec.stages if (a := executor_class(name, s.name).adapts) is not None}
        if len(found) > 1:
            raise TypeError(f"{name}: several stages apply LoRA adapters to different components: {sorted(found)}")
        if found:
            out[name] = found.pop()
    return out
