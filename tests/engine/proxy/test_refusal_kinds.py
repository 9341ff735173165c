"""Two kinds of refusal: a request that can never fit (its own stage work over its deadline on an idle engine)
is a 400 naming ``deadline_s``, never a 503 a client retries; a refusal for load is a 503 whose Retry-After is
the time the measured drain rate takes to make room."""

from __future__ import annotations

import math

import pytest

from engine.proxy.intake import InProcessPorts, Intake, Overloaded
from engine.proxy.monitor import Load, RequestMonitor
from engine.proxy.parsing import BadRequest
from engine.store import JobStore
from engine.workflow.pricing import Pricer, Samples

SD = {"prompt": "a cat", "height": 256, "width": 256, "num_inference_steps": 50}


def test_work_over_the_deadline_on_an_idle_engine_is_final() -> None:
    m = RequestMonitor(1000)
    idle = Load(0, 0.0, 4, 1, drain_rps=2.0, base_latency_s=0.5)
    d = m.decide(idle, 1.0, 0.0, 120.0, own_s=751.0)
    assert not d.admit and d.final and "751s of stage work here" in d.reason
    # over its deadline because of the line ahead, not of itself: a load refusal, to retry
    busy = Load(200, 0.0, 4, 1, drain_rps=2.0, base_latency_s=0.5)
    d = m.decide(busy, 1.0, 0.0, 120.0, own_s=60.0)
    assert not d.admit and not d.final and "cannot" in d.reason


def test_a_load_refusal_says_when_the_drain_rate_makes_room() -> None:
    # the queue bound: 13 in flight, 10 allowed: 4 must finish, at 2 a second
    full = RequestMonitor(10, dispatch_s=0.0).decide(Load(13, 0.0, 4, 1, drain_rps=2.0), 1.0, 0.0, None)
    assert not full.admit and not full.final and full.retry_after == 2
    # the deadline: 60 s of its own work, 100 s left; with the x1.2 margin it fits behind at most
    # (100 / 1.2 - 60) * 2 = 46.7 requests: 4 of the 50 ahead must drain first (2 s), not all 50 (25 s)
    m = RequestMonitor(1000, dispatch_s=0.0)
    late = m.decide(Load(50, 0.0, 4, 1, drain_rps=2.0), 1.0, 0.0, 100.0, own_s=60.0)
    assert not late.admit and not late.final and "cannot finish" in late.reason
    assert late.retry_after == math.ceil(4 / 2.0) < math.ceil(late.predicted_wait_s)
    # and once they have, it is admitted
    assert m.decide(Load(46, 0.0, 4, 1, drain_rps=2.0), 1.0, 0.0, 100.0, own_s=60.0).admit


def _priced_intake(per_step_s: float) -> Intake:
    """An intake whose sd-t2i denoise was calibrated at ``per_step_s`` a step, whatever the size."""
    samples = Samples()
    for side in (64, 128, 256):
        fitted = samples.calibrated(side * side, 1, per_step_s)
    pricer = Pricer()
    pricer.update({("sd-t2i", "denoise"): [fitted]})
    return Intake(monitor=RequestMonitor(64), price=pricer.price)


def test_the_intake_answers_a_request_that_can_never_fit_with_a_400(job_store: JobStore) -> None:
    load = Load(0, 0.0, 4, 1, drain_rps=2.0)
    intake = _priced_intake(15.0)  # 50 steps: 750 s of work
    ticket = intake.ticket(intake.submission("sd-t2i", SD, {}, deadline_s=120))
    with pytest.raises(BadRequest) as exc:
        intake.admit_sync(ticket, InProcessPorts(job_store, load=lambda wf: load))
    assert (exc.value.status, exc.value.field) == (400, "deadline_s") and "of stage work here" in str(exc.value)
    assert job_store.status(ticket.uid) is None and job_store.inflight("sd-t2i") == (0, 0.0)
    # a low-priority one too: it is not about its place in line
    low = intake.ticket(intake.submission("sd-t2i", SD, {}, deadline_s=120, priority="low"))
    with pytest.raises(BadRequest):
        intake.admit_sync(low, InProcessPorts(job_store, load=lambda wf: load))
    # the same request without a deadline is queued; one that fits is admitted
    intake.admit_sync(intake.ticket(intake.submission("sd-t2i", SD, {})), InProcessPorts(job_store, load=lambda wf: load))
    fits = _priced_intake(0.5)
    fits.admit_sync(fits.ticket(fits.submission("sd-t2i", SD, {}, deadline_s=120)),
                    InProcessPorts(job_store, load=lambda wf: load))


def test_the_intake_keeps_503_for_load(job_store: JobStore) -> None:
    intake = _priced_intake(0.5)  # 25 s of its own work
    crowded = Load(64, 0.0, 4, 1, drain_rps=2.0)
    with pytest.raises(Overloaded) as exc:
        intake.admit_sync(intake.ticket(intake.submission("sd-t2i", SD, {}, deadline_s=120)),
                          InProcessPorts(job_store, load=lambda wf: crowded))
    # one of the 64 must finish (0.5 s at 2 a second), not all of them (32 s)
    assert not exc.value.decision.final and exc.value.decision.retry_after == 1
