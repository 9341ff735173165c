"""Turn etcd's authentication on for the engine, idempotently.

etcd answers anyone who reaches its client port until authentication is
enabled. :func:`ensure_auth` makes it refuse them: it creates

- ``root`` (role ``root``), whose password only the operator keeps (etcd needs
  a root user before it will enable authentication), and
- the engine's user (``onepiece`` by default) with a role that may read and
  write the engine's keys only (``<prefix>/`` and below),

then enables authentication. Run again on a cluster where it is already on, it
authenticates as root, sets the engine user's password to the given one and
re-grants its role, so a rotated password is a re-run. Every engine process
and the platform then connect with ``http://onepiece:<password>@host:2379``
(:mod:`engine.coord.client`).

``onepiece up`` calls it for its embedded etcd (passwords generated into the
state folder); deployments run ``onepiece etcd-auth`` once (the Kubernetes Job
and the compose service in ``deploy/``).

It speaks etcd's gRPC gateway (``/v3/auth/...``) with ``requests`` directly:
etcd3gw has no auth calls.
"""

from __future__ import annotations

import argparse
import base64
import os
from typing import Any

from engine import envs
from engine.coord.client import Endpoint, redact, use_tls
from engine.coord.keys import default_root

ENGINE_USER = "onepiece"
ENGINE_ROLE = "onepiece"


class EtcdAuthSetupError(RuntimeError):
    """etcd refused a step of the set-up; the message names the step and etcd's answer."""


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def _range_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's prefix range)."""
    b = bytearray(prefix)
    while b:
        if b[-1] < 0xFF:
            b[-1] += 1
            return bytes(b)
        b.pop()
    return b"\0"


class _Gateway:
    def __init__(self, url: str, timeout: float) -> None:
        import requests

        self.url = Endpoint.parse(url).url
        self.http = requests.Session()
        if self.url.startswith("https://"):
            use_tls(self.http)
        self.timeout = timeout
        self.token = ""

    def call(self, step: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        headers = {"Authorization": self.token} if self.token else {}
        r = self.http.post(f"{self.url}/v3/{path}", json=body, headers=headers, timeout=self.timeout)
        try:
            data = r.json()
        except ValueError:
            data = {"error": r.text[:200]}
        return r.status_code, data

    def must(self, step: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
        status, data = self.call(step, path, body)
        if status != 200:
            raise EtcdAuthSetupError(f"etcd at {self.url}: {step} failed ({status}): {data.get('error', data)}")
        return data


def auth_enabled(url: str, timeout: float = 5.0) -> bool:
    """Whether etcd at ``url`` refuses an anonymous read."""
    gw = _Gateway(url, timeout)
    status, data = gw.call("probe", "kv/range", {"key": _b64(default_root() + "/")})
    if status == 200:
        return False
    if status in (400, 401) and ("user name is empty" in str(data.get("error", ""))
                                 or int(data.get("code", 0)) == 16):
        return True
    raise EtcdAuthSetupError(f"etcd at {gw.url}: probe failed ({status}): {data.get('error', data)}")


def ensure_auth(url: str, root_password: str, password: str, *, user: str = ENGINE_USER,
                prefix: str | None = None, timeout: float = 5.0) -> bool:
    """Make etcd at ``url`` (one member is enough: users are cluster-wide) require authentication,
    with ``user``/``password`` allowed to read and write ``prefix/`` and below (default: the engine's
    root, ``ONEPIECE_ETCD_ROOT`` or ``/onepiece``). While authentication is off, root's password is
    set to ``root_password`` too (a root left by an aborted run keeps no stale password).

    Returns True when this call enabled authentication, False when it was already on (the user,
    its password and its role were brought up to date as root)."""
    if not root_password or not password:
        raise ValueError("etcd auth needs a root password and the engine user's password")
    gw = _Gateway(url, timeout)
    was_on = auth_enabled(url, timeout)
    if was_on:
        data = gw.must("authenticate as root", "auth/authenticate", {"name": "root", "password": root_password})
        gw.token = str(data["token"])
    users = set(gw.must("list users", "auth/user/list", {}).get("users") or [])
    roles = set(gw.must("list roles", "auth/role/list", {}).get("roles") or [])
    prefix = prefix or default_root()
    if "root" not in users:
        gw.must("add user root", "auth/user/add", {"name": "root", "password": root_password})
    elif not was_on:
        gw.must("set the password of root", "auth/user/changepw", {"name": "root", "password": root_password})
    if "root" not in roles:
        gw.must("add role root", "auth/role/add", {"name": "root"})
    gw.must("grant role root to root", "auth/user/grant", {"user": "root", "role": "root"})
    if user in users:
        gw.must(f"set the password of {user}", "auth/user/changepw", {"name": user, "password": password})
    else:
        gw.must(f"add user {user}", "auth/user/add", {"name": user, "password": password})
    if ENGINE_ROLE not in roles:
        gw.must(f"add role {ENGINE_ROLE}", "auth/role/add", {"name": ENGINE_ROLE})
    key = (prefix.rstrip("/") + "/").encode()
    gw.must(f"grant {prefix}/ to role {ENGINE_ROLE}", "auth/role/grant", {
        "name": ENGINE_ROLE,
        "perm": {"permType": "READWRITE", "key": base64.b64encode(key).decode(),
                 "range_end": base64.b64encode(_range_end(key)).decode()},
    })
    gw.must(f"grant role {ENGINE_ROLE} to {user}", "auth/user/grant", {"user": user, "role": ENGINE_ROLE})
    if not was_on:
        gw.must("enable authentication", "auth/enable", {})
    return not was_on


# `onepiece etcd-auth` ----------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Enable etcd authentication for the engine (idempotent): a root user, and an engine user that may "
        "read and write only the engine's keys. Passwords come from the environment, never the command line."
    )
    p.add_argument("--etcd-url", default=None,
                   help="one member's client URL, without credentials (default: ONEPIECE_ETCD_URL's first)")
    p.add_argument("--user", default=ENGINE_USER, help="the engine's etcd user (default: %(default)s)")
    p.add_argument("--prefix", default=None,
                   help="the engine's key prefix (default: ONEPIECE_ETCD_ROOT, else /onepiece)")
    p.add_argument("--root-password-env", default="ETCD_ROOT_PASSWORD",
                   help="environment variable holding root's password (default: %(default)s)")
    p.add_argument("--password-env", default="ETCD_ONEPIECE_PASSWORD",
                   help="environment variable holding the engine user's password (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    url = args.etcd_url or (envs.ETCD_URL or "").split(",")[0].strip()
    if not url:
        print("onepiece etcd-auth: give --etcd-url or set ONEPIECE_ETCD_URL")
        return 2
    root_pw, pw = os.environ.get(args.root_password_env, ""), os.environ.get(args.password_env, "")
    if not root_pw or not pw:
        print(f"onepiece etcd-auth: set {args.root_password_env} and {args.password_env}")
        return 2
    url = Endpoint.parse(url).url
    try:
        prefix = (args.prefix or default_root()).rstrip("/")
        enabled = ensure_auth(url, root_pw, pw, user=args.user, prefix=prefix)
    except (EtcdAuthSetupError, OSError) as exc:
        print(f"onepiece etcd-auth: {exc}")
        return 1
    print(f"etcd {redact(url)}: authentication {'enabled' if enabled else 'already on; user updated'}; "
          f"user {args.user} may read and write {prefix}/")
    return 0
