"""Stretched stage times: parsing, precedence, and clear errors on bad text."""

from __future__ import annotations

import pytest

from engine.worker.config import StageTiming, parse_stage_map


def test_parse_and_precedence() -> None:
    t = StageTiming.parse("denoise=0.2, sd-t2i/denoise=0.5;vae_decode=0.05", "denoise=3")
    assert t.for_stage("sd-t2i", "denoise") == (0.5, 3.0)  # workflow/stage wins over stage
    assert t.for_stage("wan2.1-i2v", "denoise") == (0.2, 3.0)
    assert t.for_stage("sd-t2i", "vae_decode") == (0.05, 1.0)
    assert t.for_stage("sd-t2i", "text_encode") == (0.0, 1.0)  # untouched stages: off
    assert StageTiming.parse(None, "").for_stage("sd-t2i", "denoise") == (0.0, 1.0)
    steps = StageTiming.parse(None, None, "denoise=0.05,wan2.1-i2v/denoise=0.2")
    assert steps.step_for("sd-t2i", "denoise") == 0.05 and steps.step_for("wan2.1-i2v", "denoise") == 0.2
    assert steps.step_for("sd-t2i", "vae_decode") == 0.0


@pytest.mark.parametrize("text, needle", [
    ("denoise", "expected STAGE=NUMBER"),
    ("denoise=fast", "expected STAGE=NUMBER"),
    ("denoise=-1", "expected STAGE=NUMBER"),
    ("=2", "expected STAGE=NUMBER"),
    ("nope/denoise=1", "nope"),
    ("sd-t2i/nostage=1", "nostage"),
])
def test_bad_text_is_a_clear_error(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match="stage time") as info:
        parse_stage_map(text, "stage time")
    assert needle in str(info.value)


def test_node_cli_refuses_bad_stretch(capsys: pytest.CaptureFixture[str]) -> None:
    from engine.cli import main

    rc = main(["node", "--etcd-url", "http://127.0.0.1:1", "--redis-url", "redis://127.0.0.1:1",
               "--stage-stretch", "denoise=x"])
    assert rc == 2 and "stage stretch" in capsys.readouterr().out
