"""The web port as ``onepiece up`` serves it: a real uvicorn process started with the launcher's own
command line (``onepiece_launcher.up.web_command``), against the real Redis, on SQLite.

What only the server process can get wrong: which address a request comes from (uvicorn rewrites the
client address from X-Forwarded-For when told to trust it), and how long a connection that never
finishes its request may hold the server.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from engine import procs
from engine.embedded import free_port
from onepiece_launcher.up import web_command
from tests.fixtures import REPO_ROOT
from tests.slowclient import read_response, trickle

pytestmark = pytest.mark.integration

FAILURES_LIMIT = 3
DEADLINE_S = 1.0  # the head's and the body's (ONEPIECE_HEADER_TIMEOUT_S, ONEPIECE_BODY_TIMEOUT_S)
MARGIN_S = 2.0  # the loop's timer and a loaded 2-core machine; far below what a held connection shows
LIMIT_S = 10.0
STAFF = ("ops", "ops-password-" + secrets.token_urlsafe(8))
REDIS_DB = 9  # the web tests' in-process fixtures use db 5


@dataclass
class WebPort:
    url: str
    port: int
    redis_url: str
    log: Path


def _env(tmp: Path, redis_url: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        DJANGO_SETTINGS_MODULE="tests.fixtures.process_settings",
        PYTHONPATH=os.pathsep.join([str(REPO_ROOT / "platform"), str(REPO_ROOT)]),
        ONEPIECE_SQLITE_PATH=str(tmp / "db.sqlite3"),
        ONEPIECE_STATE_DIR=str(tmp),
        ONEPIECE_REDIS_URL=redis_url,
        DJANGO_SECRET_KEY=secrets.token_urlsafe(50),
        ONEPIECE_TEST_SETTINGS=json.dumps({"AUTH_FAILURES_LIMIT": FAILURES_LIMIT, "AUTH_FAILURES_WINDOW_S": 600}),
        ONEPIECE_HEADER_TIMEOUT_S=str(DEADLINE_S),
        ONEPIECE_BODY_TIMEOUT_S=str(DEADLINE_S),
        DJANGO_SUPERUSER_PASSWORD=STAFF[1],
    )
    return env


@pytest.fixture(scope="module")
def web_port(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebPort]:
    tmp = tmp_path_factory.mktemp("webport")
    redis_url = redis_server.url.rsplit("/", 1)[0] + f"/{REDIS_DB}"
    env = _env(tmp, redis_url)
    manage = [sys.executable, str(REPO_ROOT / "manage.py")]
    subprocess.run([*manage, "migrate", "--noinput", "-v", "0"], env=env, cwd=REPO_ROOT, check=True)
    subprocess.run([*manage, "createsuperuser", "--noinput", "--username", STAFF[0], "--email", "ops@example.com"],
                   env=env, cwd=REPO_ROOT, check=True, capture_output=True)
    port = free_port()
    log = tmp / "web.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(web_command("127.0.0.1", port), env=env, cwd=REPO_ROOT, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if requests.get(url + "/livez", timeout=5).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the web process did not start: " + log.read_text()
        time.sleep(0.2)
    try:
        yield WebPort(url, port, redis_url, log)
    finally:
        procs.stop(proc, timeout=20)


@pytest.fixture
def fresh_counters(web_port: WebPort) -> Iterator[None]:
    import redis

    r = redis.Redis.from_url(web_port.redis_url)
    r.flushdb()
    yield
    r.flushdb()
    r.close()


def test_rotating_x_forwarded_for_does_not_escape_the_key_guessing_lockout(web_port: WebPort,
                                                                           fresh_counters: None) -> None:
    """Each guess claims another address in X-Forwarded-For; uvicorn's default trusts the header from
    127.0.0.1 (where this client is), which made every guess a first one. No hop is trusted here
    (ONEPIECE_TRUSTED_PROXY_HOPS unset), so the guesser is the socket's address and is locked out."""
    answers = []
    for i in range(FAILURES_LIMIT + 3):
        r = requests.get(web_port.url + "/api/v1/workflows", timeout=10,
                         headers={"Authorization": f"Bearer op_guess{i}_x", "X-Forwarded-For": f"203.0.113.{i}"})
        answers.append(r.status_code)
    assert answers == [401] * FAILURES_LIMIT + [429] * 3, answers
    assert int(r.headers["Retry-After"]) > 0


def _admin_attempt(session: requests.Session, url: str, forwarded: str, username: str = "admin",
                   password: str | None = None) -> int:
    page = session.get(url + "/admin/login/", timeout=10, headers={"X-Forwarded-For": forwarded})
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
    assert token, page.text[:500]
    r = session.post(url + "/admin/login/", timeout=10, allow_redirects=False,
                     headers={"X-Forwarded-For": forwarded, "Referer": url + "/admin/login/"},
                     data={"csrfmiddlewaretoken": token.group(1), "username": username,
                           "password": password or "guess-" + forwarded, "next": "/admin/"})
    return r.status_code


def test_rotating_x_forwarded_for_does_not_escape_the_admin_sign_in_limit(web_port: WebPort,
                                                                          fresh_counters: None) -> None:
    session = requests.Session()
    answers = [_admin_attempt(session, web_port.url, f"198.51.100.{i}") for i in range(FAILURES_LIMIT + 2)]
    assert answers == [200] * FAILURES_LIMIT + [429] * 2, answers  # 200: the form again, the sign-in failed


# -- read deadlines (issue 25): uvicorn has no header-read timeout, and nothing bounded a body ----------------

def test_a_trickled_head_is_408_within_the_deadline(web_port: WebPort) -> None:
    out = trickle(web_port.port, b"GET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\n", b"X-Slow: aaaaaaaa\r\n", 0.1,
                  LIMIT_S)
    assert not out.held and out.after_s < DEADLINE_S + MARGIN_S, out
    assert out.answer.startswith(b"HTTP/1.1 408"), out


def test_a_connection_that_sends_nothing_is_closed(web_port: WebPort) -> None:
    out = trickle(web_port.port, b"", b"", 0.1, LIMIT_S)
    assert not out.held and out.after_s < DEADLINE_S + MARGIN_S and out.answer == b"", out


def test_a_trickled_body_is_408_naming_the_body(web_port: WebPort) -> None:
    head = (b"POST /api/v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 5000\r\n\r\n")
    out = trickle(web_port.port, head + b'{"workflow": "sd-t2i", "params": {"prompt": "', b"a", 0.1, LIMIT_S)
    assert not out.held and out.after_s < DEADLINE_S + MARGIN_S, out
    assert out.answer.startswith(b"HTTP/1.1 408") and b'"field": "body"' in out.answer, out.answer[:400]


UPGRADE = (b"Host: 127.0.0.1\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
           b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n")


@pytest.mark.parametrize(("request_head", "status"), [
    (b"GET /ws/jobs/" + b"a" * 9000 + b" HTTP/1.1\r\n" + UPGRADE + b"\r\n", b"414"),
    (b"GET /ws/cluster HTTP/1.1\r\n" + UPGRADE + b"".join(b"X-H%d: v\r\n" % i for i in range(130)) + b"\r\n",
     b"431"),
], ids=["long-path", "many-headers"])
def test_a_websocket_upgrade_the_parser_cannot_read_is_answered_at_once(web_port: WebPort, request_head: bytes,
                                                                         status: bytes) -> None:
    """Handed to the websockets library, these failed inside uvicorn with no answer (70 s measured)."""
    out = trickle(web_port.port, request_head, b"", 0.1, LIMIT_S)
    assert out.answer.startswith(b"HTTP/1.1 " + status) and out.after_s < MARGIN_S, out


def test_kept_alive_connections_and_websockets_outlive_the_head_deadline(web_port: WebPort,
                                                                         fresh_counters: None) -> None:
    """The head's deadline cuts off unfinished heads only: a kept-alive connection idle for longer (within
    uvicorn's --timeout-keep-alive, 5 s) serves its next request, and the dashboard's websocket keeps
    receiving its snapshots past it."""
    from websockets.sync.client import connect

    get = b"GET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with socket.create_connection(("127.0.0.1", web_port.port), timeout=LIMIT_S) as s:
        s.sendall(get)
        assert read_response(s, time.monotonic() + LIMIT_S).startswith(b"HTTP/1.1 200")
        idle_until = time.monotonic() + DEADLINE_S * 2
        while time.monotonic() < idle_until:  # the connection idles past the deadline (the test's subject)
            time.sleep(0.1)
        s.sendall(get)  # the same connection serves the next request
        assert read_response(s, time.monotonic() + LIMIT_S).startswith(b"HTTP/1.1 200")
    session = requests.Session()
    assert _admin_attempt(session, web_port.url, "", STAFF[0], STAFF[1]) == 302
    cookie = "; ".join(f"{k}={v}" for k, v in session.cookies.items())
    with connect(f"ws://127.0.0.1:{web_port.port}/ws/cluster", open_timeout=10,
                 additional_headers={"Cookie": cookie, "Origin": web_port.url}) as ws:
        opened = time.monotonic()
        while time.monotonic() - opened < DEADLINE_S + 1.5:
            assert json.loads(ws.recv(timeout=5))["type"] == "cluster"  # one a second, past the deadline
