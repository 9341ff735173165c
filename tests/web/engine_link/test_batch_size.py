"""Each stage run in the ledger records the batch it shared steps with (issue 24) and the share of its
transformer calls its step cache skipped (issue 37): from the engine's stage_finished event to the API's
stage_runs and the onepiece_stage_batch_size histogram."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from engine.store import keys
from onepiece_platform.engine_link.reconciler import Reconciler
from tests.fixtures.web import sd_body

pytestmark = pytest.mark.django_db


def _count(stage: str) -> float:
    return REGISTRY.get_sample_value("onepiece_stage_batch_size_count", {"workflow": "sd-t2i", "stage": stage}) or 0.0


def test_batch_size_reaches_stage_runs_and_the_histogram(alice, store) -> None:
    _, c, _ = alice
    uid = c.post("/api/v1/jobs", sd_body(seed=1), format="json").json()["uid"]
    before = _count("denoise"), _count("text_encode")
    store.event(uid, keys.STAGE_STARTED, "text_encode", 0, state=keys.IN_PROGRESS)
    store.event(uid, keys.STAGE_FINISHED, "text_encode", 10, detail="0.010s")
    store.event(uid, keys.STAGE_STARTED, "denoise", 10, state=keys.IN_PROGRESS)
    store.event(uid, keys.STAGE_FINISHED, "denoise", 80, detail="0.400s batch=3 cache_skipped=0.714")
    Reconciler(block_ms=0).step()
    runs = {r["stage"]: r for r in c.get(f"/api/v1/jobs/{uid}").json()["stage_runs"]}
    assert runs["denoise"]["batch_size"] == 3 and runs["text_encode"]["batch_size"] == 1
    assert runs["denoise"]["cache_skipped"] == 0.714 and runs["text_encode"]["cache_skipped"] is None
    assert (_count("denoise"), _count("text_encode")) == (before[0] + 1, before[1] + 1)
    assert REGISTRY.get_sample_value("onepiece_stage_batch_size_bucket",
                                     {"workflow": "sd-t2i", "stage": "denoise", "le": "2.0"}) is not None
