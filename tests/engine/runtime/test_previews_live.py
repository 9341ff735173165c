"""Live previews on the real engine (the session's one-node deployment (the one_node fixture): ``onepiece node`` workers and
``onepiece proxy`` on the tiny models): a request with ``preview_every`` gets its previews from the denoise
worker in step order, each request of a burst (batched or not) its own, and the Proxy's
``GET /v1/requests/{uid}/preview`` answers the latest; a request without it writes no preview."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from engine.store import keys
from tests.fixtures.runtime import Cluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def test_previews_come_in_order_per_request_and_the_route_serves_the_latest(one_node: Cluster) -> None:
    sd = {"prompt": "a cat", "height": 64, "width": 64, "num_inference_steps": 6, "preview_every": 2}
    uids = [one_node.submit("sd-t2i", {**sd, "seed": s}) for s in range(3)]  # a burst: they may share steps
    plain = one_node.submit("sd-t2i", {**sd, "preview_every": 0, "seed": 9})
    wan = one_node.submit("wan2.1-t2v", {"prompt": "a cat", "height": 64, "width": 64, "num_frames": 5,
                                        "num_inference_steps": 4, "preview_every": 2})
    for uid in [*uids, plain, wan]:
        assert one_node.wait(uid, keys.TERMINAL, timeout=240)["state"] == keys.COMPLETED
    for uid in uids:
        got = one_node.store.preview.since(uid)
        assert [(p.stage, p.step, p.total) for p in got] == [("denoise", 2, 6), ("denoise", 4, 6), ("denoise", 6, 6)]
        status, body, headers = one_node.call("GET", f"/v1/requests/{uid}/preview")
        assert status == 200 and headers["OnePiece-Preview-Step"] == "6" and body == got[-1].image
        assert Image.open(io.BytesIO(body)).format == "JPEG" and headers["Content-Type"] == "image/jpeg"
    # each request's previews are its own latents (different seeds: different pictures)
    assert len({one_node.store.preview.latest(u).image for u in uids}) == len(uids)
    assert [p.step for p in one_node.store.preview.since(wan)] == [2, 4]
    assert one_node.store.preview.latest(plain) is None
    assert one_node.call("GET", f"/v1/requests/{plain}/preview")[0] == 204
