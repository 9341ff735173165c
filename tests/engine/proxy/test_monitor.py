"""The Request Monitor decides at once from a snapshot; the Proxy's modules stay light."""

from __future__ import annotations

import subprocess
import sys

import pytest

from engine.proxy.monitor import Load, RequestMonitor
from tests.conftest import REPO_ROOT


def test_admits_when_there_is_room() -> None:
    d = RequestMonitor(4, dispatch_s=0.0).decide(Load(1, 10.0, 5, 1), cost=3.0, now=100.0, deadline=None)
    assert d.admit and d.predicted_wait_s == 2.0


def test_rejects_a_full_queue_with_retry_after() -> None:
    d = RequestMonitor(2).decide(Load(2, 9.0, 2, 1), cost=1.0, now=0.0, deadline=None)
    assert not d.admit and "queue full" in d.reason and d.retry_after == 5


def test_rejects_what_cannot_start_before_its_deadline() -> None:
    m = RequestMonitor(100, dispatch_s=0.5)
    load = Load(3, 30.0, 3, 1)  # 10 s of work ahead per instance
    assert not m.decide(load, 1.0, now=0.0, deadline=10.4).admit
    assert m.decide(load, 1.0, now=0.0, deadline=10.6).admit
    # even an idle workflow cannot start a request sooner than the hand-off takes
    assert not m.decide(Load(0, 0.0, 3, 1), 1.0, now=0.0, deadline=0.4).admit


def test_rejects_without_instances() -> None:
    d = RequestMonitor(10).decide(Load(0, 0.0, 0, 0), 1.0, 0.0, None)
    assert not d.admit and d.retry_after >= 1


def test_bad_bound() -> None:
    with pytest.raises(ValueError):
        RequestMonitor(0)


def test_proxy_node_and_cli_import_no_torch() -> None:
    code = ("import sys, engine.cli, engine.proxy.app, engine.proxy.cli, engine.worker.manager, "
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
