"""A watch on an etcd prefix whose end shows: the gRPC gateway's streaming ``POST /v3/watch``, read here.

etcd3gw 2.7 offers ``watch_prefix`` (an iterator and a cancel) and ``watch_prefix_once``, but its reader
thread drops the stream's end and its errors: once etcd restarts, its iterator blocks for ever, and a
caller cannot tell a quiet prefix from a dead watch. :class:`PrefixWatch` reads the stream itself, so
:meth:`PrefixWatch.changes` ends with :class:`WatchEnded` when the stream does (etcd gone, the watch
cancelled, the member compacted past it), and the caller can fall back to reading.

On etcd 3.4 (Debian's 3.4.23, API path ``/v3/``) the stream's first line says the watch was created
(``{"result": {..., "created": true}}``), then each line is one revision's events (keys and values
base64); a key whose lease ends arrives as a DELETE within milliseconds.
"""

from __future__ import annotations

import base64
import json
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from engine.coord.client import CONNECT_TIMEOUT_S


@dataclass(frozen=True)
class Change:
    """One key's change: its new value (text), or None when it was deleted (or its lease ended)."""

    key: str
    value: str | None


class WatchEnded(Exception):
    """The watch's stream ended or failed; ``quiet`` when it merely saw nothing for its read timeout."""

    def __init__(self, why: str, quiet: bool = False) -> None:
        super().__init__(why)
        self.quiet = quiet


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def _prefix_end(prefix: str) -> str:
    """The key just past every key that starts with ``prefix`` (etcd's range_end of a prefix)."""
    raw = bytearray(prefix.encode())
    while raw and raw[-1] == 0xFF:
        raw.pop()
    raw[-1] += 1
    return raw.decode(errors="surrogateescape")


def _change(event: dict[str, Any]) -> Change:
    kv = event.get("kv") or {}
    key = base64.b64decode(kv.get("key", "")).decode(errors="replace")
    if event.get("type") == "DELETE":  # a PUT's type is the enum's zero, which the gateway leaves out
        return Change(key, None)
    return Change(key, base64.b64decode(kv.get("value", "")).decode(errors="replace"))


class PrefixWatch:
    """Watch every key under ``prefix`` from now on. ``quiet_s``: a stream that says nothing for that long
    ends (quietly), so a member that vanished without closing the connection is noticed too."""

    def __init__(self, client: Any, prefix: str, quiet_s: float = 90.0) -> None:
        import requests

        member = client.member() if hasattr(client, "member") else client  # a FailoverClient: one that answers
        create = {"create_request": {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))}}
        self.prefix = prefix
        try:
            self._resp = member.session.post(member.get_url("/watch"), json=create, stream=True,
                                             timeout=(CONNECT_TIMEOUT_S, quiet_s))
        except requests.exceptions.RequestException as exc:
            raise WatchEnded(f"cannot open a watch on {prefix}: {exc}") from exc
        if self._resp.status_code != 200:
            raise WatchEnded(f"etcd refused a watch on {prefix}: {self._resp.status_code} {self._resp.text[:200]}")
        self._lines = self._resp.iter_lines()
        first = self._next()  # the creation: only then is every later change of the prefix on this stream
        if not first.get("created"):
            self.close()
            raise WatchEnded(f"the watch on {prefix} was not created: {first}")

    def _next(self) -> dict[str, Any]:
        import requests

        try:
            while not (line := next(self._lines)).strip():
                continue  # the gateway may send empty lines
        except StopIteration:
            raise WatchEnded(f"the watch on {self.prefix} ended") from None
        except requests.exceptions.ConnectionError as exc:  # requests reports a read timeout as this
            quiet = "timed out" in str(exc).lower()
            raise WatchEnded(f"the watch on {self.prefix}: {exc}", quiet=quiet) from exc
        except (requests.exceptions.RequestException, OSError, ValueError) as exc:
            raise WatchEnded(f"the watch on {self.prefix}: {exc}") from exc
        doc = json.loads(line)
        if "error" in doc or not isinstance(doc.get("result"), dict):
            raise WatchEnded(f"the watch on {self.prefix} failed: {str(doc)[:300]}")
        result: dict[str, Any] = doc["result"]
        if result.get("canceled"):
            raise WatchEnded(f"etcd cancelled the watch on {self.prefix}: {result.get('cancel_reason', '')}")
        return result

    def changes(self) -> Iterator[list[Change]]:
        """The keys each revision changed, in order; ends by raising :class:`WatchEnded`."""
        while True:
            events = self._next().get("events") or []
            if events:
                yield [_change(e) for e in events]

    def close(self) -> None:
        """End the watch; a thread blocked in :meth:`changes` gets :class:`WatchEnded`."""
        try:  # closing the response alone does not wake a reader blocked in recv: shut the socket down
            sock = socket.fromfd(self._resp.raw._fp.fileno(), socket.AF_INET, socket.SOCK_STREAM)
            sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        except (AttributeError, OSError, ValueError):
            pass  # already closed, or never opened
        self._resp.close()


class ChangeFlag:
    """A background watch on one prefix (or key) that raises a flag when anything under it changes, for a
    loop that re-reads only then instead of every tick (the TaskManager's assignment: it read etcd five
    times a second). :meth:`take` says whether to read now: after a change, when the watch is down (every
    call: as if there were no watch), and every ``full_read_s`` as a safety net."""

    def __init__(self, client: Any, prefix: str, full_read_s: float = 10.0, name: str = "onepiece-watch") -> None:
        import threading
        import time

        self.client, self.prefix, self.full_read_s = client, prefix, full_read_s
        self._clock = time.monotonic
        self._flag = threading.Event()
        self._flag.set()  # the first take() reads
        self._stop = threading.Event()
        self._last_read = -1e18
        self.watching = False
        self._watch: PrefixWatch | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import logging

        log = logging.getLogger(__name__)
        while not self._stop.is_set():
            try:
                self._watch = PrefixWatch(self.client, self.prefix)
                self.watching = True
                self._flag.set()  # a change made while no watch was open is read now
                for _ in self._watch.changes():
                    self._flag.set()
            except WatchEnded as exc:
                if not exc.quiet and not self._stop.is_set():
                    log.warning("watch on %s ended (%s); reading every tick until it is open again", self.prefix, exc)
            except Exception as exc:  # never let the thread die: the caller reads every tick meanwhile
                log.warning("watch on %s failed (%s); reading every tick until it is open again", self.prefix, exc)
            finally:
                self.watching = False
                if self._watch is not None:
                    self._watch.close()
            self._stop.wait(1.0)

    def take(self) -> bool:
        """True when the caller should read the prefix now (and the flag is lowered)."""
        now = self._clock()
        due = not self.watching or self._flag.is_set() or now - self._last_read >= self.full_read_s
        if due:
            self._flag.clear()
            self._last_read = now
        return due

    def stop(self) -> None:
        self._stop.set()
        w = self._watch
        if w is not None:
            w.close()
        self._thread.join(timeout=5)
