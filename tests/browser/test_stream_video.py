"""Chromium plays a streamed video while its job is still running: a page fetches
``/v1/videos/{id}/content?stream=true`` from the platform under uvicorn (ASGI: the async body), appends each
chunk to a Media Source Extensions buffer and plays; the writer (this test, playing the mp4 stage) holds the
rest of the video back until the ``<video>`` element's ``currentTime`` is past 0, then finishes the job."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from engine.stages.wan.video import Mp4Stream
from engine.store import keys
from engine.store.fragments import Fragments
from tests.fixtures.web import make_user

pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]

FPS, FRAMES, FIRST = 16, 48, 24  # 3 s of video; the first 1.5 s streamed before the page must play

PLAYER = """async ([url, key, mime]) => {
  const video = document.createElement('video');
  video.muted = true;
  document.body.appendChild(video);
  window.player = {bytes: 0, done: false, error: null};
  const ms = new MediaSource();
  video.src = URL.createObjectURL(ms);
  await new Promise(r => ms.addEventListener('sourceopen', r, {once: true}));
  const sb = ms.addSourceBuffer(mime);
  const resp = await fetch(url, {headers: {Authorization: 'Bearer ' + key}});
  const reader = resp.body.getReader();
  (async () => {
    try {
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        await new Promise((r, e) => { sb.addEventListener('updateend', r, {once: true});
                                      sb.addEventListener('error', e, {once: true}); sb.appendBuffer(value); });
        window.player.bytes += value.length;
        if (video.paused) video.play().catch(() => {});
      }
      ms.endOfStream();
      window.player.done = true;
    } catch (err) { window.player.error = String(err); }
  })();
  window.video = video;
}"""


def _frames() -> Any:
    # a moving bar: each frame differs, so the decoder has real content to show
    f = np.zeros((FRAMES, 64, 64, 3), dtype=np.uint8)
    for i in range(FRAMES):
        f[i, :, (i * 4) % 64:(i * 4) % 64 + 8] = (255, 128, 0)
    return f


def _codec(init: bytes) -> str:
    """The RFC 6381 codec string of the init segment's avcC (profile, compatibility, level)."""
    at = init.index(b"avcC") + 4
    return "avc1." + init[at + 1:at + 4].hex().upper()


def test_chromium_plays_the_stream_before_the_job_completes(live_asgi: Any, browser: Any, workers: Any) -> None:
    import openai

    workers.hold = True  # the test plays the mp4 stage
    _user, key = make_user("stream-viewer")
    client = openai.OpenAI(api_key=key, base_url=live_asgi.url + "/v1", max_retries=0, timeout=30)
    v = client.videos.create(prompt="a bar moving right", size="64x64", seconds="3",
                             extra_body={"num_inference_steps": 2})
    store, frags, mp4 = workers.store, Fragments(workers.store), Mp4Stream(FPS)
    frames = _frames()
    pieces = mp4.feed(frames[:FIRST])
    for seq, piece in enumerate(pieces):
        frags.append(v.id, seq, piece)

    page = browser.new_page()
    page.goto(live_asgi.url + "/livez")  # the platform's origin: the page's fetch is same-origin
    page.evaluate(PLAYER, [f"{live_asgi.url}/v1/videos/{v.id}/content?stream=true", key,
                           f'video/mp4; codecs="{_codec(pieces[0])}"'])
    page.wait_for_function("window.video && window.video.currentTime > 0", timeout=60_000)
    assert store.state(v.id) == keys.QUEUED  # played while the job had not completed
    assert page.evaluate("window.player.done") is False and page.evaluate("window.player.error") is None

    rest = mp4.feed(frames[FIRST:]) + mp4.close()
    for seq, piece in enumerate(rest, start=len(pieces)):
        frags.append(v.id, seq, piece)
    frags.end(v.id, len(pieces) + len(rest))
    video = b"".join(pieces + rest)
    store.finish(v.id, "wan2.1-t2v", keys.COMPLETED, "video_encode", result=video)
    page.wait_for_function("window.player.done || window.player.error", timeout=60_000)
    assert page.evaluate("window.player.error") is None
    assert page.evaluate("window.player.bytes") == len(video)
    client.close()
