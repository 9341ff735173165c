"""The one intake (engine.proxy.intake.Intake): validation, cost, admission, acceptance and injection, the
same for the Proxy's HTTP handler and the in-process engine client. Rules without services; acceptance on
a real redis-server."""

from __future__ import annotations

import base64
import io
import json
import uuid
from typing import Any

import pytest

from engine.proxy.intake import Admitted, InProcessPorts, Intake, Overloaded, Ticket
from engine.proxy.monitor import Load, RequestMonitor
from engine.proxy.parsing import BadRequest
from engine.store import JobStore, keys
from engine.workflow import message as wm

SD = {"prompt": "a cat", "height": 64, "width": 64, "num_inference_steps": 2}
WAN = {"prompt": "a cat", "height": 32, "width": 32, "num_frames": 5, "num_inference_steps": 2}


def _png(w: int = 16, h: int = 16) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (1, 2, 3)).save(buf, "PNG")
    return buf.getvalue()


def _body(**doc: Any) -> bytes:
    return json.dumps(doc).encode()


def test_parse_and_submission_answer_alike() -> None:
    intake = Intake()
    body = _body(workflow="wan2.1-i2v", params=WAN, inputs={"image": base64.b64encode(_png()).decode()},
                 deadline_s=30, priority="high")
    parsed = intake.parse(body, "application/json")
    direct = intake.submission("wan2.1-i2v", WAN, {"image": _png()}, 30, "high")
    assert parsed.params == direct.params and parsed.inputs == direct.inputs and parsed.priority == 1 == direct.priority
    assert parsed.deadline is not None and direct.deadline is not None


@pytest.mark.parametrize(("workflow", "params", "inputs", "field", "status"), [
    ("nope", SD, {}, "workflow", 400),
    ("sd-t2i", {**SD, "steps": 3}, {}, "steps", 400),
    ("sd-t2i", SD, {"image": b"x"}, "image", 400),  # an input the workflow does not take
    ("wan2.1-i2v", WAN, {}, "image", 400),
    ("wan2.1-i2v", WAN, {"image": b"not an image"}, "image", 400),
    ("wan2.1-i2v", WAN, {"image": b"\x89PNG" + b"0" * 5000}, "image", 413),  # over the intake's 4 KiB
])
def test_submission_refuses_with_the_field(workflow: str, params: dict[str, Any], inputs: dict[str, bytes],
                                           field: str, status: int) -> None:
    with pytest.raises(BadRequest) as exc:
        Intake(max_image_bytes=4096).submission(workflow, params, inputs)
    assert (exc.value.field, exc.value.status) == (field, status)


def test_an_image_over_the_pixel_limit_is_refused() -> None:
    with pytest.raises(BadRequest, match="pixels") as exc:
        Intake(max_image_pixels=100).submission("wan2.1-i2v", WAN, {"image": _png(16, 16)})
    assert exc.value.field == "image"


def test_a_ticket_carries_uid_message_and_cost() -> None:
    intake = Intake()
    uid = uuid.uuid4().hex
    ticket = intake.ticket(intake.submission("sd-t2i", SD, {}, uid=uid))
    assert ticket.uid == uid and ticket.entry == "text_encode"
    assert ticket.cost == pytest.approx(ticket.sub.spec.estimate_gpu_seconds(ticket.sub.params))
    assert wm.decode(ticket.message).header.uid == uid
    assert intake.ticket(intake.submission("sd-t2i", SD, {})).uid != uid  # drawn when not given
    intake.check_fits(ticket, None)
    intake.check_fits(ticket, len(ticket.message))
    with pytest.raises(BadRequest) as exc:
        intake.check_fits(ticket, len(ticket.message) - 1)
    assert exc.value.status == 413


def _load(inflight: int) -> Load:
    return Load(inflight, 0.0, instances=4, entry_instances=1)


def test_admission_is_the_monitors_and_none_admits_everything() -> None:
    free, bounded = Intake(), Intake(monitor=RequestMonitor(max_queue=2))
    ticket = free.ticket(free.submission("sd-t2i", SD, {}))
    assert free.decide(ticket, _load(100), 0.0).admit and free.room({"sd-t2i": _load(100)}, 0.0).admit
    assert bounded.decide(ticket, _load(0), 0.0).admit
    refusal = bounded.decide(ticket, _load(100), 0.0)
    assert not refusal.admit and refusal.retry_after >= 1
    assert bounded.room({"sd-t2i": _load(100), "wan2.1-i2v": _load(0)}, 0.0).admit
    assert not bounded.room({"sd-t2i": _load(100)}, 0.0).admit


def test_admit_accepts_once_then_injects(job_store: JobStore) -> None:
    intake, injected = Intake(), []
    uid = uuid.uuid4().hex
    admitted = intake.admit_sync(intake.ticket(intake.submission("sd-t2i", SD, {}, uid=uid)),
                                 InProcessPorts(job_store, inject=injected.append))
    ticket = admitted.ticket
    assert isinstance(admitted, Admitted) and isinstance(ticket, Ticket) and injected == [ticket]
    st = job_store.status(uid)
    assert st is not None and st.state == keys.QUEUED
    assert job_store.inflight("sd-t2i") == (1, pytest.approx(ticket.cost))
    with pytest.raises(BadRequest) as exc:
        intake.admit_sync(intake.ticket(intake.submission("sd-t2i", SD, {}, uid=uid)),
                          InProcessPorts(job_store, inject=injected.append))
    assert (exc.value.status, exc.value.field) == (409, "uid") and len(injected) == 1


def test_admit_refuses_when_there_is_no_room(job_store: JobStore) -> None:
    intake = Intake(monitor=RequestMonitor(max_queue=1))
    with pytest.raises(Overloaded) as exc:
        intake.admit_sync(intake.ticket(intake.submission("sd-t2i", SD, {})),
                          InProcessPorts(job_store, load=lambda wf: _load(10)))
    assert exc.value.decision.retry_after >= 1
    assert job_store.inflight("sd-t2i") == (0, 0.0) and job_store.events() == []


def test_a_failure_before_the_acceptance_leaves_nothing_accepted(job_store: JobStore) -> None:
    """Whatever the admission computes for an accepted request (its ETA's stage seconds) is computed before the
    acceptance: when it fails, the client's 503 means what it says (nothing queued, no in-flight count, a retry
    with the same UID is not a 409)."""
    class Broken(InProcessPorts):
        def stage_seconds(self, ticket: Ticket) -> list[float]:
            raise RuntimeError("pricing failed")

    intake, injected = Intake(), []
    uid = uuid.uuid4().hex
    with pytest.raises(Overloaded):
        intake.admit_sync(intake.ticket(intake.submission("sd-t2i", SD, {}, uid=uid)), Broken(job_store))
    assert job_store.status(uid) is None and job_store.inflight("sd-t2i") == (0, 0.0)
    admitted = intake.admit_sync(intake.ticket(intake.submission("sd-t2i", SD, {}, uid=uid)),
                                 InProcessPorts(job_store, inject=injected.append))
    assert admitted.ticket.uid == uid and injected == [admitted.ticket]
