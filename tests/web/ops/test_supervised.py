"""/readyz and the dashboard's cluster view show ``onepiece up``'s children as its supervisor reports them:
degraded while one is down or restarting, ok once it is up again (a real supervisor over a real child)."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from engine.embedded.supervisor import Child, RestartPolicy, Supervisor


@pytest.fixture
def supervisor(tmp_path: Path, settings: Any, web_redis: str) -> Any:
    (tmp_path / "logs").mkdir()
    sup = Supervisor(tmp_path, lambda line: None, RestartPolicy(initial_s=1.0, up_after_s=5.0))
    settings.ONEPIECE = {**settings.ONEPIECE, "SUPERVISOR_STATUS": str(sup.status_path)}
    child = sup.watch(Child("reconciler", lambda: subprocess.Popen(["sleep", "600"]),
                            subprocess.Popen(["sleep", "600"])))
    yield sup, child
    child.terminate()


def test_readyz_is_degraded_while_a_supervised_child_is_down(supervisor: Any, db: None) -> None:
    sup, child = supervisor
    body = Client().get("/readyz").json()
    assert body["status"] == "ok" and body["processes"]["reconciler"]["state"] == "up"
    child.proc.send_signal(signal.SIGKILL)
    child.proc.wait()
    t = child.started_at + 100
    sup.tick(t)
    r = Client().get("/readyz")
    body = r.json()
    # degraded, not unready: the web process still serves
    assert r.status_code == 200 and body["status"] == "degraded", body
    assert body["processes"]["reconciler"]["state"] == "down" and body["processes"]["reconciler"]["last_exit"] == -9
    sup.tick(t + 1.0)
    assert Client().get("/readyz").json()["processes"]["reconciler"]["state"] == "starting"
    sup.tick(t + 6.0)
    body = Client().get("/readyz").json()
    assert body["status"] == "ok" and body["processes"]["reconciler"]["restarts"] == 1


def test_readyz_has_no_processes_where_nothing_supervises(web_redis: str, db: None) -> None:
    body = Client().get("/readyz").json()
    assert body == {"status": "ok", "checks": {"database": "ok", "redis": "ok"}}


def test_cluster_view_carries_the_processes(supervisor: Any, db: None, etcd_server: Any, settings: Any) -> None:
    from onepiece_platform.dashboard.consumers import _snapshot
    from onepiece_platform.engine_link.cluster import reset_clusters

    settings.ETCD_URL = etcd_server.url
    reset_clusters()
    sup, child = supervisor
    child.proc.send_signal(signal.SIGKILL)
    child.proc.wait()
    sup.tick(child.started_at + 100)
    try:
        assert _snapshot()["processes"]["reconciler"]["state"] == "down"
    finally:
        reset_clusters()
