"""This folder's fixtures: an adapter store with tiny LoRAs registered, as ONEPIECE_ADAPTER_STORE for the module."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def adapters(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The store (``ONEPIECE_ADAPTER_STORE`` while the module runs) with sd-t2i's ``alpha`` (seed 1),
    ``beta`` (seed 2, default scale 0.5), wan2.1-t2v's ``wave`` and ``swell`` (seeds 3, 4) and wan2.1-i2v's
    ``still`` (seed 5)."""
    from engine.adapters.registry import AdapterStore
    from engine.adapters.tiny import make_tiny_lora

    root = tmp_path_factory.mktemp("adapter-store")
    files = tmp_path_factory.mktemp("adapter-files")
    reg = AdapterStore(root)
    for name, wf, seed, scale in (("alpha", "sd-t2i", 1, 1.0), ("beta", "sd-t2i", 2, 0.5),
                                  ("wave", "wan2.1-t2v", 3, 1.0), ("swell", "wan2.1-t2v", 4, 1.0),
                                  ("still", "wan2.1-i2v", 5, 1.0)):
        f = make_tiny_lora(wf, files / name, seed, model_dir=tiny_models[wf])
        reg.add(name, f, wf, tiny_models[wf], scale)
    before = os.environ.get("ONEPIECE_ADAPTER_STORE")
    os.environ["ONEPIECE_ADAPTER_STORE"] = str(root)
    reg.files_dir = files  # type: ignore[attr-defined]  # where the sources are, for tests that add again
    try:
        yield reg
    finally:
        if before is None:
            os.environ.pop("ONEPIECE_ADAPTER_STORE", None)
        else:
            os.environ["ONEPIECE_ADAPTER_STORE"] = before
