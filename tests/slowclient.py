"""A slow HTTP client on a raw socket: trickles bytes and reports what the server did and when.

Shared by the web port's and the Proxy's read-deadline tests. Every wait is bounded by ``limit_s``; the
gaps between bytes are the client's pace (what is being tested), not a stand-in for an event.
"""

from __future__ import annotations

import select
import socket
import time
from dataclasses import dataclass


@dataclass
class Outcome:
    answer: bytes  # what the server sent (b"": it closed without a word; also b"" when it was held)
    after_s: float  # seconds from the first byte sent (or the connect) to the answer or the close
    held: bool  # still open at limit_s


def trickle(port: int, first: bytes, drip: bytes, gap_s: float, limit_s: float) -> Outcome:
    """Send ``first`` at once, then ``drip`` one byte per ``gap_s`` (repeated) until the server answers or
    closes, or ``limit_s`` passes."""
    with socket.create_connection(("127.0.0.1", port), timeout=limit_s) as s:
        started = time.monotonic()
        if first:
            s.sendall(first)
        i = 0
        while time.monotonic() - started < limit_s:
            readable, _, _ = select.select([s], [], [], gap_s)
            if readable:
                return Outcome(read_response(s, started + limit_s), time.monotonic() - started, False)
            if drip:
                try:
                    s.sendall(drip[i % len(drip):i % len(drip) + 1])
                except OSError:  # closed while we wrote: what it said, if anything, is still readable
                    return Outcome(read_response(s, started + limit_s), time.monotonic() - started, False)
                i += 1
        return Outcome(b"", time.monotonic() - started, True)


def read_response(s: socket.socket, deadline: float) -> bytes:
    """One response (its head, then Content-Length bytes of body), or whatever came before the close."""
    out = b""
    while time.monotonic() < deadline:
        head, sep, body = out.partition(b"\r\n\r\n")
        if sep and len(body) >= _content_length(head):
            break
        try:
            chunk = s.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not chunk:
            break
        out += chunk
    return out


def _content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0
