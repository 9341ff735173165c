"""Who may call the Proxy: holders of its shared secret.

The Proxy accepts work that skips the platform's quotas and ledger, returns
any job's result by UID and cancels any job, so every route but the health
probes (``/livez``, ``/readyz``: what load balancers and kubelets call) needs
``Authorization: Bearer <ONEPIECE_PROXY_TOKEN>``. The comparison is
constant-time (``hmac.compare_digest``), and it runs before a body is read,
so an anonymous caller costs a header parse and nothing else.

Mutual TLS would also do; a shared secret was chosen because the callers (the
web platform, its Celery workers, ``onepiece bench e2e``) already receive
their configuration through the environment, and a NetworkPolicy (deploy/k8s)
limits who can reach the port at all.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from aiohttp import web

OPEN_PATHS = frozenset({"/livez", "/readyz"})
MIN_TOKEN_CHARS = 16

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def auth_headers(token: str | None) -> dict[str, str]:
    """The header a caller sends (none without a token)."""
    return {"Authorization": f"Bearer {token}"} if token else {}


def check_token(token: str | None) -> str:
    """``token`` when it is usable as the Proxy's secret; ``ValueError`` saying why otherwise."""
    if not token or len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"the Proxy needs a shared secret of at least {MIN_TOKEN_CHARS} characters "
                         "(ONEPIECE_PROXY_TOKEN); `onepiece up` generates one, a deployment sets it from a Secret")
    return token


def presented(request: web.Request) -> str:
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    return value.strip() if scheme.lower() == "bearer" else ""


def middleware(token: str) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
    expected = check_token(token).encode()

    @web.middleware
    async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        if not hmac.compare_digest(presented(request).encode(), expected):
            # Connection: close, so an unread body is not drained to keep the connection alive
            return web.json_response({"error": "missing or wrong Proxy credential (Authorization: Bearer ...)"},
                                     status=401, headers={"WWW-Authenticate": 'Bearer realm="onepiece-proxy"',
                                                          "Connection": "close"})
        return await handler(request)

    return authenticate
