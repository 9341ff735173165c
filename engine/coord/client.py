"""An etcd client over several endpoints that fails over when one is unreachable.

``ONEPIECE_ETCD_URL`` / ``--etcd-url`` may name one endpoint or a
comma-separated list of a cluster's members::

    http://10.0.0.2:2379,http://10.0.0.3:2379,http://10.0.0.4:2379

:class:`FailoverClient` keeps one ``etcd3gw`` client per endpoint and sends
each call to the endpoint that answered last. When that endpoint cannot be
reached (connection refused or reset, a connect or read timeout, or the
member answering 503/504 because it has lost its quorum: etcd3gw's
``ConnectionFailedError`` / ``ConnectionTimeoutError``), the same call is
tried on the next endpoint, and that one becomes the preferred one. Any other
error (a lease that does not exist, a malformed request) is etcd's answer,
raised at once. Only when every endpoint fails does the call raise, with the
last endpoint's error.

Retrying is safe for what the engine sends: puts and deletes are idempotent;
a ``create`` or fenced transaction that was applied before its answer was
lost is refused on the retry (the key exists / the comparison still holds and
re-applies the same writes); a lease granted twice leaves an unused lease that
expires on its own.

Leases: etcd3gw's ``Lease`` is bound to the client that granted it, so a lease
granted through a member that then dies could not be refreshed. Leases belong
to the cluster, not to a member; :class:`FailoverLease` keeps only the lease
id and refreshes, revokes and reads it through whichever endpoint is up.

Watches (``watch``, ``watch_prefix``, ``watch_once``, ``watch_prefix_once``)
are opened on the preferred endpoint after checking that it answers; a
watch's stream stays on that endpoint. The engine does not use watches (route
tables and assignments are polled), so nothing depends on re-opening them.

``etcd3gw`` (which imports ``requests``) is imported when a client is made,
never by ``import engine``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any
from urllib.parse import urlparse

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 1.0  # a dead host's SYNs go unanswered: give up on it quickly and try the next


def parse_endpoints(urls: str) -> list[str]:
    """``"http://a:2379, http://b:2379"`` -> the endpoint URLs, in order, without blanks or repeats."""
    out: list[str] = []
    for part in urls.split(","):
        u = part.strip().rstrip("/")
        if u and u not in out:
            out.append(u)
    if not out:
        raise ValueError(f"no etcd endpoint in {urls!r}")
    return out


class FailoverLease:
    """A lease known by its id, refreshed through whichever endpoint answers."""

    def __init__(self, lease_id: int, client: FailoverClient) -> None:
        self.id = lease_id
        self.client = client

    def _call(self, method: str) -> Any:
        from etcd3gw.lease import Lease

        return self.client._call(lambda c: getattr(Lease(self.id, c), method)())

    def refresh(self) -> int:
        """Keep the lease alive; returns its new TTL, or -1 when it has already expired."""
        return int(self._call("refresh"))

    def revoke(self) -> bool:
        return bool(self._call("revoke"))

    def ttl(self) -> int:
        return int(self._call("ttl"))

    def keys(self) -> list[bytes]:
        return list(self._call("keys"))

    def __repr__(self) -> str:
        return f"FailoverLease(id={self.id})"


class FailoverClient:
    """The ``etcd3gw`` client's methods over a list of endpoints (see the module's docstring)."""

    _WATCHES = frozenset({"watch", "watch_prefix", "watch_once", "watch_prefix_once"})

    def __init__(self, urls: str | list[str], timeout: float | None = 5.0) -> None:
        import etcd3gw
        from etcd3gw import exceptions

        self.endpoints = parse_endpoints(urls) if isinstance(urls, str) else list(urls)
        self.timeout = timeout
        # requests takes (connect, read): a dead member costs at most the connect timeout.
        t: Any = None if timeout is None else (min(CONNECT_TIMEOUT_S, timeout), timeout)
        self.clients = []
        for url in self.endpoints:
            u = urlparse(url)
            self.clients.append(etcd3gw.client(host=u.hostname or "127.0.0.1", port=u.port or 2379,
                                               protocol=u.scheme or "http", timeout=t))
        self._unreachable = (exceptions.ConnectionFailedError, exceptions.ConnectionTimeoutError)
        self._preferred = 0
        self._lock = threading.Lock()
        self.failovers = 0  # how many times the preferred endpoint changed (tests, logs)

    @property
    def url(self) -> str:
        """The endpoint calls go to now."""
        return self.endpoints[self._preferred]

    def _call(self, fn: Callable[[Any], Any]) -> Any:
        start = self._preferred
        n = len(self.clients)
        error: Exception | None = None
        for k in range(n):
            i = (start + k) % n
            try:
                result = fn(self.clients[i])
            except self._unreachable as e:
                error = e
                log.debug("etcd endpoint %s unreachable: %s", self.endpoints[i], e)
                continue
            if i != start:
                with self._lock:
                    if self._preferred == start:
                        self._preferred = i
                        self.failovers += 1
                log.warning("etcd endpoint %s unreachable; using %s", self.endpoints[start], self.endpoints[i])
            return result
        assert error is not None
        raise error

    # leases ------------------------------------------------------------------------------------
    def lease(self, ttl: int = 30) -> FailoverLease:
        """Grant a lease of ``ttl`` seconds (through whichever endpoint answers)."""
        granted = self._call(lambda c: c.lease(ttl))
        return FailoverLease(int(granted.id), self)

    # everything else: get, get_prefix, get_all, put, create, replace, delete, delete_prefix,
    # transaction, status, members, lock, watch* ---------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name in ("clients", "endpoints"):
            raise AttributeError(name)
        import etcd3gw

        if not callable(getattr(etcd3gw.Etcd3Client, name, None)):
            raise AttributeError(name)
        if name in self._WATCHES:
            def watch(*args: Any, **kwargs: Any) -> Any:
                client = self._call(lambda c: (c.status(), c)[1])  # a member that answers now
                return getattr(client, name)(*args, **kwargs)
            return watch

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._call(lambda c: getattr(c, name)(*args, **kwargs))

        call.__name__ = name
        return call

    def __repr__(self) -> str:
        return f"FailoverClient({','.join(self.endpoints)!r}, preferred={self.url!r})"


def client(urls: str, timeout: float | None = 5.0) -> FailoverClient:
    """A client for one etcd URL or a comma-separated list of a cluster's client URLs."""
    return FailoverClient(urls, timeout)
