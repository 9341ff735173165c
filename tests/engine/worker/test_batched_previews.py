"""Live previews from a step-batching denoise instance (engine.worker.batching) through its real inbox ring,
job store and route: requests that share steps each get their own previews, in step order, each the
picture of its own latents."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from engine.store import keys
from tests.engine.worker.rig import SPEC, DenoiseRig

pytestmark = pytest.mark.models


def test_batched_requests_publish_their_own_previews(sd: Any, redis_server: Any, etcd_server: Any) -> None:
    from engine.stages.base import StageContext
    from engine.stages.preview import plane

    rig = DenoiseRig(redis_server.url, etcd_server.url)
    store = rig.store
    reqs = {uuid.uuid4().hex: SPEC.resolve_params({"prompt": p, "height": 64, "width": 64, "seed": s,
                                                   "num_inference_steps": n, "preview_every": 2})
            for p, n, s in (("a red boat", 6, 1), ("a green tree", 4, 2), ("a blue car", 6, 3))}
    embeds = {u: sd.executors["text_encode"].run({}, p, StageContext()) for u, p in reqs.items()}
    worker = rig.worker(sd.executors["denoise"])
    try:
        handed: dict[str, Any] = {}
        rig.serve(worker, list(reqs), reqs, embeds)
        rig.collect(handed)
        worker.previews.close()  # every queued preview written
        finished = [e for u in reqs for e in store.events(u) if e["type"] == keys.STAGE_FINISHED]
        assert all("batch=3" in e["detail"] for e in finished), finished  # they did share steps
        renderer = worker.previews.renderer
        assert renderer is not None
        for u, p in reqs.items():
            n = p["num_inference_steps"]
            got = store.preview.since(u)
            assert [(x.stage, x.step, x.total) for x in got] == [("denoise", k, n) for k in range(2, n + 1, 2)]
            # the last preview is the picture of this request's own final latents, not a batch neighbour's
            assert got[-1].image == renderer.render(plane(handed[u]))
        assert len({store.preview.latest(u).image for u in reqs}) == len(reqs)
    finally:
        rig.close()
