"""Browser tests: the real ASGI app (HTTP + Channels websockets) under uvicorn, driven by Debian's chromium.

uvicorn runs in a thread of the test process so the server shares the test
database (SQLite's shared in-memory database) and the settings fixtures; the
static files handler serves frontend/static as ``runserver`` would with DEBUG off.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures import REPO_ROOT
from tests.web.cluster_root import cluster_root

# web_redis, store (the platform on its own Redis database, tests playing the workers) and celery_broker
# are plugins (tests.fixtures.web, tests.fixtures.celery)
ARTIFACTS = REPO_ROOT / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]

if not Path(CHROMIUM).exists():
    pytest.skip(f"{CHROMIUM} is not installed (Debian package chromium)", allow_module_level=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class AsgiLiveServer:
    def __init__(self) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.start()

    def start(self) -> None:
        """Serve on ``self.port`` (again, after ``stop``: how a test cuts every websocket)."""
        import uvicorn
        from django.contrib.staticfiles.handlers import ASGIStaticFilesHandler

        from onepiece_platform.asgi import application

        config = uvicorn.Config(ASGIStaticFilesHandler(application), host="127.0.0.1", port=self.port,
                                log_level="warning", ws="websockets-sansio", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()), name="browser-asgi",
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture
def etcd_nodes(etcd_server: Any, settings: Any, web_redis: str) -> Iterator[dict[str, Any]]:
    """An etcd root of its own; ``put_node`` registers a node the way a TaskManager reports it."""
    from engine.coord.keys import Keyspace

    with cluster_root(etcd_server.url, settings, "onepiece-browser") as (root, client):
        def put_node(node: str, instances: dict[str, dict[str, Any]],
                     devices: list[dict[str, Any]] | None = None) -> None:
            body = {"node": node, "ts": time.time(), "instances": instances, "devices": devices or []}
            client.put(Keyspace(root).node(node), json.dumps(body))

        yield {"root": root, "client": client, "put_node": put_node}


@pytest.fixture
def live_asgi(transactional_db: None, web_redis: str, etcd_nodes: dict[str, Any]) -> Iterator[AsgiLiveServer]:
    server = AsgiLiveServer()
    yield server
    server.stop()


@pytest.fixture
def browser(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """One chromium per test. Playwright's sync API keeps an event loop on this thread, which makes
    Django refuse ORM calls from the test body; they are plain blocking calls, so allow them here."""
    from playwright.sync_api import sync_playwright

    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def shot(page: Any, name: str) -> Path:
    path = ARTIFACTS / f"dashboard-{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


def make_user(name: str, staff: bool) -> Any:
    from django.contrib.auth import get_user_model

    return get_user_model().objects.create_user(name, password="pw-" + name, is_staff=staff)


def login(page: Any, url: str, name: str) -> None:
    """Through the admin's login form, as an operator would."""
    page.goto(url + "/dashboard/")
    assert "/admin/login/" in page.url  # anonymous: sent to the login form first
    page.fill("#id_username", name)
    page.fill("#id_password", "pw-" + name)
    page.click("input[type=submit]")
    page.wait_for_url(url + "/dashboard/")


def _leader(etcd_nodes: dict[str, Any], workflows: dict[str, str], slots_per_node: int) -> Iterator[Any]:
    """A leading Node Manager ticking in a thread, so actions get a verdict."""
    from engine.manager.node_manager import ManagerConfig, NodeManager
    from tests.fixtures.coord import leading_election

    root, client = etcd_nodes["root"], etcd_nodes["client"]
    election = leading_election(client, root, ttl=60)
    manager = NodeManager(client, election, ManagerConfig(workflows=workflows, root=root,
                                                          slots_per_node=slots_per_node))
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(0.2):
            manager.tick()

    t = threading.Thread(target=run, name="browser-test-leader", daemon=True)
    t.start()
    yield manager
    stop.set()
    t.join(5)
    election.resign()


@pytest.fixture
def leader(etcd_nodes: dict[str, Any]) -> Iterator[Any]:
    """The leader of an sd-t2i cluster, 5 instance slots a node."""
    yield from _leader(etcd_nodes, {"sd-t2i": "/models/sd"}, 5)


@pytest.fixture
def leader_both(etcd_nodes: dict[str, Any]) -> Iterator[Any]:
    """The leader of a cluster serving both workflows, 10 instance slots a node."""
    yield from _leader(etcd_nodes, {"sd-t2i": "/models/sd", "wan2.1-i2v": "/models/wan"}, 10)
