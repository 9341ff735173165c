"""Workflow -> stage -> executor class, imported lazily by dotted path."""

from __future__ import annotations

import importlib

from engine.stages.base import StageExecutor
from engine.workflow import get_workflow


def import_string(path: str) -> type:
    """``"pkg.mod.Class"`` -> the class (imports the module on first use)."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def executor_class(workflow: str, stage: str) -> type[StageExecutor]:
    """The executor class of ``stage`` in ``workflow`` (imports torch for torch stages)."""
    cls = import_string(get_workflow(workflow).stage(stage).executor)
    if not (isinstance(cls, type) and issubclass(cls, StageExecutor)):
        raise TypeError(f"{workflow}/{stage}: {cls!r} is not a StageExecutor")
    return cls
