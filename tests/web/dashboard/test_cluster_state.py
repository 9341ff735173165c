"""What the cluster view is fed: nodes' device telemetry, Theorem 1's recommendation, work per stage."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.web.cluster_root import cluster_root

pytestmark = pytest.mark.django_db
WF = "sd-t2i"
TIMES = {"text_encode": 0.01, "denoise": 0.3, "vae_decode": 0.05, "image_encode": 0.01}
GPU = {"kind": "gpu", "index": 0, "name": "NVIDIA H200", "utilisation": 81.0, "memory_used": 40 << 30,
       "memory_total": 141 << 30, "temperature_c": 61.0, "source": "nvml"}


@pytest.fixture
def root(etcd_server: Any, settings: Any, web_redis: str) -> Iterator[tuple[str, Any]]:
    with cluster_root(etcd_server.url, settings, "onepiece-dash") as pair:
        yield pair


def test_snapshot_carries_devices_and_the_leaders_recommended_counts(root) -> None:
    from engine.coord.keys import Keyspace
    from engine.manager.node_manager import ManagerConfig, NodeManager
    from onepiece_platform.engine_link.cluster import get_cluster
    from tests.fixtures.coord import leading_election

    prefix, client = root
    instances = {f"{WF}.{s}.0": {"workflow": WF, "stage": s, "last_stage_s": t, "ready": True}
                 for s, t in TIMES.items()}
    client.put(Keyspace(prefix).node("n1"), json.dumps({"node": "n1", "ts": time.time(), "instances": instances,
                                                 "devices": [GPU, {**GPU, "index": 1}]}))
    election = leading_election(client, prefix, "nm-a", ttl=60)
    manager = NodeManager(client, election, ManagerConfig(workflows={WF: "/models/sd"}, root=prefix,
                                                          slots_per_node=5))
    try:
        manager.tick()
    finally:
        election.resign()
    snap = get_cluster().snapshot()
    assert [d["index"] for d in snap["nodes"]["n1"]["devices"]] == [0, 1]
    cap = snap["capacity"][WF]
    # 5 slots for a 4-stage chain whose denoise is 6-30x slower than the rest: the fifth goes to denoise
    assert cap["recommended"] == {"text_encode": 1, "denoise": 2, "vae_decode": 1, "image_encode": 1}
    assert cap["service_s"]["denoise"] == pytest.approx(0.3)
    assert cap["fence_token"] is not None  # written by the leader, fenced like its other writes


def test_consumer_snapshot_counts_work_waiting_per_stage(root) -> None:
    from django.contrib.auth import get_user_model

    from onepiece_platform.dashboard.consumers import _snapshot
    from onepiece_platform.jobs.models import Job

    owner = get_user_model().objects.create_user("someone")
    Job.objects.create(uid="a" * 32, owner=owner, workflow=WF)
    Job.objects.create(uid="b" * 32, owner=owner, workflow=WF, state="in_progress", stage="denoise")
    Job.objects.create(uid="c" * 32, owner=owner, workflow=WF, state="in_progress", stage="denoise")
    Job.objects.create(uid="d" * 32, owner=owner, workflow=WF, state="completed", stage="image_encode")
    snap = _snapshot()
    assert snap["waiting"] == {WF: {"queued": 1, "stages": {"denoise": 2}}}
    assert snap["jobs"] == {"queued": 1, "in_progress": 2, "completed": 1}
    assert snap["capacity"] == {}  # no Node Manager leads this root
