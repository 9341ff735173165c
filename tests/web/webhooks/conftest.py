"""A real webhook receiver (http.server on 127.0.0.1 in a thread) that answers as a test scripts it, and
helpers for endpoints and finished jobs."""

from __future__ import annotations

import ssl
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from engine.embedded import free_port
from tests.web.openai_compat.conftest import oa, workers  # noqa: F401 - fixtures reused here


@dataclass(frozen=True)
class Received:
    headers: dict[str, str]  # lower-case names
    body: bytes
    answered: int | None  # the status sent back; None: the connection was held, then dropped

    @property
    def webhook_id(self) -> str:
        return self.headers["webhook-id"]


class Receiver:
    """POSTs are recorded; each is answered by the next scripted answer (an HTTP status, or ``"hang"``:
    hold the request until :meth:`release`), then ``default`` once the script is used up."""

    def __init__(self, port: int | None = None, default: int = 200) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/hooks/onepiece?src=test"
        self.default = default
        self.script: deque[int | str] = deque()
        self.received: list[Received] = []
        self.arrived = threading.Condition()
        self.released = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    def answer(self, *answers: int | str) -> Receiver:
        self.script.extend(answers)
        return self

    def start(self, tls: ssl.SSLContext | None = None) -> Receiver:
        """Serve (over TLS with ``tls``, a server context)."""
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k.lower(): v for k, v in self.headers.items()}
                with receiver.arrived:
                    answer = receiver.script.popleft() if receiver.script else receiver.default
                if answer == "hang":
                    receiver._record(Received(headers, body, None))
                    receiver.released.wait(30)
                    return  # dropped without an answer
                self.send_response(int(answer))
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")
                receiver._record(Received(headers, body, int(answer)))

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._server.daemon_threads = True
        if tls is not None:
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="webhook-receiver", daemon=True)
        self._thread.start()
        return self

    def _record(self, r: Received) -> None:
        with self.arrived:
            self.received.append(r)
            self.arrived.notify_all()

    def wait_for(self, n: int, timeout: float = 20.0) -> list[Received]:
        deadline = time.monotonic() + timeout
        with self.arrived:
            while len(self.received) < n:
                left = deadline - time.monotonic()
                assert left > 0, f"the receiver got {len(self.received)} requests, expected {n}"
                self.arrived.wait(left)
            return list(self.received)

    def release(self) -> None:
        self.released.set()

    def stop(self) -> None:
        self.release()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5)


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    yield r
    r.stop()


@pytest.fixture
def hooks_settings(settings: Any, web_redis: str) -> Any:
    """Webhooks as on one machine (private receivers allowed), with retries in milliseconds."""
    settings.ONEPIECE = {**settings.ONEPIECE, "WEBHOOK_ALLOW_PRIVATE": True, "WEBHOOK_RETRY_DELAYS_S": (0.05,),
                         "WEBHOOK_RETRY_JITTER": 0.0, "WEBHOOK_TIMEOUT_S": 5.0}
    return settings


def add_endpoint(client: Any, url: str, **fields: Any) -> dict[str, Any]:
    r = client.post("/api/v1/webhooks", {"url": url, **fields}, format="json")
    assert r.status_code == 201, r.content
    return r.json()


def finished_job(user: Any, key_prefix: str | None, state: str = "completed", workflow: str = "sd-t2i",
                 api: str = "native", webhook_url: str = "") -> Any:
    """A ledger row as a submission leaves it, moved to ``state`` by the ledger's own terminal transition."""
    import uuid

    from onepiece_platform.accounts.models import ApiKey
    from onepiece_platform.jobs import ledger
    from onepiece_platform.jobs.models import Job

    key = ApiKey.objects.get(prefix=key_prefix) if key_prefix else None
    job = Job.objects.create(uid=uuid.uuid4().hex, owner=user, workflow=workflow, api=api, api_key=key,
                             webhook_url=webhook_url, params={"prompt": "a cat"})
    assert ledger.finish(job.uid, state, "boom" if state != "completed" else "")
    job.refresh_from_db()
    return job


def key_prefix(raw_key: str) -> str:
    return raw_key.split("_")[1]
