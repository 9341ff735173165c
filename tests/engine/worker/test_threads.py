"""CPU thread budgets: decided per node, applied in the worker before torch runs, reported by the node."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from engine.coord import etcd_client
from engine.coord.keys import Keyspace
from engine.worker import threads
from engine.worker.config import Assignment, InstanceSpec
from engine.worker.taskmanager import NodeSettings, TaskManager


def test_budget_shares_the_cores_among_the_instances() -> None:
    assert threads.budget_for(10, cuda=False, cores=2) == 1  # never 0, never the host's count
    assert threads.budget_for(3, cuda=False, cores=16) == 5
    assert threads.budget_for(1, cuda=False, cores=8) == 8
    assert threads.budget_for(8, cuda=True, cores=16) == 1  # a GPU stage needs a launcher thread
    assert threads.budget_for(2, cuda=True, cores=16) == 2
    assert threads.budget_for(10, cuda=False, explicit=3, cores=2) == 3  # the operator's number wins
    assert 1 <= threads.usable_cores() <= (os.cpu_count() or 1)


def test_parse_threads_refuses_nonsense() -> None:
    assert threads.parse_threads("auto") is None and threads.parse_threads(None) is None
    assert threads.parse_threads("4") == 4
    for bad in ("0", "-1", "two", "1.5"):
        with pytest.raises(ValueError, match="positive integer or 'auto'"):
            threads.parse_threads(bad)


def test_env_covers_every_threaded_runtime() -> None:
    env = threads.apply_env({"OMP_NUM_THREADS": "16"}, 2)
    assert all(env[v] == "2" for v in threads.THREAD_VARS)
    assert env[threads.BUDGET_VAR] == "2" and env["OMP_WAIT_POLICY"] == "PASSIVE"


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode().split("=", 1) for kv in raw if b"=" in kv)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("explicit", [None, 2])
def test_node_gives_each_worker_its_budget(redis_server: Any, etcd_server: Any, etcd_root: str, tmp_path: Path,
                                           tiny_models: dict[str, Path], explicit: int | None) -> None:
    """Two torch workers on one node: each process starts with the budget in its environment, torch's
    pool is sized to it (read back by the worker), and the node reports it for the dashboard."""
    etcd, keys = etcd_client(etcd_server.url), Keyspace(etcd_root)  # the test's own root (workers inherit it)
    node = f"threads-{explicit}"
    ids = ("sd-t2i.text_encode.0", "sd-t2i.vae_decode.0")
    etcd.put(keys.assignment(node), Assignment(
        tuple(InstanceSpec(i, "sd-t2i", i.split(".")[1], "cpu") for i in ids),
        {"sd-t2i": str(tiny_models["sd-t2i"])}).to_json())
    tm = TaskManager(NodeSettings(node, etcd_server.url, redis_server.url, tmp_path / "run",
                                  ring_prefix=f"test-{os.getpid()}-thr{explicit}-", ring_slots=16, ring_bytes=1 << 20,
                                  threads_per_instance=explicit))
    want = explicit or threads.inherited() or max(1, threads.usable_cores() // 2)
    tm.start()
    try:
        deadline = time.monotonic() + 200
        while not all(i in tm.instances and tm.instances[i].ready for i in ids):
            assert time.monotonic() < deadline, "workers did not start"
            tm.tick()
            time.sleep(0.1)
        tm._report(force=True)
        report = json.loads(etcd.get(keys.node(node))[0])
        for iid in ids:
            inst = tm.instances[iid]
            assert inst.proc is not None
            env = _environ(inst.proc.pid)
            assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == str(want)
            assert inst.startup["threads"] == want  # torch.get_num_threads() in the worker, after the budget
            assert report["instances"][iid]["threads"] == want
            # its configuration (Redis and etcd URLs, passwords included) is not on its command line
            with open(f"/proc/{inst.proc.pid}/cmdline", "rb") as f:
                argv = f.read().decode().split("\0")
            assert argv[-2:] == [iid, ""] and not any("redis://" in a or "password" in a for a in argv), argv
            assert "redis://" in env["ONEPIECE_WORKER_CONFIG"]
    finally:
        tm.shutdown()
