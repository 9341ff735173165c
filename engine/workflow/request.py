"""A request checked at the edge: :class:`Request`, built once by the Proxy's parser (which the platform's
in-process engine shares) and handed whole to admission and to the first stage's message.

Its parts: the workflow's spec, the model's parameters as the spec resolved them, the input files, the
options (:class:`engine.workflow.options.Options`, apart from the parameters they came among), the absolute
deadline the options' ``deadline_s`` gives from the time it was checked, and the caller's UID if it chose one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.workflow.options import Options
from engine.workflow.spec import WorkflowSpec


@dataclass
class Request:
    """A request checked at the edge (see the module docstring)."""

    spec: WorkflowSpec
    params: dict[str, Any]  # the model's, resolved (the options among them are in ``options``)
    inputs: dict[str, bytes]
    options: Options
    deadline: float | None  # absolute (epoch seconds): options.deadline_s from the time it was checked
    uid: str | None  # caller-supplied (32 lowercase hex), or None: the Proxy draws one

    @property
    def priority(self) -> int:
        """The header's level (engine.dispatch.order: low -1, normal 0, high 1)."""
        return self.options.priority.level
