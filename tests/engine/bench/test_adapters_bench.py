"""The adapters benchmark's pool gets the cores its baselines get: onepiece up's spare slots at denoise."""

from __future__ import annotations

from engine.bench.adapters import with_spare_denoise
from engine.worker.config import default_assignment
from engine.worker.threads import usable_cores


def test_the_pool_has_the_spare_slots_of_onepiece_up_at_its_bottleneck() -> None:
    base = default_assignment({"sd-t2i": "/nonexistent/sd-t2i"}, device="cpu", share=False)
    got = with_spare_denoise(base)
    denoise = [i for i in got.instances if i.stage == "denoise"]
    assert len(denoise) == 1 + max(0, usable_cores() - 1)
    assert len({i.id for i in got.instances}) == len(got.instances)
    assert [i for i in got.instances if i.stage != "denoise"] == [i for i in base.instances if i.stage != "denoise"]
    assert got.model_dirs == base.model_dirs
