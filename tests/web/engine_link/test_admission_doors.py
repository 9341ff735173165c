"""One admission path, two doors: the same admission cases through the live Proxy over HTTP
(ProxyEngineClient) and through the in-process client (LocalEngineClient), both running
engine.proxy.intake.Intake.admit, get the same answers.

The in-process door is given what the Proxy fixture's engine is (a Request Monitor bounding the queue
at 2, one instance of the first stage and none published after it, nothing measured yet) and reads the
in-flight figures from the same real Redis; the two doors run one after the other on an emptied store.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from engine.proxy.intake import Intake
from engine.proxy.monitor import Load, RequestMonitor
from engine.store import JobStore
from engine.workflow import InvalidRequest, images
from engine.workflow.options import Options
from onepiece_platform.engine_link.client import Accepted, EngineClient, EngineRejected
from onepiece_platform.engine_link.local import LocalEngineClient
from onepiece_platform.engine_link.proxy import ProxyEngineClient
from tests.fixtures.web import png, sd_body

pytestmark = pytest.mark.django_db
SD = sd_body()["params"]
WAN = {"prompt": "a cat", "height": 64, "width": 64, "num_frames": 9, "num_inference_steps": 2}
MAX_QUEUE = 2  # the Proxy fixture's RequestMonitor
FIRST, SECOND = uuid.uuid4().hex, uuid.uuid4().hex


def _answer(engine: EngineClient, workflow: str, params: dict[str, Any], inputs: dict[str, bytes] | None = None,
            uid: str | None = None, **options: Any) -> tuple[Any, ...]:
    """What a door answers: the acceptance's fields, or the refusal's status, field, Retry-After and text.
    ``options``: the request's (engine.workflow.options.Options), beside its params."""
    try:
        acc = engine.submit(workflow, params, inputs or {}, Options(**options), uid=uid)
    except EngineRejected as exc:
        return ("refused", exc.status, exc.field, exc.retry_after, exc.message)
    assert isinstance(acc, Accepted)
    return ("accepted", acc.uid if uid else len(acc.uid), acc.cost_gpu_s, acc.predicted_wait_s)


def _cases(engine: EngineClient) -> dict[str, tuple[Any, ...]]:
    """Every admission case, in an order that fills the queue: nothing in flight, then one, then two."""
    over = b"\x89PNG" + b"\0" * (images.MAX_BYTES - 3)  # one byte over the image limit
    return {
        "bad param": _answer(engine, "sd-t2i", {**SD, "height": 65}),
        "bad uid": _answer(engine, "sd-t2i", SD, uid="X" * 32),
        "missing input": _answer(engine, "wan2.1-i2v", WAN),
        "oversize": _answer(engine, "wan2.1-i2v", WAN, {"image": over}),
        "unknown workflow": _answer(engine, "nope", SD),
        "accepted": _answer(engine, "sd-t2i", SD, uid=FIRST, deadline_s=600),
        "taken uid": _answer(engine, "sd-t2i", SD, uid=FIRST),
        "low at half fill": _answer(engine, "sd-t2i", SD, priority="low"),
        "over budget": _answer(engine, "sd-t2i", SD, deadline_s=0.005),
        "accepted, drawn uid": _answer(engine, "wan2.1-i2v", WAN, {"image": png()}),
        "accepted second": _answer(engine, "sd-t2i", SD, uid=SECOND),
        "queue full": _answer(engine, "sd-t2i", SD),
    }


def _in_flight(store: JobStore) -> tuple[Any, ...]:
    """What the store holds after a door's cases: in flight per workflow, the events, the callers' UIDs."""
    events = store.events()
    return (store.inflight("sd-t2i")[0], store.inflight("wan2.1-i2v")[0], sorted(e["type"] for e in events),
            sorted({e["uid"] for e in events} & {FIRST, SECOND}))


def test_both_doors_answer_every_admission_case_alike(proxy_url: str, store: JobStore) -> None:
    through_proxy = _cases(ProxyEngineClient(proxy_url, timeout=30))
    proxy_left = _in_flight(store)
    store.r.flushdb()

    def load(workflow: str) -> Load:  # the Proxy fixture's engine, from the same store
        return Load(*store.inflight(workflow), instances=1, entry_instances=1)

    in_process = _cases(LocalEngineClient(Intake(monitor=RequestMonitor(MAX_QUEUE)), load))
    assert _in_flight(store) == proxy_left

    # the oversize image is refused by the Proxy while it reads the base64 (before decoding it), in-process
    # by the image check: the same status and field, worded by the step that caught it
    assert through_proxy.pop("oversize")[:4] == in_process.pop("oversize")[:4] == ("refused", 413, "image", None)
    assert through_proxy == in_process
    # and the answers are the ones each case means
    got = through_proxy
    assert [got[k][1:3] for k in ("bad param", "bad uid", "missing input", "unknown workflow")] == [
        (400, "height"), (400, "uid"), (400, "image"), (400, "workflow")]
    # a priority the engine does not know never reaches a door: the request's Options refuse it, naming it
    # (the Proxy's HTTP body is checked by the same code: tests/engine/proxy)
    with pytest.raises(InvalidRequest) as err:
        Options(priority="urgent")
    assert err.value.field == "priority"
    assert got["accepted"][:2] == ("accepted", FIRST) and got["accepted"][2] > 0
    assert got["accepted, drawn uid"][:2] == ("accepted", 32)
    assert got["taken uid"][1:3] == (409, "uid")
    for case in ("low at half fill", "over budget", "queue full"):
        assert got[case][1] == 503 and got[case][3] >= 1, case
    assert "low priority is admitted while the queue is below 50%" in got["low at half fill"][4]
    assert "deadline" in got["over budget"][4] and "queue full (2 requests in flight)" in got["queue full"][4]
    assert proxy_left == (MAX_QUEUE, 1, ["accepted"] * 3, sorted([FIRST, SECOND]))
