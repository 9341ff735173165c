"""A real webhook receiver: http.server on 127.0.0.1 in a thread, answering as a test scripts it."""

from __future__ import annotations

import ssl
import threading
import time
from collections import deque
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from engine.embedded import free_port


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
