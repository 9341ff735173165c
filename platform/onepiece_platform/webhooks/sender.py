"""One HTTP attempt of one delivery: vet the URL, connect to a vetted address, POST, read the status.

The standard library's ``http.client`` with its connection pinned to the address :func:`ssrf.vet`
approved: the Host header and the TLS server name (certificate check included) are the URL's host,
but no second DNS lookup can send the request elsewhere. No redirect is followed (a 3xx is a failed
attempt: a redirect could point anywhere). ``WEBHOOK_TIMEOUT_S`` bounds the whole attempt, connect
included: each socket operation waits at most what is left, and a watchdog closes the socket at the
deadline, so a receiver that drips its answer byte by byte cannot hold a sender longer.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any

from onepiece_platform.webhooks import ssrf

USER_AGENT = "OnePiece-Webhooks/1"
READ_LIMIT = 1024  # of the receiver's answer, kept for the attempt's error
BLOCK = 256 << 10  # bytes per send of a streamed body (an output uploaded to a client's bucket)


@dataclass(frozen=True)
class Outcome:
    status: int | None  # the receiver's HTTP status; None if none came
    latency_ms: int
    error: str = ""  # why the attempt failed ("" on 2xx)
    address: str = ""  # the address it connected to

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


def tls_context() -> ssl.SSLContext:
    """The system's trusted CAs, certificate and host name checked (tests trust their own CA here)."""
    return ssl.create_default_context()


def _connection(target: ssrf.Target, address: str, timeout: float) -> http.client.HTTPConnection:
    conn: http.client.HTTPConnection
    if target.scheme == "https":
        conn = http.client.HTTPSConnection(target.host, target.port, timeout=timeout, context=tls_context(),
                                           blocksize=BLOCK)
    else:
        conn = http.client.HTTPConnection(target.host, target.port, timeout=timeout, blocksize=BLOCK)

    def pinned(addr: tuple[str, int], timeout: Any = None, source_address: Any = None) -> socket.socket:
        return socket.create_connection((address, target.port), timeout, source_address)

    # http.client resolves self.host through this hook; the TLS wrap and Host header still use the name
    conn._create_connection = pinned  # type: ignore[attr-defined]
    return conn


def _abort(conn: http.client.HTTPConnection) -> None:
    sock = conn.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def post(url: str, body: bytes, headers: dict[str, str], timeout_s: float) -> Outcome:
    """POST ``body`` to ``url`` once; never raises (every failure is an :class:`Outcome` with its error)."""
    return send("POST", url, body, {"Content-Type": "application/json", **headers}, timeout_s)


def send(method: str, url: str, body: Any, headers: dict[str, str], timeout_s: float) -> Outcome:
    """``method`` ``body`` (bytes, or a readable object with ``Content-Length`` in ``headers``) to ``url`` once,
    under the egress policy (:func:`ssrf.vet` before the attempt, the vetted address only, no redirect
    followed, ``timeout_s`` for the whole attempt); never raises (a failure is an :class:`Outcome`)."""
    start = time.monotonic()
    deadline = start + timeout_s

    def done(status: int | None, error: str = "", address: str = "") -> Outcome:
        return Outcome(status, int((time.monotonic() - start) * 1000), error[:500], address)

    try:
        target = ssrf.vet(url)
    except ssrf.UnsafeUrl as exc:
        return done(None, f"refused: {exc}")
    conn: http.client.HTTPConnection | None = None
    address, error = "", "no address"
    for address in target.addresses:
        left = deadline - time.monotonic()
        if left <= 0:
            return done(None, f"timed out after {timeout_s:g}s (connecting)", address)
        conn = _connection(target, address, left)
        try:
            conn.connect()
            break
        except (OSError, ssl.SSLError) as exc:
            error = f"connect to {address}: {exc.__class__.__name__}: {exc}"
            conn.close()
            conn = None
    if conn is None:
        return done(None, error, address)
    watchdog = threading.Timer(max(0.0, deadline - time.monotonic()), _abort, args=(conn,))
    watchdog.daemon = True
    watchdog.start()
    try:
        conn.sock.settimeout(max(0.001, deadline - time.monotonic()))
        conn.request(method, target.path, body=body, headers={
            "User-Agent": USER_AGENT, "Connection": "close", **headers})
        resp = conn.getresponse()
        answer = resp.read(READ_LIMIT)
        if 200 <= resp.status < 300:
            return done(resp.status, "", address)
        if 300 <= resp.status < 400:
            return done(resp.status, f"redirect to {resp.getheader('Location', '?')} not followed", address)
        text = answer.decode("utf-8", "replace").strip()
        return done(resp.status, f"HTTP {resp.status}" + (f": {text}" if text else ""), address)
    except (OSError, ssl.SSLError, http.client.HTTPException) as exc:
        if time.monotonic() >= deadline - 0.001 or isinstance(exc, TimeoutError):
            return done(None, f"timed out after {timeout_s:g}s", address)
        return done(None, f"{exc.__class__.__name__}: {exc}", address)
    finally:
        watchdog.cancel()
        conn.close()
