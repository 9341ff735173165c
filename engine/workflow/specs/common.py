"""Parameter rules shared by several workflow specs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engine.workflow.spec import InvalidRequest

# Characters of a prompt or negative prompt. The text encoders read far less (CLIP 77 tokens, umT5 512),
# and the bound keeps every request's message header small (see ParamSpec).
MAX_PROMPT_CHARS = 4096


def require_prompt(params: Mapping[str, Any]) -> None:
    """A prompt must contain something other than whitespace."""
    prompt = params.get("prompt")
    if prompt is None or not str(prompt).strip():
        raise InvalidRequest("prompt", "prompt must not be empty")


def require_multiple(params: Mapping[str, Any], name: str, multiple: int) -> None:
    if params[name] % multiple:
        raise InvalidRequest(name, f"{name} must be a multiple of {multiple}, got {params[name]}")


def require_pixels(params: Mapping[str, Any], max_pixels: int, workflow: str) -> None:
    pixels = params["height"] * params["width"]
    if pixels > max_pixels:
        raise InvalidRequest(
            "size", f"{params['width']}x{params['height']} exceeds {workflow}'s limit of {max_pixels} pixels"
        )


def fit_linear(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares ``(fixed, per_unit)`` from ``(units, seconds)`` samples.

    Used to calibrate a :class:`engine.workflow.spec.CostModel` from stage
    times measured by ``benchmarks/stages_profile.py``. One sample gives a
    pure proportional model.
    """
    if not samples:
        raise ValueError("no samples")
    if len({u for u, _ in samples}) == 1:
        u, s = samples[0]
        return 0.0, (sum(s for _, s in samples) / len(samples)) / u if u else 0.0
    n = len(samples)
    mu = sum(u for u, _ in samples) / n
    ms = sum(s for _, s in samples) / n
    slope = sum((u - mu) * (s - ms) for u, s in samples) / sum((u - mu) ** 2 for u, _ in samples)
    return max(0.0, ms - slope * mu), slope
