"""Fixtures of the TaskWorker tests: an inbox ring with a producer, and the tiny sd-t2i pipeline's stages."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.transport.ring import RingConsumer
from tests.engine.worker.rig import inbox_ring


@pytest.fixture
def ring() -> Iterator[tuple[RingConsumer, Any]]:
    """(an inbox ring's consumer, a producer attached to it)."""
    with inbox_ring() as pair:
        yield pair


@pytest.fixture(scope="module")
def sd(tiny_models: dict[str, Path]) -> Any:
    """The tiny sd-t2i pipeline's stage executors, loaded once per module."""
    from engine.stages.runner import LocalRunner

    return LocalRunner("sd-t2i", tiny_models["sd-t2i"], "cpu")
