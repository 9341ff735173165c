"""Leader election through etcd, with fencing tokens.

One key (``<root>/manager/leader``, :meth:`engine.coord.keys.Keyspace.leader`) is created in a transaction
that succeeds only if the key does not exist, bound to the candidate's lease.
The key's ``create_revision`` is the leader's **fencing token**: it grows with
every new leadership, and every write the leader makes goes through
:meth:`Election.fenced_put`, a transaction that checks, inside etcd, that the
leader key still has this create_revision. A leader that stalled past its lease
(SIGSTOP, a long GC pause, a partition) therefore cannot write after waking up,
even before it notices it was deposed; the refused write is how it notices,
and it steps down. Readers (TaskManagers) additionally ignore values carrying
a token older than the newest they have seen (``fence_token`` in the assignment:
:class:`engine.worker.taskmanager.TaskManager`).

No home-made consensus: etcd (Raft) decides; we only use its create-if-absent
transaction, leases and revisions.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


class NotLeader(Exception):
    """A fenced write was refused: this process is no longer (or never was) the leader."""


def _b64(s: str | bytes) -> str:
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


@dataclass(frozen=True)
class Leadership:
    candidate: str
    token: int  # create_revision of the leader key
    since: float


def connect(url: str) -> Any:
    """An etcd client for ``http://host:port`` or comma-separated endpoints (the TaskManagers' client)."""
    from engine.coord import etcd_client

    return etcd_client(url)


class Election:
    """Campaign for, hold and give up the leadership of ``key``.

    Thread-safe. ``on_elected(leadership)`` and ``on_deposed(leadership)`` are
    called from the election's own thread; keep them short.
    """

    def __init__(
        self,
        client: Any,
        candidate: str,
        *,
        ttl: int = 3,
        key: str | None = None,
        on_elected: Any = None,
        on_deposed: Any = None,
    ) -> None:
        if ttl < 2:
            raise ValueError("ttl must be at least 2 seconds (etcd's lease granularity is 1 s)")
        if key is None:
            from engine.coord.keys import Keyspace

            key = Keyspace.from_env().leader()
        self.client, self.candidate, self.ttl, self.key = client, candidate, ttl, key
        self.on_elected, self.on_deposed = on_elected, on_deposed
        self._lease: Any = None
        self._leadership: Leadership | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # state -----------------------------------------------------------------------------------
    @property
    def leadership(self) -> Leadership | None:
        with self._lock:
            return self._leadership

    @property
    def is_leader(self) -> bool:
        return self.leadership is not None

    def current_leader(self) -> tuple[str, int] | None:
        """(candidate, token) of whoever leads now, as etcd says; None when nobody does."""
        got = self.client.get(self.key, metadata=True)
        if not got:
            return None
        value, meta = got[0]
        return json.loads(value)["candidate"], int(meta["create_revision"])

    # campaign --------------------------------------------------------------------------------
    def try_acquire(self) -> Leadership | None:
        """One attempt: become leader if nobody is. Returns the leadership or None."""
        lease = self.client.lease(ttl=self.ttl)
        value = json.dumps({"candidate": self.candidate, "at": time.time()})
        if not self.client.create(self.key, value, lease=lease):
            lease.revoke()
            return None
        got = self.client.get(self.key, metadata=True)
        if not got or json.loads(got[0][0])["candidate"] != self.candidate:
            lease.revoke()  # lost it again at once (lease expired in between): try later
            return None
        ship = Leadership(self.candidate, int(got[0][1]["create_revision"]), time.time())
        with self._lock:
            self._lease, self._leadership = lease, ship
        log.info("%s elected leader with fencing token %d", self.candidate, ship.token)
        return ship

    def start(self) -> Election:
        """Run the campaign / keep-alive loop in a daemon thread until :meth:`stop`."""
        self._thread = threading.Thread(target=self._run, name=f"onepiece-election-{self.candidate}", daemon=True)
        self._thread.start()
        return self

    def stop(self, resign: bool = True) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if resign:
            self.resign()

    def resign(self) -> None:
        """Give up leadership now (revoking the lease deletes the key; a standby takes over)."""
        with self._lock:
            lease, ship = self._lease, self._leadership
            self._lease = self._leadership = None
        if lease is not None:
            try:
                lease.revoke()
            except Exception:
                pass
        if ship is not None and self.on_deposed:
            self.on_deposed(ship)

    def _run(self) -> None:
        # The loop never dies: each tick is caught and logged (a control loop that can die
        # is the failure mode that takes a cluster's manager down).
        while not self._stop.is_set():
            try:
                if self.leadership is None:
                    ship = self.try_acquire()
                    if ship is not None and self.on_elected:
                        self.on_elected(ship)
                    wait = self.ttl / 3 if ship else min(0.25, self.ttl / 6)
                else:
                    self._keep_alive()
                    wait = self.ttl / 3
            except Exception:
                log.exception("election tick failed; retrying")
                wait = 0.5
            self._stop.wait(wait)

    def _keep_alive(self) -> None:
        with self._lock:
            lease, ship = self._lease, self._leadership
        if lease is None or ship is None:
            return
        try:
            ttl = lease.refresh()
        except Exception:
            ttl = -1
        still = self.current_leader() if ttl > 0 else None
        if ttl <= 0 or still != (self.candidate, ship.token):
            log.warning("%s lost leadership (token %d)", self.candidate, ship.token)
            self._depose(ship)

    def _depose(self, ship: Leadership) -> None:
        with self._lock:
            if self._leadership != ship:
                return
            self._leadership = self._lease = None
        if self.on_deposed:
            self.on_deposed(ship)

    # fenced writes ---------------------------------------------------------------------------
    def fenced_txn(self, puts: dict[str, str | bytes], deletes: tuple[str, ...] = ()) -> int:
        """Several writes (and deletes) applied atomically, only if we still lead; returns the token."""
        ship = self.leadership
        if ship is None:
            raise NotLeader(f"{self.candidate} is not the leader")
        ops: list[dict[str, Any]] = [{"request_put": {"key": _b64(k), "value": _b64(v)}} for k, v in puts.items()]
        ops += [{"request_delete_range": {"key": _b64(k)}} for k in deletes]
        txn = {
            "compare": [
                {"key": _b64(self.key), "result": "EQUAL", "target": "CREATE", "create_revision": ship.token}
            ],
            "success": ops,
            "failure": [],
        }
        if not self.client.transaction(txn).get("succeeded"):
            self._depose(ship)
            raise NotLeader(f"{self.candidate}: transaction refused, fencing token {ship.token} is stale")
        return ship.token

    def fenced_put(self, key: str, value: str | bytes) -> int:
        """Write ``key`` only if we still lead with our token; returns the token used.

        Raises :class:`NotLeader` (and steps down) when etcd refuses the write.
        """
        ship = self.leadership
        if ship is None:
            raise NotLeader(f"{self.candidate} is not the leader")
        txn = {
            "compare": [
                {"key": _b64(self.key), "result": "EQUAL", "target": "CREATE", "create_revision": ship.token}
            ],
            "success": [{"request_put": {"key": _b64(key), "value": _b64(value)}}],
            "failure": [],
        }
        result = self.client.transaction(txn)
        if not result.get("succeeded"):
            self._depose(ship)
            raise NotLeader(f"{self.candidate}: write to {key!r} refused, fencing token {ship.token} is stale")
        return ship.token
