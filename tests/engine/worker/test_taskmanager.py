"""The TaskManager reconciles worker processes with the assignment in etcd (a real one)."""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path
from typing import Any

from engine.coord import etcd_client
from engine.coord.keys import Keyspace
from engine.transport.ring import attach_producer
from engine.worker.config import Assignment, InstanceSpec
from engine.worker.taskmanager import NodeSettings, TaskManager
from tests.engine.worker.rig import tick_until

ID = "sd-t2i.image_encode.0"  # a torch-free stage with no model components: starts in a second


def _routes(etcd: Any, keys: Keyspace) -> list[str]:
    return [m["key"].decode() for _, m in etcd.get_prefix(keys.routes())]


def test_start_restart_and_remove(redis_server: Any, etcd_server: Any, etcd_root: str, tmp_path: Path) -> None:
    etcd, keys = etcd_client(etcd_server.url), Keyspace(etcd_root)  # the test's own root (its workers inherit it)
    prefix = f"test-{os.getpid()}-tm-"
    ring = Path("/dev/shm", f"onepiece-{prefix}{ID}")
    etcd.put(keys.assignment("n1"), Assignment((InstanceSpec(ID, "sd-t2i", "image_encode", "cpu"),),
                                              {"sd-t2i": str(tmp_path)}).to_json())
    tm = TaskManager(NodeSettings("n1", etcd_server.url, redis_server.url, tmp_path / "run", ring_prefix=prefix,
                                  ring_slots=16, ring_bytes=1 << 20))
    tm.start()
    try:
        tick_until(tm, lambda: tm.instances.get(ID) is not None and tm.instances[ID].ready)
        assert _routes(etcd, keys) == [keys.route("sd-t2i", "image_encode", ID)] and ring.exists()
        first = tm.instances[ID].proc
        assert first is not None

        # a killed worker is restarted on the same ring; its route stays published meanwhile
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
        tm.tick()
        assert tm.instances[ID].restarts == 1 and not tm.instances[ID].ready
        assert len(_routes(etcd, keys)) == 1 and ring.exists()
        tick_until(tm, lambda: tm.instances[ID].ready)
        second = tm.instances[ID].proc
        assert second is not None and second.pid != first.pid
        tm._report(force=True)
        report = json.loads(etcd.get(keys.node("n1"))[0])
        assert report["instances"][ID]["pid"] == second.pid and report["instances"][ID]["restarts"] == 1
        # device telemetry rides on the node report; without NVML it is CPU figures, labelled as such
        dev = report["devices"][0]
        assert dev["memory_total"] > 0
        assert (dev["kind"], dev["source"]) == ("gpu", "nvml") or (
            dev["kind"] == "cpu" and dev["source"].startswith("cpu (no NVML"))

        assert report["instances"][ID]["ring"] == {"bytes": 0.0, "messages": 0.0}  # read from the ring itself
        startup = report["instances"][ID]["startup"]
        assert {"process_s", "load_s", "ring_s", "ready_s"} <= set(startup), startup

        # removed from the assignment with requests queued: route withdrawn at once, the queue served
        # (nothing lost), then the worker exits and the ring is unlinked
        from engine.store import JobStore
        from tests.engine.worker.rig import send_pixels

        store = JobStore.from_url(redis_server.url, ttl=60)
        producer = attach_producer(f"shm://{prefix}{ID}")
        uids = [uuid.uuid4().hex for _ in range(3)]
        for uid in uids:
            store.accept(uid, "sd-t2i", 1.0)
            send_pixels(producer, uid)
        producer.close()
        producer.region.close()
        etcd.put(keys.assignment("n1"), Assignment((), {"sd-t2i": str(tmp_path)}).to_json())
        tick_until(tm, lambda: ID not in tm.instances, timeout=10)  # the next tick after its watch saw the change
        assert tm._assignment_changes.watching  # read on change, not every tick
        assert ID not in tm.instances and _routes(etcd, keys) == [] and [d.spec.id for d in tm.draining] == [ID]
        tick_until(tm, lambda: not tm.draining, timeout=60)
        assert second.poll() == 0 and not ring.exists()
        assert [store.state(u) for u in uids] == ["completed"] * 3
        store.close()
        drained = [m for m in tm.moves if m["event"] == "drained"]
        assert drained[-1]["instance"] == ID and drained[-1]["exit"] == 0 and drained[-1]["drain_s"] > 0
    finally:
        tm.shutdown()
    assert not etcd.get(keys.node("n1"))  # the lease went with the node
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"onepiece-{prefix}")]


def test_a_deposed_leaders_assignment_is_ignored(redis_server: Any, etcd_server: Any, etcd_root: str,
                                                tmp_path: Path) -> None:
    etcd, keys = etcd_client(etcd_server.url), Keyspace(etcd_root)
    tm = TaskManager(NodeSettings("n2", etcd_server.url, redis_server.url, tmp_path / "run",
                                  ring_prefix=f"test-{os.getpid()}-fence-"))
    tm.client = etcd
    one = {"instances": [{"id": ID, "workflow": "sd-t2i", "stage": "image_encode"}],
           "model_dirs": {"sd-t2i": str(tmp_path)}}
    etcd.put(keys.assignment("n2"), json.dumps({**one, "fence_token": 7}))
    tm._read_assignment()
    assert [i.id for i in tm.desired.instances] == [ID] and tm.fence_token == 7
    etcd.put(keys.assignment("n2"), json.dumps({"instances": [], "model_dirs": {}, "fence_token": 5}))
    tm._read_assignment()
    assert [i.id for i in tm.desired.instances] == [ID]  # the older leader's write is refused
    etcd.put(keys.assignment("n2"), json.dumps({"instances": [], "model_dirs": {}, "fence_token": 9}))
    tm._read_assignment()
    assert tm.desired.instances == () and tm.fence_token == 9
    etcd.put(keys.assignment("n2"), "{not json")
    tm._read_assignment()
    assert tm.fence_token == 9  # malformed: ignored, last desired state kept
