"""The web port as ``onepiece up`` serves it: a real uvicorn process started with the launcher's own
command line (``engine.launcher.web_command``), against the real Redis, on SQLite.

What only the server process can get wrong: which address a request comes from (uvicorn rewrites the
client address from X-Forwarded-For when told to trust it), and how long a connection that never
finishes its request may hold the server.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from engine.embedded import free_port
from engine.launcher import web_command
from tests.fixtures import REPO_ROOT

pytestmark = pytest.mark.integration

FAILURES_LIMIT = 3
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
    )
    return env


@pytest.fixture(scope="module")
def web_port(redis_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WebPort]:
    tmp = tmp_path_factory.mktemp("webport")
    redis_url = redis_server.url.rsplit("/", 1)[0] + f"/{REDIS_DB}"
    env = _env(tmp, redis_url)
    subprocess.run([sys.executable, str(REPO_ROOT / "manage.py"), "migrate", "--noinput", "-v", "0"], env=env,
                   cwd=REPO_ROOT, check=True)
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
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


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


def _admin_attempt(session: requests.Session, url: str, forwarded: str) -> int:
    page = session.get(url + "/admin/login/", timeout=10, headers={"X-Forwarded-For": forwarded})
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
    assert token, page.text[:500]
    r = session.post(url + "/admin/login/", timeout=10, allow_redirects=False,
                     headers={"X-Forwarded-For": forwarded, "Referer": url + "/admin/login/"},
                     data={"csrfmiddlewaretoken": token.group(1), "username": "admin", "password": "guess-" + forwarded,
                           "next": "/admin/"})
    return r.status_code


def test_rotating_x_forwarded_for_does_not_escape_the_admin_sign_in_limit(web_port: WebPort,
                                                                          fresh_counters: None) -> None:
    session = requests.Session()
    answers = [_admin_attempt(session, web_port.url, f"198.51.100.{i}") for i in range(FAILURES_LIMIT + 2)]
    assert answers == [200] * FAILURES_LIMIT + [429] * 2, answers  # 200: the form again, the sign-in failed
