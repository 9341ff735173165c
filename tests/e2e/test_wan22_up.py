"""``onepiece up --workflows wan2.2-t2v-a14b,wan2.2-i2v-a14b`` builds the tiny Wan2.2 A14B models and serves
them: the default ``/v1/videos`` request of the text-to-video model completes with the one-call pipeline's mp4
bytes, the request crosses from the high-noise expert's stage to the low-noise expert's at the pipeline's
boundary step, the native API takes a request too, requests over the loaded model's limits are refused at
intake naming the field, and the six-stage image-to-video workflow's default request goes through every stage
(the ledger's stage runs, the Node Manager's capacity). ``guidance_scale_2`` reaches the low-noise expert through
the openai client's ``extra_body``; wan2.2-ti2v-5b's default request, a prompt alone, completes with WanPipeline's
mp4 bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.coord.keys import Keyspace
from tests.e2e.up import call, start_up, stop_up

KEYS = Keyspace()  # the engine's etcd keys under the default root (/onepiece)

pytestmark = [pytest.mark.models, pytest.mark.integration]
WF, I2V, TI2V = "wan2.2-t2v-a14b", "wan2.2-i2v-a14b", "wan2.2-ti2v-5b"


def _reference_mp4(folder: Path, params: dict[str, Any]) -> bytes:
    """The one-call WanPipeline's video for these parameters, encoded as the video_encode stage encodes it (one
    torch thread, as the stage workers run)."""
    import torch
    from diffusers import WanPipeline

    from engine.stages.wan.video import encode_mp4

    torch.set_num_threads(1)
    pipe = WanPipeline.from_pretrained(folder)
    keys = ("prompt", "negative_prompt", "height", "width", "num_frames", "num_inference_steps", "guidance_scale",
            "guidance_scale_2", "max_sequence_length")
    frames = pipe(**{k: params[k] for k in keys if k in params}, generator=torch.Generator().manual_seed(params["seed"]),
                  output_type="np").frames[0]
    return encode_mp4((frames * 255).round().astype("uint8"), params["fps"])


@pytest.mark.timeout(600)
def test_up_serves_wan22_a14b_from_the_high_pool_to_the_low_pool(tmp_path: Path) -> None:
    import openai

    from engine.store import JobStore

    state = tmp_path / "state"
    proc, lines = start_up(state, "--workflows", f"{WF},{I2V},{TI2V}")  # builds only these workflows' tiny models
    try:
        assert sorted(p.name for p in (state / "models").iterdir() if p.is_dir()) == [I2V, WF, TI2V]
        client = openai.OpenAI(base_url=lines["api"], api_key=lines["api key"], max_retries=0, timeout=60)
        # the model's default request: no size, no seconds, no steps (the folder's serving.json)
        video = client.videos.create_and_poll(prompt="a cat walks on the beach", model=WF, poll_interval_ms=200)
        assert video.status == "completed" and video.model == WF, video
        assert video.size == "112x64" and video.seconds == "1", video
        mp4 = client.videos.download_content(video.id).content
        job = _ledger_job(lines, video.id, ["text_encode", "denoise_high", "denoise_low", "vae_decode",
                                            "video_encode"])
        assert job["state"] == "completed", job
        params = job["params"]
        assert (params["num_inference_steps"], params["num_frames"]) == (8, 17), params
        # the same bytes as the one-call pipeline with those parameters
        assert mp4[4:8] == b"ftyp" and mp4 == _reference_mp4(state / "models" / WF, params)
        # the request crossed pools at the boundary step: t >= 875 for 6 of the 8 steps (flow shift 12)
        password = (state / "secrets" / "redis-password").read_text().strip()
        store = JobStore.from_url(lines["redis"].replace("***", password, 1))
        try:
            steps = {}
            for e in store.events(video.id):
                if e.get("type") == "progress":
                    steps.setdefault(e["stage"], []).append(e["detail"])
        finally:
            store.close()
        assert steps["denoise_high"][-1] == "step 6/6" and steps["denoise_low"][-1] == "step 2/2", steps
        assert all(d.endswith("/6") for d in steps["denoise_high"]) and all(
            d.endswith("/2") for d in steps["denoise_low"]), steps
        # the native API: a request of its own, with the low expert's guidance
        status, doc = call(lines, "POST", "api/v1/jobs", {"workflow": WF, "params": {
            "prompt": "a red car", "width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 3,
            "guidance_scale_2": 2.0}})
        assert status in (200, 201, 202), doc
        done = client.videos.poll(doc["uid"], poll_interval_ms=200)
        assert done.status == "completed", done
        # over the loaded model's limits: refused at intake, naming the field
        with pytest.raises(openai.BadRequestError) as e:
            client.videos.create(prompt="a cat", model=WF, size="1024x512")
        assert e.value.body["param"] == "size" and "rope_max_seq_len" in e.value.body["message"], e.value.body
        status, doc = call(lines, "POST", "api/v1/jobs", {"workflow": WF, "params": {
            "prompt": "a cat", "guidance_scale_2": 51.0}})
        assert status == 400 and "guidance_scale_2" in json.dumps(doc), doc
        # the low expert's guidance through the openai client: the pipeline's bytes with that guidance
        small = {"width": 32, "height": 32, "num_frames": 5, "num_inference_steps": 3}
        video = client.videos.create_and_poll(prompt="a red car", model=WF, poll_interval_ms=200,
                                              extra_body={**small, "guidance_scale_2": 2.0})
        assert video.status == "completed", video
        _, job = call(lines, "GET", f"api/v1/jobs/{video.id}")
        assert job["params"]["guidance_scale_2"] == 2.0, job["params"]
        reference = _reference_mp4(state / "models" / WF, job["params"])
        assert client.videos.download_content(video.id).content == reference
        assert reference != _reference_mp4(state / "models" / WF, {**job["params"], "guidance_scale_2": 5.0})
        _ti2v_text_only(lines, client, state)
        _six_stages(lines, client, state)
        client.close()
    finally:
        out = stop_up(proc)
    assert proc.returncode == 0, out


def _ledger_job(lines: dict[str, str], uid: str, route: list[str]) -> dict[str, Any]:
    """The ledger's job once it holds a finished run of each stage of ``route``, in order. The video's state
    can come from the engine's status (a poll refreshes an unfinished job) a moment before the reconciler
    has applied the last stage events to the ledger's stage runs (docs/web-platform.md): wait for them."""
    import time

    deadline = time.monotonic() + 30
    while True:
        status, job = call(lines, "GET", f"api/v1/jobs/{uid}")
        assert status == 200, job
        runs = job["stage_runs"]
        if [r["stage"] for r in runs] == route and all(r["finished"] is not None for r in runs):
            return job
        assert [r["stage"] for r in runs] == route[:len(runs)], runs
        assert time.monotonic() < deadline, f"the ledger never finished every stage run: {runs}"
        time.sleep(0.2)


def _six_stages(lines: dict[str, str], client: Any, state: Path) -> None:
    """wan2.2-i2v-a14b, six stages: its default request with a first frame completes through every stage, the
    ledger records a run of each, and the Node Manager publishes its capacity over all six."""
    import time
    from urllib.parse import quote

    from engine.coord import etcd_client
    from engine.workflow import get_workflow
    from tests.fixtures.web import png

    route = get_workflow(I2V).route()
    assert route == ["text_encode", "vae_encode", "denoise_high", "denoise_low", "vae_decode", "video_encode"]
    video = client.videos.create_and_poll(prompt="a dog on the beach", model=I2V, poll_interval_ms=200,
                                          input_reference=("first.png", png(64, 64), "image/png"))
    assert video.status == "completed" and video.model == I2V and video.size == "112x64", video
    assert client.videos.download_content(video.id).content[4:8] == b"ftyp"
    _ledger_job(lines, video.id, route)
    password = (state / "secrets" / "etcd-password").read_text().strip()
    etcd = etcd_client(lines["etcd"].replace("***", quote(password, safe=""), 1))
    deadline = time.monotonic() + 60
    while not etcd.get(KEYS.capacity(I2V)):
        assert time.monotonic() < deadline, "the Node Manager published no capacity for the six-stage workflow"
        time.sleep(0.2)
    capacity = json.loads(etcd.get(KEYS.capacity(I2V))[0])
    assert capacity["rps"] > 0 and set(capacity["instances"]) == set(route), capacity


def _ti2v_text_only(lines: dict[str, str], client: Any, state: Path) -> None:
    """wan2.2-ti2v-5b's default /v1/videos request, a prompt alone: every stage runs (vae_encode only draws the
    noise) and the mp4 is WanPipeline's over the TI2V folder."""
    video = client.videos.create_and_poll(prompt="a cat walks on the beach", model=TI2V, poll_interval_ms=200)
    assert video.status == "completed" and video.model == TI2V, video
    job = _ledger_job(lines, video.id, ["text_encode", "vae_encode", "denoise", "vae_decode", "video_encode"])
    mp4 = client.videos.download_content(video.id).content
    assert mp4[4:8] == b"ftyp" and mp4 == _reference_mp4(state / "models" / TI2V, job["params"])
