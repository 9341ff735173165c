"""DRF authentication by ``Authorization: Bearer <key>``, with failed attempts rate-limited.

Failures are counted per client address in Redis with one atomic INCR (+ an
expiry set on the first failure of a window), so concurrent attempts cannot
slip past the limit the way a read-then-write throttle can. Over the limit,
every failing Bearer attempt from that address is answered 429 with
Retry-After; a valid key still authenticates (one guesser behind a shared
address, a NAT or an office, must not lock its neighbours' valid keys out).
"""

from __future__ import annotations

from typing import Any

from django.utils import timezone
from rest_framework import exceptions
from rest_framework.authentication import BaseAuthentication, get_authorization_header
from rest_framework.request import Request

from onepiece_platform import conf
from onepiece_platform.accounts.models import ApiKey, split_key
from onepiece_platform.ops import metrics
from onepiece_platform.redis_conn import get_redis

_INCR = """
local n = redis.call('INCR', KEYS[1])
if n == 1 then redis.call('EXPIRE', KEYS[1], ARGV[1]) end
return {n, redis.call('TTL', KEYS[1])}
"""


def client_address(request: Request) -> str:
    """The client's address: REMOTE_ADDR, or the entry that the nearest trusted proxy appended.

    The one reader of X-Forwarded-For: the web server runs with ``--no-proxy-headers``
    (onepiece_launcher.up.WEB_SERVER_FLAGS), so REMOTE_ADDR is the socket's peer and no hop is believed
    unless TRUSTED_PROXY_HOPS says a reverse proxy is in front."""
    hops = int(conf.get("TRUSTED_PROXY_HOPS"))
    forwarded = [a.strip() for a in request.META.get("HTTP_X_FORWARDED_FOR", "").split(",") if a.strip()]
    if hops > 0 and len(forwarded) >= hops:
        return forwarded[-hops]  # entries left of it are the client's own claims, not to be trusted
    return str(request.META.get("REMOTE_ADDR", ""))


def _failure_key(request: Request) -> str:
    return f"{conf.get('REDIS_PREFIX')}:authfail:{client_address(request)}"


def failure_wait(request: Any) -> int | None:
    """Seconds until the client's address may fail again (over the limit), or None. Any request with
    ``META`` (DRF's or Django's: the admin's sign-in counts against the same limit)."""
    r = get_redis()
    key = _failure_key(request)
    n = r.get(key)
    if n is not None and int(n) >= conf.get("AUTH_FAILURES_LIMIT"):
        metrics.REJECTIONS.labels(reason="auth_rate_limited").inc()
        return max(1, int(r.ttl(key)))
    return None


def _check_not_blocked(request: Request) -> None:
    wait = failure_wait(request)
    if wait is not None:
        raise exceptions.Throttled(wait=wait, detail="too many failed authentications")


def record_failure(request: Any) -> None:
    _record_failure(request)


def _record_failure(request: Request) -> None:
    metrics.REJECTIONS.labels(reason="auth_failed").inc()
    get_redis().eval(_INCR, 1, _failure_key(request), int(conf.get("AUTH_FAILURES_WINDOW_S")))


class ApiKeyAuthentication(BaseAuthentication):
    """``Authorization: Bearer op_<prefix>_<secret>``; no header: not this scheme (returns None)."""

    keyword = b"bearer"

    def authenticate(self, request: Request) -> tuple[Any, ApiKey] | None:
        auth = get_authorization_header(request).split()
        if not auth or auth[0].lower() != self.keyword:
            return None
        if len(auth) != 2:
            _check_not_blocked(request)
            _record_failure(request)
            raise exceptions.AuthenticationFailed("Authorization must be 'Bearer <key>'")
        try:
            raw = auth[1].decode()
        except UnicodeDecodeError:
            raw = ""
        parts = split_key(raw)
        key = ApiKey.objects.select_related("user", "user__priority_tier").filter(prefix=parts[0]).first() if parts else None
        if key is None or parts is None or not key.matches(parts[1]) or not key.active or not key.user.is_active:
            _check_not_blocked(request)
            _record_failure(request)
            raise exceptions.AuthenticationFailed("invalid, expired or revoked API key")
        ApiKey.objects.filter(pk=key.pk).update(last_used_at=timezone.now())
        return key.user, key

    def authenticate_header(self, request: Request) -> str:
        return 'Bearer realm="onepiece"'
