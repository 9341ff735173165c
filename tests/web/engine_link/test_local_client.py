"""The in-process engine client takes requests in through the Proxy's own intake: the same refusals."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from engine.workflow.options import Options
from onepiece_platform.engine_link.client import EngineRejected
from onepiece_platform.engine_link.local import LocalEngineClient
from tests.fixtures.web import png

WAN = {"prompt": "a cat", "height": 64, "width": 64, "num_frames": 9, "num_inference_steps": 2}
SD = {"prompt": "a cat", "height": 64, "width": 64, "num_inference_steps": 2}


@pytest.mark.parametrize(("workflow", "params", "inputs", "status", "field"), [
    ("sd-t2i", SD, {"image": png()}, 400, "image"),  # an input the workflow does not take
    ("wan2.1-i2v", WAN, {"image": b"not an image"}, 400, "image"),
    ("wan2.1-i2v", WAN, {}, 400, "image"),
    ("wan2.1-i2v", {**WAN, "num_frames": 10}, {"image": png()}, 400, "num_frames"),
    ("nope", SD, {}, 400, "workflow"),
])
def test_refuses_what_the_proxy_refuses(web_redis: str, workflow: str, params: dict[str, Any],
                                        inputs: dict[str, bytes], status: int, field: str) -> None:
    engine = LocalEngineClient()
    with pytest.raises(EngineRejected) as exc:
        engine.submit(workflow, params, inputs)
    assert (exc.value.status, exc.value.field) == (status, field)
    assert engine.store().events() == []


def test_accepts_once_per_uid(web_redis: str) -> None:
    engine, uid = LocalEngineClient(), uuid.uuid4().hex
    accepted = engine.submit("wan2.1-i2v", WAN, {"image": png()}, Options(deadline_s=60), uid=uid)
    assert accepted.uid == uid and accepted.cost_gpu_s > 0
    status = engine.status(uid)
    assert status is not None and status.state == "queued"
    with pytest.raises(EngineRejected) as exc:
        engine.submit("wan2.1-i2v", WAN, {"image": png()}, uid=uid)
    assert exc.value.status == 409
