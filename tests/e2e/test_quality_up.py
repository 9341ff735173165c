"""Mixed ``quality`` live through ``onepiece up`` (issue 37): concurrent FLUX.1-dev requests at lossless,
extra-high and high, through the two doors a user has (the native API, and the OpenAI images route with
``extra_body={"quality": ...}`` through the ``openai`` SDK), all at once on one deployment whose denoise stage
batches steps: four, the default per-user limit of jobs at once (a fifth would be refused, 429). Afterwards:
every job completed and none is missing; each job's quality on the ledger is the one asked for, with its
denoise run's cache share (none for lossless); at least one denoise run shared its steps with another
request, so the per-request caches ran inside a batch; each output is byte for byte the same request's alone
on the same deployment, lossless included, high the same through both doors, and high's and extra-high's
differ from lossless's (the cache predicted steps)."""

from __future__ import annotations

import base64
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.up import call, start_up, stop_up

pytestmark = [pytest.mark.models, pytest.mark.integration, pytest.mark.filterwarnings("ignore::DeprecationWarning")]
WF = "flux.1-dev"
#: 64x64, the size whose batched items are measured equal to their solo runs; enough steps for the requests to
#: meet in the denoise stage (they join a running batch at a step boundary) and for high to predict most steps
BASE = {"width": 64, "height": 64, "num_inference_steps": 40}
REQUEST = {"prompt": "a cat on the moon", "seed": 7}  # every request's, so that the outputs compare
#: the concurrent requests, (door, level): every level, both doors, high through both
SENT = (("native", "lossless"), ("native", "high"), ("openai", "extra-high"), ("openai", "high"))


def _native(lines: dict[str, str], params: dict[str, Any]) -> tuple[str, bytes]:
    """Submit through the native API, wait for the end, return (uid, the png)."""
    status, doc = call(lines, "POST", "api/v1/jobs", {"workflow": WF, "params": {**BASE, **params}})
    assert status == 202, doc
    uid = doc["uid"]
    deadline = time.monotonic() + 120
    while doc["state"] not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, doc
        time.sleep(0.1)
        status, doc = call(lines, "GET", f"api/v1/jobs/{uid}")
        assert status == 200, doc
    assert doc["state"] == "completed", doc
    status, png = call(lines, "GET", f"api/v1/jobs/{uid}/result")
    assert status == 200 and png[:8] == b"\x89PNG\r\n\x1a\n", (status, png[:64])
    return uid, png


def _openai(client: Any, level: str) -> bytes:
    """One image through the OpenAI route with the level in ``extra_body``, as SGLang's clients send it."""
    out = client.images.generate(model=WF, prompt=REQUEST["prompt"], size="64x64", response_format="b64_json",
                                 extra_body={"quality": level, "seed": REQUEST["seed"],
                                             "num_inference_steps": BASE["num_inference_steps"]})
    return base64.b64decode(out.data[0].b64_json)


def _ledger(lines: dict[str, str]) -> list[dict[str, Any]]:
    """Every flux.1-dev job of the key's owner, once the ledger holds each finished run of each stage."""
    route = ["text_encode", "denoise", "vae_decode", "image_encode"]
    deadline = time.monotonic() + 30
    while True:
        status, page = call(lines, "GET", f"api/v1/jobs?workflow={WF}&page_size=100")
        assert status == 200, page
        jobs = page["results"]
        if all(sorted(r["stage"] for r in j["stage_runs"] if r["finished"] is not None) == sorted(route)
               for j in jobs):
            return jobs
        assert time.monotonic() < deadline, f"the ledger never finished every stage run: {jobs}"
        time.sleep(0.2)


def _send(lines: dict[str, str], client: Any, door: str, level: str) -> bytes:
    if door == "native":
        return _native(lines, {**REQUEST, "quality": level})[1]
    return _openai(client, level)


def _concurrently(lines: dict[str, str], client: Any) -> dict[tuple[str, str], bytes]:
    """:data:`SENT` at once: (door, level) -> the png."""
    start = threading.Barrier(len(SENT))

    def one(door: str, level: str) -> bytes:
        start.wait()
        return _send(lines, client, door, level)

    with ThreadPoolExecutor(len(SENT)) as pool:
        futures = {(door, level): pool.submit(one, door, level) for door, level in SENT}
        return {k: f.result(timeout=300) for k, f in futures.items()}


@pytest.mark.timeout(600)
def test_mixed_quality_requests_share_a_batch_live(tmp_path: Path) -> None:
    import openai

    # no spare slots: one denoise instance, which every request reaches (a spare one would split the batch)
    proc, lines = start_up(tmp_path / "state", "--workflows", WF, "--spare-slots", "0")
    try:
        client = openai.OpenAI(base_url=lines["api"], api_key=lines["api key"], max_retries=0, timeout=120)
        together = _concurrently(lines, client)
        jobs = _ledger(lines)
        _check_ledger(jobs)
        # each request alone on the same deployment, after the others: the same bytes as in the batch
        for door, level in SENT:
            assert _send(lines, client, door, level) == together[door, level], (door, level)
        assert together["native", "high"] == together["openai", "high"]  # one request, two doors
        lossless = together["native", "lossless"]
        assert together["native", "high"] != lossless and together["openai", "extra-high"] != lossless
        assert together["native", "high"] != together["openai", "extra-high"]
        client.close()
    finally:
        out = stop_up(proc)
    assert proc.returncode == 0, out


def _check_ledger(jobs: list[dict[str, Any]]) -> None:
    """The four jobs on the ledger: all completed, each with the quality asked for and its denoise run's
    cache share; at least one denoise run served more than one request."""
    assert len(jobs) == len(SENT) and all(j["state"] == "completed" for j in jobs), jobs
    assert sorted((j["quality"], j["params"]["quality"]) for j in jobs) == sorted((q, q) for _, q in SENT), jobs
    denoise = [(j["quality"], next(r for r in j["stage_runs"] if r["stage"] == "denoise")) for j in jobs]
    skipped = {}
    for level, run in denoise:
        if level == "lossless":
            assert run["cache_skipped"] is None, run
        else:
            assert 0 < run["cache_skipped"] < 1, run
            skipped.setdefault(level, set()).add(run["cache_skipped"])
    assert len(skipped["high"]) == 1, skipped  # one schedule per level, whichever door and batch
    assert min(skipped["high"]) > max(skipped["extra-high"]), skipped  # high predicts more of the 40 steps
    assert max(run["batch_size"] for _, run in denoise) > 1, denoise
