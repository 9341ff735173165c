"""The errors a request or a tensor raises against a workflow spec, apart so that every check can raise them.

:mod:`engine.workflow.spec` raises them from its checks and :mod:`engine.workflow.images` from the image
check; both import them from here, so neither needs the other to define its error.
"""

from __future__ import annotations


class InvalidRequest(ValueError):
    """A request's parameters or inputs break the workflow's rules.

    ``field`` names the offending parameter (or input) so APIs can point at it.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class InvalidTensor(ValueError):
    """A tensor handed between stages does not match the spec's dtype or shape rule."""
