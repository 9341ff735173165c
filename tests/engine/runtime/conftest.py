"""A real one-node deployment for the runtime tests, started once per session.

Redis and etcd (the session fixtures), the tiny models, ``onepiece node`` with
one worker process per stage of both workflows, and ``onepiece proxy``: the
same commands an operator runs (tests.fixtures.runtime).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.runtime import SD_STEP_DELAY_S, Cluster, NodeRun, engine


@pytest.fixture(scope="session")
def one_node(redis_server: Any, etcd_server: Any, tiny_models: dict[str, Path],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    from engine.coord import etcd_client
    from engine.store import JobStore
    from engine.worker.config import Assignment, default_assignment

    store = JobStore.from_url(redis_server.url, ttl=600)
    store.r.flushdb()
    store.close()
    root = f"/test-{os.getpid()}-one-node"  # its own etcd root: no other test's keys or wipes reach it
    etcd = etcd_client(etcd_server.url)
    etcd.delete_prefix(root + "/")
    from onepiece_launcher.up import DEFAULT_WORKFLOWS

    # the first three workflows, as `onepiece up` serves them: the Wan2.1 pair's umT5, VAE and mp4 stages are
    # stage pools shared by both (engine.workflow.pools), so every Wan test here runs through them
    base = default_assignment({k: str(tiny_models[k]) for k in DEFAULT_WORKFLOWS}, device="cpu")
    instances = tuple(
        replace(i, step_delay_s=SD_STEP_DELAY_S if i.id == "sd-t2i.denoise.0" else 0.0) for i in base.instances
    )
    node = NodeRun("test-node", Assignment(instances, base.model_dirs))
    with engine(redis_server.url, etcd_server.url, [node], tmp_path_factory.mktemp("node"),
                f"test-{os.getpid()}-", root=root) as (c, _procs):
        yield c
    etcd.delete_prefix(root + "/")
