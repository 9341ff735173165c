"""A request parameter of a workflow, with its default and its limits (:class:`ParamSpec`).

Apart from :mod:`engine.workflow.spec` so that the request options (:mod:`engine.workflow.options`)
declare theirs with the same type, which every spec then takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.workflow.errors import InvalidRequest


@dataclass(frozen=True)
class ParamSpec:
    """A request parameter with its default and its limits.

    Every parameter is bounded where it enters (the Proxy and the platform both
    resolve requests through the spec): a number has a minimum and a maximum and
    must be finite (``NaN`` compares false with every limit, so it would slip
    through them); a string has ``max_length`` characters and must be valid
    Unicode (no lone surrogates). The bounds also keep the Workflow Message's
    JSON header far below :data:`engine.workflow.message.MAX_HEADER_BYTES`, so
    an accepted request can always be decoded by its stages.
    """

    name: str
    type: type
    default: Any
    minimum: float | None = None
    maximum: float | None = None
    doc: str = ""
    max_length: int | None = None  # characters, for str parameters
    why: str = ""  # the loaded model's fact behind ``maximum``, when it is tighter than the spec's (limits.py)
    choices: tuple[str, ...] = ()  # a str parameter's allowed values (empty: any text within max_length)

    def __post_init__(self) -> None:
        if self.type is str and (self.max_length is None or self.max_length < 1):
            raise ValueError(f"string parameter {self.name!r} needs a max_length")
        if self.type in (int, float) and (self.minimum is None or self.maximum is None):
            raise ValueError(f"numeric parameter {self.name!r} needs a minimum and a maximum")


def check_text(p: ParamSpec, value: str) -> None:
    assert p.max_length is not None
    if len(value) > p.max_length:
        raise InvalidRequest(p.name, f"{p.name} is {len(value)} characters; the limit is {p.max_length}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(p.name, f"{p.name} is not valid Unicode text (a lone surrogate)") from None
