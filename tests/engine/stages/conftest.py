"""Tiny random-weight model folders, built once per test session (nothing downloaded)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """workflow name -> a tiny model folder in the published weights' layout."""
    from engine.stages.tiny import make_tiny

    return make_tiny(tmp_path_factory.mktemp("tiny-models"))


@pytest.fixture(scope="session")
def input_png() -> bytes:
    """A deterministic 48x40 RGB PNG: a non-square first frame exercises resizing."""
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray((np.random.RandomState(0).rand(40, 48, 3) * 255).astype("uint8")).save(buf, format="PNG")
    return buf.getvalue()
