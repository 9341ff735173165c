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
watch's stream stays on that endpoint. The engine's route tables watch through
:class:`engine.coord.watch.PrefixWatch` (on :meth:`FailoverClient.member`),
whose end shows, and open their watches again (on whichever member answers)
when one ends.

Credentials: an endpoint URL may carry a user and password, as Redis URLs do
(``http://onepiece:s3cret@10.0.0.2:2379``; percent-encode reserved characters).
The client then authenticates once per endpoint (etcd's ``/v3/auth/authenticate``)
and sends the token with every call, authenticating again when etcd answers that
the token is no longer valid (simple tokens expire after ``--auth-token-ttl``,
and every token dies when the cluster's users change), and sending again a call
refused because the users or roles changed under it ("revision of auth store is
old": nothing was applied), as etcd's own client does. The password never
appears in :attr:`FailoverClient.endpoints`, ``repr`` or logs. A refused password
is :class:`EtcdAuthError`, raised at once (it is not failed over: every member
would refuse it). ``https://`` endpoints verify the server against
``ONEPIECE_ETCD_CA`` (else the system's CAs) and present the client certificate
``ONEPIECE_ETCD_CERT`` / ``ONEPIECE_ETCD_KEY`` when set (etcd's
``--client-cert-auth``).

``etcd3gw`` (which imports ``requests``) is imported when a client is made,
never by ``import engine``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlparse

from engine import envs

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 1.0  # a dead host's SYNs go unanswered: give up on it quickly and try the next
_AUTH_RETRIES = 5  # a call refused for a stale token or auth revision is sent again at most this often
_OLD_AUTH_REVISION = b"revision of auth store is old"  # etcd's ErrAuthOldRevision (gRPC InvalidArgument)
_AUTH_OFF = b"authentication is not enabled"  # ErrAuthNotEnabled: authenticate while auth is off
_NO_USER = b"user name is empty"  # ErrUserEmpty: a call without a token while auth is on


class EtcdAuthError(RuntimeError):
    """etcd refused the credentials in the URL (unknown user or wrong password)."""


@dataclass(frozen=True)
class Endpoint:
    """One member's client URL, split into what is safe to show and the credentials."""

    url: str  # scheme://host:port, never with a password
    username: str = ""
    password: str = field(default="", repr=False)

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        u = urlparse(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"etcd endpoint must be http(s)://[user:password@]host[:port], got {redact(url)!r}")
        host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
        port = u.port or 2379
        return cls(f"{u.scheme}://{host}:{port}", unquote(u.username or ""), unquote(u.password or ""))


def redact(urls: str) -> str:
    """``urls`` with every password replaced by ``***`` (for messages and logs)."""
    out = []
    for part in urls.split(","):
        u = urlparse(part.strip())
        if u.password is not None:
            part = part.replace(f":{u.password}@", ":***@", 1)
        out.append(part)
    return ",".join(out)


def _token_of(r: Any, endpoint: Endpoint) -> str:
    """The token in etcd's answer ``r`` to ``/v3/auth/authenticate``; "" when etcd has authentication off."""
    from etcd3gw import exceptions

    if r.status_code in (503, 504):
        raise exceptions.ConnectionFailedError(r.text, r.reason)
    if r.status_code != 200 and _AUTH_OFF in r.content:
        return ""
    if r.status_code != 200 or "token" not in r.json():
        raise EtcdAuthError(f"etcd at {endpoint.url} refused user {endpoint.username!r}: {r.text.strip()[:200]}")
    return str(r.json()["token"])


def _session(endpoint: Endpoint, timeout: Any) -> Any:
    """A ``requests`` session for one endpoint: TLS settings, and etcd's auth token when it has a user."""
    import requests
    from etcd3gw import exceptions

    class TokenSession(requests.Session):
        """Sends ``Authorization: <token>``; authenticates again when etcd drops the token (401) or turns
        authentication on after this client found it off; sends again a call refused for a stale auth
        revision. Before authentication is enabled (a deployment whose ``onepiece etcd-auth`` has not run
        yet) it sends no token, as etcd's own client does, instead of failing."""

        def __init__(self) -> None:
            super().__init__()
            self._token: str | None = None  # None: not asked yet; "": etcd has authentication off
            self._lock = threading.Lock()

        def _authenticate(self, stale: str | None) -> str:
            with self._lock:
                if self._token is not None and self._token != stale:
                    return self._token  # another thread already did it
                try:
                    r = super().request("POST", endpoint.url + "/v3/auth/authenticate", timeout=timeout,
                                        json={"name": endpoint.username, "password": endpoint.password})
                except requests.exceptions.Timeout as e:
                    raise exceptions.ConnectionTimeoutError(str(e)) from e
                except requests.exceptions.ConnectionError as e:
                    raise exceptions.ConnectionFailedError(str(e)) from e
                self._token = _token_of(r, endpoint)
                return self._token

        def request(self, method: str | bytes, url: str | bytes, *args: Any, **kwargs: Any) -> Any:
            token = self._token if self._token is not None else self._authenticate(None)
            headers = dict(kwargs.pop("headers", None) or {})
            for attempt in range(_AUTH_RETRIES + 1):
                if token:
                    headers["Authorization"] = token
                else:
                    headers.pop("Authorization", None)
                r = super().request(method, url, *args, headers=headers, **kwargs)
                if attempt == _AUTH_RETRIES:
                    return r
                if r.status_code == 401 or (r.status_code == 400 and not token and _NO_USER in r.content):
                    # the token expired or was dropped (a user changed), or authentication was turned on
                    # since this client found it off: a new token
                    r.close()
                    token = self._authenticate(token)
                elif r.status_code == 400 and _OLD_AUTH_REVISION in r.content:
                    # the users or roles changed between the token's check and the call: etcd's own
                    # client retries these, as the call was not applied
                    r.close()
                else:
                    return r
            raise AssertionError("unreachable")

    s: Any = TokenSession() if endpoint.username else requests.Session()
    if endpoint.url.startswith("https://"):
        use_tls(s)
    return s


def use_tls(session: Any) -> None:
    """Verify etcd with ``ONEPIECE_ETCD_CA`` (else the system's CAs) and present ``ONEPIECE_ETCD_CERT`` /
    ``ONEPIECE_ETCD_KEY`` when both are set."""
    if envs.ETCD_CA:
        session.verify = envs.ETCD_CA
    if envs.ETCD_CERT and envs.ETCD_KEY:
        session.cert = (envs.ETCD_CERT, envs.ETCD_KEY)


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

        parsed = [Endpoint.parse(u) for u in (parse_endpoints(urls) if isinstance(urls, str) else urls)]
        self.endpoints = [e.url for e in parsed]  # without passwords: safe to log
        self.authenticated = any(e.username for e in parsed)
        self.timeout = timeout
        # requests takes (connect, read): a dead member costs at most the connect timeout.
        t: Any = None if timeout is None else (min(CONNECT_TIMEOUT_S, timeout), timeout)
        self.clients = []
        for e in parsed:
            u = urlparse(e.url)
            self.clients.append(etcd3gw.client(host=u.hostname or "127.0.0.1", port=u.port or 2379,
                                               protocol=u.scheme, timeout=t, session=_session(e, t)))
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

    def member(self) -> Any:
        """The ``etcd3gw`` client of a member that answers now (a stream, a watch, stays on one member)."""
        return self._call(lambda c: (c.status(), c)[1])

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
                return getattr(self.member(), name)(*args, **kwargs)
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
