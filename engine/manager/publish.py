"""Publish only what changed: the last value written under each key, and which of a new set of values differ."""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping
from typing import Any


class Published:
    """What a writer last wrote under each key, so that it rewrites an entry only when it changed (by ``same``,
    equality unless told: a tolerance keeps a noisy figure from being rewritten every tick)."""

    def __init__(self) -> None:
        self._last: dict[str, Any] = {}

    def changed(self, values: Mapping[str, Any],
                same: Callable[[Any, Any], bool] = operator.eq) -> dict[str, Any]:
        """The entries of ``values`` never written, or not ``same`` as the value last written under their key."""
        return {k: v for k, v in values.items() if k not in self._last or not same(self._last[k], v)}

    def remember(self, written: Mapping[str, Any]) -> None:
        """Record entries as written (call after the write succeeded, so a failed one is tried again)."""
        self._last.update(written)
