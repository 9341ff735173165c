"""onepiece node --max-batch / --batch-wait-ms / --max-held reach each stage worker's configuration."""

from __future__ import annotations

import argparse

import pytest

from engine.worker.config import Batching
from engine.worker.node_cli import add_arguments, settings_from


def test_defaults_come_from_the_spec_and_flags_override_per_stage_or_workflow_stage() -> None:
    b = Batching()
    assert b.for_stage("sd-t2i", "denoise") == (7, 0.0)  # the most requests whose batched bytes are their solo ones
    assert b.for_stage("sd-t2i", "text_encode") == (8, 0.0)  # CLIP: any prompts share a call
    assert b.for_stage("sd-t2i", "vae_decode") == (1, 0.0)  # a batch's convolutions differ in bytes
    assert b.for_stage("wan2.1-t2v", "denoise") == (4, 0.0)  # per-sample linears, SiLUs and convolutions
    b = Batching.parse("denoise=4,sd-t2i/denoise=2", "denoise=5")
    assert b.for_stage("sd-t2i", "denoise") == (2, 5.0) and b.for_stage("wan2.1-t2v", "denoise") == (4, 5.0)
    for bad in ("denoise=0", "denoise=2.5", "denoise", "=3"):
        with pytest.raises(ValueError):
            Batching.parse(bad, None)
        with pytest.raises(ValueError, match="max held"):
            Batching.parse(None, None, bad)


def test_max_held_per_stage_never_below_the_max_batch() -> None:
    assert Batching().held_for("sd-t2i", "denoise") == 0  # the batcher's default: twice the max batch
    b = Batching.parse("denoise=4", None, "denoise=12,wan2.1-t2v/denoise=2")
    assert b.held_for("sd-t2i", "denoise") == 12
    assert b.held_for("wan2.1-t2v", "denoise") == 4  # below its max batch of 4: raised to it
    assert b.held_for("sd-t2i", "vae_decode") == 0


def test_the_node_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    s = settings_from(p.parse_args(["--max-batch", "denoise=3", "--batch-wait-ms", "denoise=20", "--max-held",
                                    "denoise=9"]), "http://e", "redis://r")
    assert s.batching.for_stage("sd-t2i", "denoise") == (3, 20.0) and s.batching.held_for("sd-t2i", "denoise") == 9
    monkeypatch.setenv("ONEPIECE_MAX_HELD", "denoise=10")
    s = settings_from(p.parse_args([]), "http://e", "redis://r")
    assert s.batching.for_stage("sd-t2i", "denoise") == (7, 0.0) and s.batching.held_for("sd-t2i", "denoise") == 10
