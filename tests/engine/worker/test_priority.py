"""Stage workers below the control plane: the node starts every worker (and every restart) nice levels below
itself, every thread of it included, reports it, and a host that refuses says so once without failing."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from engine.coord import etcd_client
from engine.coord.keys import Keyspace
from engine.worker import priority
from engine.worker.config import Assignment, InstanceSpec
from engine.worker.taskmanager import NodeSettings, TaskManager
from tests.engine.worker.rig import tick_until

ID = "sd-t2i.image_encode.0"  # torch-free, no model components: starts in a second


def _thread_nices(pid: int) -> set[int]:
    """The niceness of every thread of ``pid`` (field 19 of each task's stat; niceness is per thread)."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        out.add(int(stat.rsplit(")", 1)[1].split()[16]))
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("nice", [priority.DEFAULT, 0])
def test_node_starts_workers_below_itself(redis_server: Any, etcd_server: Any, etcd_root: str, tmp_path: Path,
                                          nice: int) -> None:
    etcd, keys = etcd_client(etcd_server.url), Keyspace(etcd_root)  # the test's own root (workers inherit it)
    node = f"nice-{nice}"
    etcd.put(keys.assignment(node), Assignment((InstanceSpec(ID, "sd-t2i", "image_encode", "cpu"),),
                                               {"sd-t2i": str(tmp_path)}).to_json())
    tm = TaskManager(NodeSettings(node, etcd_server.url, redis_server.url, tmp_path / "run",
                                  ring_prefix=f"test-{os.getpid()}-nice{nice}-", ring_slots=16, ring_bytes=1 << 20,
                                  worker_nice=nice))
    base = os.getpriority(os.PRIO_PROCESS, 0)  # the node's own: the worker's is relative to it
    want = min(19, base + nice)
    tm.start()
    try:
        for attempt in range(2):  # the first start, then a restart after a SIGKILL
            tick_until(tm, lambda: ID in tm.instances and tm.instances[ID].ready, every=0.05)
            proc = tm.instances[ID].proc
            assert proc is not None
            # serving by now: its route refresher, store and ring threads exist, and each inherited the niceness
            assert os.getpriority(os.PRIO_PROCESS, proc.pid) == want
            assert _thread_nices(proc.pid) == {want}
            assert tm.instances[ID].startup["nice"] == want  # what the worker itself read after lowering it
            tm._report(force=True)
            report = json.loads(etcd.get(keys.node(node))[0])
            assert report["instances"][ID]["nice"] == want
            assert (report["nice"], report["worker_nice"]) == (base, nice)
            if attempt == 0:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                tm.tick()
                assert not tm.instances[ID].ready
        assert tm.instances[ID].restarts == 1
    finally:
        tm.shutdown()


def test_a_refusing_host_leaves_the_worker_running(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    def refuse(n: int) -> int:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "nice", refuse)
    log = logging.getLogger("test.priority")
    with caplog.at_level(logging.WARNING, "test.priority"):
        assert priority.lower(10, log) == os.getpriority(os.PRIO_PROCESS, 0)
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "priority" in caplog.text
    assert priority.lower(0, log) == os.getpriority(os.PRIO_PROCESS, 0)  # off: no call, no warning
    assert len(caplog.records) == 1


def test_the_node_warns_once_when_workers_sit_above_their_priority(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    from engine.worker.taskmanager import _Instance

    tm = TaskManager(NodeSettings("warn", "http://127.0.0.1:1", "redis://127.0.0.1:1", tmp_path, worker_nice=5))
    base = os.getpriority(os.PRIO_PROCESS, 0)
    spec = InstanceSpec(ID, "sd-t2i", "image_encode", "cpu")
    with caplog.at_level(logging.WARNING, "onepiece.node"):
        tm._check_nice(_Instance(spec, "shm://x", "/", "least-outstanding", startup={"nice": min(19, base + 5)}))
        assert not caplog.records  # as asked: nothing to say
        for _ in range(3):  # every start of a refused worker: one warning for the node
            tm._check_nice(_Instance(spec, "shm://x", "/", "least-outstanding", startup={"nice": base}))
    assert len(caplog.records) == (1 if base < 19 else 0)


def _node_args(*argv: str) -> argparse.Namespace:
    from engine.worker.node_cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_node_cli_worker_nice(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from engine.cli import main
    from engine.worker.node_cli import settings_from

    monkeypatch.delenv("ONEPIECE_WORKER_NICE", raising=False)
    urls = ("http://127.0.0.1:1", "redis://127.0.0.1:1")
    assert settings_from(_node_args(), *urls).worker_nice == 10  # on by default: `onepiece up` passes no flag
    monkeypatch.setenv("ONEPIECE_WORKER_NICE", "0")
    assert settings_from(_node_args(), *urls).worker_nice == 0
    assert settings_from(_node_args("--worker-nice", "4"), *urls).worker_nice == 4  # the flag wins
    for bad in ("-1", "20", "high"):  # never above the node, never past Linux's lowest priority
        rc = main(["node", "--etcd-url", urls[0], "--redis-url", urls[1], "--worker-nice", bad])
        assert rc == 2 and "worker nice must be an integer 0..19" in capsys.readouterr().out
