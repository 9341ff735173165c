"""The embedded S3 server's own process: OpenStack Swift's four servers with its ``s3api`` layer, in one process.

Run as ``PYTHON .../engine/embedded/s3_launcher.py DATA_DIR HOST PORT [MIN_PART_BYTES]`` by :class:`engine.embedded.s3.SwiftS3Server`,
with an interpreter that has swift (its own virtual environment: it needs the standard library and swift,
not this package); never imported by the engine. Swift runs on eventlet, which patches the standard library's sockets and
threads when it starts: it gets a process of its own so that nothing else has to live with that.

What it runs, all on ``HOST`` (loopback): the proxy with ``s3api`` in front of ``tempauth`` on ``PORT``, and
an account, a container and an object server on ports of their own, chosen each start (the rings are
written anew each start; with one device every partition lives on it, so the data's place does not move).
The S3 credentials come from ``DATA_DIR/s3-credentials.json`` (mode 0600, written by the parent): its
``access_key`` is tempauth's ``account:user`` and ``secret_key`` the user's key, so they never appear on a
command line. Objects live under ``DATA_DIR/devices`` (a file system with user extended attributes:
ext4, xfs, tmpfs since Linux 6.6).

Why Swift: measured on this kind of machine, its ``s3api`` checks SigV4 signatures, refuses tampered and
expired presigned URLs, and returns byte-exact multipart objects and Range GETs; Ceph's RADOS Gateway
with the SQLite dbstore did not, and moto accepts wrong secrets (docs/operations.md, "Object storage").
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import sys
from pathlib import Path
from typing import Any

PART_POWER = 6  # 64 partitions: one device, so any power works; small keeps the rings tiny
MIN_PART_BYTES = 5 << 20  # s3api's smallest multipart part but the last: S3's 5 MiB (a test server may lower it)

_SWIFT_CONF = """\
[swift-hash]
swift_hash_path_suffix = {suffix}
swift_hash_path_prefix = {prefix}

[storage-policy:0]
name = default
default = yes
"""

_BACKEND_CONF = """\
[DEFAULT]
devices = {devices}
mount_check = false
swift_dir = {swift_dir}
log_level = WARNING
log_custom_handlers = __main__.log_to_stderr

[pipeline:main]
pipeline = {kind}-server

[app:{kind}-server]
use = egg:swift#{kind}
"""

# s3_only first: Swift's own token API is not served (no memcache here: tempauth answered a made-up X-Auth-Token
# with a 500); s3api before tempauth (its SigV4 check hands tempauth the signature to verify with the user's
# key); slo after it (S3 multipart uploads are static large objects). The proxy adds the filters it requires
# (catch_errors, gatekeeper, proxy-logging, copy, dlo, ...) itself.
_PROXY_CONF = """\
[DEFAULT]
swift_dir = {swift_dir}
log_level = WARNING
log_custom_handlers = __main__.log_to_stderr

[pipeline:main]
pipeline = catch_errors proxy-logging s3_only s3api tempauth slo dlo proxy-logging proxy-server

[app:proxy-server]
use = egg:swift#proxy
account_autocreate = true

[filter:s3api]
use = egg:swift#s3api
location = us-east-1
min_segment_size = {min_part}

[filter:tempauth]
use = egg:swift#tempauth
reseller_prefix = AUTH
user_{account}_{user} = {key} .admin

[filter:slo]
use = egg:swift#slo

[filter:dlo]
use = egg:swift#dlo

[filter:s3_only]
paste.filter_factory = __main__:s3_only_filter

[filter:catch_errors]
use = egg:swift#catch_errors

[filter:proxy-logging]
use = egg:swift#proxy_logging
"""


def log_to_stderr(conf: Any, name: Any, log_to_console: Any, log_route: Any, fmt: Any, logger: logging.Logger,
                  adapted_logger: Any) -> None:
    """Swift's ``log_custom_handlers`` hook: its logs go to stderr (the service's log file), not to syslog."""
    for h in list(logger.handlers):
        if isinstance(h, logging.handlers.SysLogHandler):
            logger.removeHandler(h)
            h.close()
    if not any(isinstance(h, logging.StreamHandler) for h in logger.handlers):
        handler = logging.StreamHandler(sys.__stderr__)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logger.addHandler(handler)


SWIFT_AUTH_HEADERS = ("HTTP_X_AUTH_TOKEN", "HTTP_X_STORAGE_TOKEN", "HTTP_X_SERVICE_TOKEN", "HTTP_X_AUTH_USER",
                      "HTTP_X_AUTH_KEY", "HTTP_X_STORAGE_USER", "HTTP_X_STORAGE_PASS")


def s3_only_filter(global_conf: Any, **local_conf: Any) -> Any:
    """Paste's filter factory of ``s3_only``: a request that uses Swift's own authentication (a token header,
    tempauth's user and key headers, or its ``/auth`` path) gets a 401 saying the store takes S3 requests. The
    embedded store issues no Swift tokens (the engine and clients sign S3 requests), and tempauth, without a
    memcache to look a token up in, answered a made-up one with a 500."""

    def factory(app: Any) -> Any:
        def s3_only(env: dict[str, Any], start_response: Any) -> Any:
            path = env.get("PATH_INFO", "")
            if any(env.get(h) for h in SWIFT_AUTH_HEADERS) or path == "/auth" or path.startswith("/auth/"):
                body = b"this store takes S3 requests (AWS SigV4) only; Swift tokens are not issued or accepted\n"
                start_response("401 Unauthorized", [("Content-Type", "text/plain"),
                                                    ("Content-Length", str(len(body))),
                                                    ("WWW-Authenticate", 'Swift realm="unknown"')])
                return [body]
            return app(env, start_response)

        return s3_only

    return factory


def _write(path: Path, text: str, mode: int = 0o600) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def main(argv: list[str]) -> int:
    data, host, port = Path(argv[0]), argv[1], int(argv[2])
    min_part = int(argv[3]) if len(argv) > 3 else MIN_PART_BYTES
    import warnings

    warnings.filterwarnings("ignore", message="(?s).*Eventlet is deprecated", category=DeprecationWarning)
    import eventlet  # first: every later import sees the patched modules

    eventlet.monkey_patch(all=False, socket=True, select=True, thread=True, time=True)
    import secrets

    import eventlet.wsgi
    from swift.common import utils
    from swift.common.ring import RingBuilder
    from swift.common.storage_policy import reload_storage_policies
    from swift.common.wsgi import loadapp

    creds = json.loads((data / "s3-credentials.json").read_text())
    account, user = creds["access_key"].split(":", 1)
    swift_dir = data / "conf"
    devices = data / "devices"
    (devices / "d0").mkdir(parents=True, exist_ok=True)
    swift_dir.mkdir(exist_ok=True)
    swift_conf = swift_dir / "swift.conf"
    if not swift_conf.exists():  # the hash salt decides where objects live: written once, kept for ever
        _write(swift_conf, _SWIFT_CONF.format(suffix=secrets.token_hex(8), prefix=secrets.token_hex(8)))
    utils.set_swift_dir(str(swift_dir))
    reload_storage_policies()

    socks = {kind: eventlet.listen((host, 0)) for kind in ("account", "container", "object")}
    socks["proxy"] = eventlet.listen((host, port))
    for kind in ("account", "container", "object"):
        builder = RingBuilder(PART_POWER, 1, 0)
        builder.add_dev({"id": 0, "region": 1, "zone": 1, "ip": host, "port": socks[kind].getsockname()[1],
                         "device": "d0", "weight": 100, "meta": ""})
        builder.rebalance()
        builder.get_ring().save(str(swift_dir / f"{kind}.ring.gz"))
        _write(swift_dir / f"{kind}-server.conf",
               _BACKEND_CONF.format(devices=devices, swift_dir=swift_dir, kind=kind))
    _write(swift_dir / "proxy-server.conf",
           _PROXY_CONF.format(swift_dir=swift_dir, account=account, user=user, key=creds["secret_key"],
                              min_part=min_part))

    apps = {kind: loadapp(str(swift_dir / f"{kind}-server.conf")) for kind in socks}
    quiet = logging.getLogger("s3-launcher-wsgi")
    quiet.setLevel(logging.WARNING)
    pool = eventlet.GreenPool()
    for kind, sock in socks.items():
        pool.spawn(eventlet.wsgi.server, sock, apps[kind], log=quiet, log_output=False,
                   custom_pool=eventlet.GreenPool(1024))
    print(f"s3 server ready on http://{host}:{port}", file=sys.stderr, flush=True)
    pool.waitall()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
