"""The Request Monitor decides at once from a snapshot; the Proxy's modules stay light."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.proxy.drain import DrainMeter
from engine.proxy.monitor import Load, RequestMonitor
from tests.fixtures import REPO_ROOT


def test_admits_when_there_is_room() -> None:
    d = RequestMonitor(4, dispatch_s=0.0).decide(Load(1, 10.0, 5, 1), cost=3.0, now=100.0, deadline=None)
    assert d.admit and d.predicted_wait_s == 2.0


def test_rejects_a_full_queue_with_retry_after() -> None:
    d = RequestMonitor(2).decide(Load(2, 9.0, 2, 1), cost=1.0, now=0.0, deadline=None)
    assert not d.admit and "queue full" in d.reason and d.retry_after == 5


def test_rejects_what_cannot_start_or_finish_before_its_deadline() -> None:
    m = RequestMonitor(100, dispatch_s=0.5)
    load = Load(3, 30.0, 3, 1)  # 10 s of work ahead per instance
    d = m.decide(load, 1.0, now=0.0, deadline=10.4)
    assert not d.admit and "cannot start" in d.reason
    # it could start at 10.5 s, but its own second of work ends at 11.5 s (x1.2 margin: 13.8 s)
    d = m.decide(load, 1.0, now=0.0, deadline=10.6)
    assert not d.admit and "cannot finish" in d.reason and d.predicted_finish_s == pytest.approx(11.5)
    assert m.decide(load, 1.0, now=0.0, deadline=13.9).admit
    # even an idle workflow cannot start a request sooner than the hand-off takes
    assert not m.decide(Load(0, 0.0, 3, 1), 1.0, now=0.0, deadline=0.4).admit


def test_rejects_without_instances() -> None:
    d = RequestMonitor(10).decide(Load(0, 0.0, 0, 0), 1.0, 0.0, None)
    assert not d.admit and d.retry_after >= 1


def test_bad_bound() -> None:
    with pytest.raises(ValueError):
        RequestMonitor(0)


def test_proxy_node_and_cli_import_no_torch() -> None:
    code = ("import sys, engine.cli, engine.proxy.app, engine.proxy.cli, engine.worker.taskmanager, "
            "engine.worker.node_cli; engine.cli.build_parser(); "
            "bad = [m for m in ('torch', 'diffusers', 'django') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO_ROOT)


def test_measured_capacity_from_the_node_manager_drives_the_prediction() -> None:
    m = RequestMonitor(max_queue=100, dispatch_s=0.0)
    prior = Load(inflight=10, inflight_cost=100.0, instances=10, entry_instances=1)
    measured = Load(inflight=10, inflight_cost=100.0, instances=10, entry_instances=1, capacity_rps=0.5)
    assert m.predicted_wait(prior) == pytest.approx(10.0)  # 100 GPU-s over 10 instances
    assert m.predicted_wait(measured) == pytest.approx(20.0)  # 10 requests at 0.5 req/s
    assert not m.decide(measured, 1.0, now=0.0, deadline=15.0).admit
    assert m.decide(prior, 1.0, now=0.0, deadline=15.0).admit


def test_the_measured_drain_rate_wins_over_the_node_managers_capacity() -> None:
    """On a shared host Theorem 1 over stage times overestimates (the stages share cores): 20 req/s
    published, 5 req/s seen leaving the engine while it was saturated. With 40 in flight and a 10 s
    deadline, trusting the published figure would accept a request that finishes after 8.2 s; with the
    1.2 margin (9.84 s) it is accepted against 10 s and refused against 9.5 s."""
    m = RequestMonitor(max_queue=64, dispatch_s=0.0)
    published = Load(40, 40.0, 3, 1, capacity_rps=20.0, base_latency_s=0.1)
    measured = Load(40, 40.0, 3, 1, capacity_rps=20.0, drain_rps=5.0, base_latency_s=0.1)
    assert m.predicted_finish(published, 1.0) == pytest.approx(41 / 20.0)  # what trusting it would promise
    assert m.decide(measured, 1.0, now=0.0, deadline=10.0).admit
    d = m.decide(measured, 1.0, now=0.0, deadline=9.5)
    assert not d.admit and d.predicted_finish_s == pytest.approx(41 / 5.0)
    assert d.retry_after == 1  # 2 of the 40 must drain first (0.4 s at 5 a second), not the whole line (8 s)
    # an idle pipeline still takes its unloaded latency: a deadline shorter than that is refused
    idle = Load(0, 0.0, 3, 1, capacity_rps=20.0, drain_rps=5.0, base_latency_s=2.0)
    assert not m.decide(idle, 1.0, now=0.0, deadline=2.2).admit
    assert m.decide(idle, 1.0, now=0.0, deadline=2.5).admit


def test_drain_meter_reports_a_rate_only_while_saturated() -> None:
    meter = DrainMeter(window_s=5.0, min_finished=8, keep_s=30.0)
    # 2 requests in flight, 3 instances: the engine is not saturated; its rate measures the arrivals
    for i in range(41):
        meter.record("wf", i * 0.25, inflight=2, finished=i, instances=3)
    assert meter.rate("wf", 10.0) is None
    # a backlog of 20 for 6 s while 4 jobs per second leave: that is the engine's capacity
    for i in range(25):
        meter.record("wf", 10.0 + i * 0.25, inflight=20, finished=40 + i, instances=3)
    assert meter.rate("wf", 16.0) == pytest.approx(4.0)
    # remembered for keep_s after the backlog is gone, then forgotten
    meter.record("wf", 17.0, inflight=0, finished=70, instances=3)
    assert meter.rate("wf", 40.0) == pytest.approx(4.0)
    assert meter.rate("wf", 47.0) is None
    # a counter that went backwards (Redis lost and restarted): start afresh
    meter.record("wf", 48.0, inflight=20, finished=0, instances=3)
    assert meter.rate("wf", 48.0) is None


def test_before_any_measured_rate_a_deadline_request_queues_no_deeper_than_twice_the_instances() -> None:
    """The Node Manager says 20 req/s (devices of their own); until the Proxy has seen what the engine
    finishes while saturated, requests with deadlines fill the pipeline (2 x 4 instances) and no more."""
    m = RequestMonitor(max_queue=64, dispatch_s=0.0)
    assert m.decide(Load(7, 7.0, 4, 1, capacity_rps=20.0), 1.0, now=0.0, deadline=10.0).admit
    d = m.decide(Load(8, 8.0, 4, 1, capacity_rps=20.0), 1.0, now=0.0, deadline=10.0)
    assert not d.admit and "being measured" in d.reason
    assert m.decide(Load(8, 8.0, 4, 1, capacity_rps=20.0), 1.0, now=0.0, deadline=None).admit  # no deadline
    assert m.decide(Load(40, 40.0, 4, 1, capacity_rps=20.0, drain_rps=8.0), 1.0, now=0.0, deadline=10.0).admit
