"""A live server (pytest-django's, threaded WSGI) and a thread that plays the engine's workers."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.web.conftest import png


@functools.cache
def mp4() -> bytes:
    """A real 9-frame 32x32 H.264 mp4 (written as the video_encode stage writes it): frame i is grey level 20 i."""
    import numpy as np

    from engine.stages.wan.video import encode_mp4

    frames = np.stack([np.full((32, 32, 3), 20 * i, dtype=np.uint8) for i in range(9)])
    return encode_mp4(frames, 16)


class Workers:
    """Finishes every accepted job: completed with a png/mp4, or failed when ``fail`` is set."""

    def __init__(self, url: str) -> None:
        import redis

        from engine.store import JobStore

        self.store = JobStore(redis.Redis.from_url(url))
        self.fail = False
        self.hold = False  # leave jobs queued (nothing runs)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="web-test-workers")
        self._thread.start()

    def _run(self) -> None:
        from engine.store import keys

        last = "0-0"  # from the start: "$" would miss what was accepted before the first read
        while not self._stop.is_set():
            resp = self.store.r.xread({keys.EVENTS: last}, count=100, block=50)
            for _, entries in resp or []:
                for entry_id, raw in entries:
                    last = entry_id
                    f = {k.decode(): v.decode() for k, v in raw.items()}
                    if f["type"] != keys.ACCEPTED or self.hold:
                        continue
                    st = self.store.status(f["uid"])
                    if st is None or st.terminal:
                        continue
                    self.store.event(f["uid"], keys.STAGE_STARTED, "denoise", 50, state=keys.IN_PROGRESS)
                    if self.fail:
                        self.store.finish(f["uid"], st.workflow, keys.FAILED, "denoise", detail="boom")
                    else:
                        data = png(64, 64) if st.workflow == "sd-t2i" else mp4()
                        self.store.finish(f["uid"], st.workflow, keys.COMPLETED, "final", result=data)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.store.close()


@pytest.fixture
def workers(web_redis: str) -> Iterator[Workers]:
    w = Workers(web_redis)
    yield w
    w.close()


@pytest.fixture
def oa(live_server: Any, transactional_db: None, web_redis: str) -> Iterator[tuple[Any, Any]]:
    """(openai.OpenAI client for a fresh user, the user)."""
    import openai

    from tests.web.conftest import make_user

    user, key = make_user("oa-user")
    client = openai.OpenAI(api_key=key, base_url=live_server.url + "/v1", max_retries=0, timeout=30)
    yield client, user
    client.close()
