"""Which webhook URLs the platform may call: no request of ours may reach the platform's own network.

A webhook URL is chosen by a client, and the platform POSTs to it from inside its network, next to
Redis, etcd, the Proxy and the cloud's metadata service. So a URL is vetted when it is registered (a
400 naming the field) and again before every attempt, because a name that resolved to a public
address at registration may resolve to ``127.0.0.1`` later (DNS rebinding). The attempt then connects
to the address that was vetted, never to a second lookup's answer.

Refused unless ``WEBHOOK_ALLOW_PRIVATE`` (``onepiece up``'s local settings allow them: the receiver
is usually on the same machine): any resolved address that is loopback, private, link-local,
multicast, reserved, unspecified or otherwise not globally routable (shared address space, documentation
ranges), including IPv4 addresses inside IPv6 (mapped, 6to4, Teredo). Always refused: schemes other
than http and https, credentials in the URL, and plain http when ``WEBHOOK_REQUIRE_HTTPS`` (production).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from onepiece_platform import conf

MAX_URL = 2000


class UnsafeUrl(ValueError):
    """A URL the platform will not call; the message says why (shown to the client)."""


@dataclass(frozen=True)
class Target:
    scheme: str
    host: str  # IDNA-encoded: what the Host header and TLS name check use
    port: int
    path: str  # path and query, "/" at least
    addresses: tuple[str, ...]  # vetted, in getaddrinfo's order: the only ones an attempt connects to


def _why_refused(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    if isinstance(ip, ipaddress.IPv6Address):
        for inner in (ip.ipv4_mapped, ip.sixtofour, ip.teredo[1] if ip.teredo else None):
            if inner is not None:
                why = _why_refused(inner)
                if why:
                    return why
    for name in ("loopback", "private", "link_local", "multicast", "reserved", "unspecified", "site_local"):
        if getattr(ip, f"is_{name}", False):  # site-local (fec0::/10, deprecated, still routed inside sites): IPv6
            return name.replace("_", "-")
    if not ip.is_global:
        return "not globally routable"
    return None


def parse(url: str) -> tuple[str, str, int, str]:
    """(scheme, IDNA host, port, path with query) of a syntactically acceptable URL; raises UnsafeUrl."""
    if not isinstance(url, str) or not url or len(url) > MAX_URL:
        raise UnsafeUrl(f"a URL of at most {MAX_URL} characters is required")
    try:
        parts = urlsplit(url.strip())
        port = parts.port
    except ValueError as exc:
        raise UnsafeUrl(f"not a valid URL: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https"):
        raise UnsafeUrl("only http and https URLs are called")
    if scheme == "http" and conf.get("WEBHOOK_REQUIRE_HTTPS"):
        raise UnsafeUrl("webhook URLs must use https")
    if parts.username is not None or parts.password is not None:
        raise UnsafeUrl("credentials in the URL are not sent; authenticate deliveries by their signature")
    host = parts.hostname or ""
    try:
        host = host.encode("idna").decode("ascii") if host else ""
    except UnicodeError:
        host = ""
    if not host:
        raise UnsafeUrl("the URL has no valid host name")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return scheme, host, port or (443 if scheme == "https" else 80), path


def vet(url: str) -> Target:
    """Parse ``url``, resolve its host and check every address; raises :class:`UnsafeUrl`."""
    scheme, host, port, path = parse(url)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise UnsafeUrl(f"cannot resolve {host}: {exc}") from None
    addresses = tuple(dict.fromkeys(str(info[4][0]) for info in infos))
    if not addresses:
        raise UnsafeUrl(f"{host} has no address")
    if not conf.get("WEBHOOK_ALLOW_PRIVATE"):
        for a in addresses:
            why = _why_refused(ipaddress.ip_address(a.split("%", 1)[0]))
            if why:
                raise UnsafeUrl(f"{host} resolves to {a}, a {why} address; webhooks are only sent to public "
                                "addresses")
    return Target(scheme, host, port, path, addresses)
