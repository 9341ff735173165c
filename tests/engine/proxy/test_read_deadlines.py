"""The Proxy's read deadlines (issue 25): ``onepiece proxy`` as deployed, a real process on the real Redis
and etcd, against clients that trickle their request's head or body or send nothing at all. Each is cut
off within its deadline (1 s here) plus a margin, where before it was held (aiohttp's keep-alive timer
alone, 3630 s)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from engine.embedded import free_port
from tests.fixtures import REPO_ROOT
from tests.slowclient import trickle

pytestmark = pytest.mark.integration

DEADLINE_S = 1.0
MARGIN_S = 2.0  # the loop's timer and a loaded 2-core machine; far below what a held connection shows
LIMIT_S = 10.0
ROOT = "/onepiece-deadlines"


@pytest.fixture(scope="module")
def proxy_port(redis_server: Any, etcd_server: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    from engine.coord import etcd_client
    from engine.coord.keys import Keyspace
    from engine.coord.routes import Route, publish_route

    # an instance of sd-t2i's first stage (its ring is never reached: no trickled body is ever complete),
    # so admission lets the request on to its body
    etcd = etcd_client(etcd_server.url)
    keys = Keyspace(ROOT)
    publish_route(etcd, Route("sd-t2i", "text_encode", "sd-t2i.text_encode.0", "shm://nowhere"), keys=keys)
    port = free_port()
    env = {**os.environ, "ONEPIECE_HEADER_TIMEOUT_S": str(DEADLINE_S), "ONEPIECE_BODY_TIMEOUT_S": str(DEADLINE_S),
           "ONEPIECE_ETCD_ROOT": ROOT}
    log = tmp_path_factory.mktemp("proxy") / "proxy.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "engine.cli", "proxy", "--host", "127.0.0.1", "--port",
                                 str(port), "--redis-url", redis_server.url, "--etcd-url", etcd_server.url],
                                env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while "proxy: http://" not in log.read_text():  # its start-up line: it is serving
            assert time.monotonic() < deadline, log.read_text()
            try:
                proc.wait(0.2)  # a bounded look at whether it died instead
            except subprocess.TimeoutExpired:
                continue
            raise AssertionError(f"onepiece proxy exited: {log.read_text()}")
        assert requests.get(f"http://127.0.0.1:{port}/livez", timeout=5).status_code == 200
        yield port
    finally:
        proc.terminate()
        proc.wait(20)
        etcd.delete_prefix(ROOT + "/")


def _auth() -> bytes:
    return f"Authorization: Bearer {os.environ['ONEPIECE_PROXY_TOKEN']}\r\n".encode()


def test_a_trickled_head_is_cut_off(proxy_port: int) -> None:
    out = trickle(proxy_port, b"GET /livez HTTP/1.1\r\nHost: proxy\r\n", b"X-Slow: aaaaaaaa\r\n", 0.1, LIMIT_S)
    assert not out.held and out.after_s < DEADLINE_S + MARGIN_S, out
    assert out.answer == b"" or out.answer.startswith(b"HTTP/1.1 4"), out


def test_a_connection_that_sends_nothing_is_closed(proxy_port: int) -> None:
    out = trickle(proxy_port, b"", b"", 0.1, LIMIT_S)
    assert not out.held and out.after_s < DEADLINE_S + MARGIN_S and out.answer == b"", out


def test_a_trickled_body_is_408(proxy_port: int) -> None:
    head = (b"POST /v1/requests HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n" + _auth()
            + b"Content-Length: 5000\r\n\r\n")
    out = trickle(proxy_port, head + b'{"workflow": "sd-t2i", "params": {"prompt": "', b"a", 0.1, LIMIT_S)
    assert not out.held and out.after_s < DEADLINE_S + MARGIN_S, out
    assert out.answer.startswith(b"HTTP/1.1 408"), out.answer[:300]
    assert b'"field": "body"' in out.answer


def test_a_prompt_request_is_untouched(proxy_port: int) -> None:
    """The deadlines cut off slow clients only: an ordinary call gets its answer (401 without the secret,
    then a status read with it)."""
    url = f"http://127.0.0.1:{proxy_port}"
    assert requests.get(url + "/v1/requests/nope", timeout=5).status_code == 401
    r = requests.get(url + "/v1/requests/nope", timeout=5,
                     headers={"Authorization": f"Bearer {os.environ['ONEPIECE_PROXY_TOKEN']}"})
    assert r.status_code == 404, r.text
