"""The embedded object store: an S3 server (OpenStack Swift with ``s3api``) as a child process on loopback.

Started and stopped like :class:`engine.embedded.services.RedisServer`: by ``onepiece up`` (supervised,
its data in the state folder) and by the test fixtures (tests/fixtures/objects.py). The server itself
runs :mod:`engine.embedded.s3_launcher` (by its path), a process of its own (Swift runs on eventlet).

Its interpreter is a virtual environment of its own, ``<venv>/s3-venv`` (``./quickstart`` makes it), not
the project's: with eventlet importable, futurist (under etcd3gw) imports it in every engine process,
which cost each about 170 ms of imports and a deprecation warning. ``ONEPIECE_S3_PYTHON`` names another.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import socket
import sys
from pathlib import Path
from urllib.parse import quote

from engine import envs
from engine.embedded.services import ServiceError, _ChildService, free_port

ACCESS_KEY = "onepiece:engine"  # tempauth's account:user; not a secret (the key is)
CREDENTIALS = "s3-credentials.json"
S3_VENV = "s3-venv"  # under the project's virtual environment (sys.prefix)
SWIFT_REQUIREMENT = "swift>=2.38,<2.39"  # ./quickstart installs the same
LAUNCHER = Path(__file__).with_name("s3_launcher.py")


class SwiftS3Server(_ChildService):
    """Swift's proxy, account, container and object servers with ``s3api``, one process, on ``host:port``.

    Its credentials are generated once into ``data_dir/s3-credentials.json`` (mode 0600) and kept, like
    the embedded Redis's password: a restart keeps every client's URL, and every presigned URL it signed,
    valid. :attr:`url` is the ``ONEPIECE_OBJECT_STORE`` URL with them (``http://ACCESS:SECRET@host:port/bucket``).
    """

    name = "s3"

    def __init__(self, data_dir: Path, host: str = "127.0.0.1", port: int | None = None,
                 bucket: str = "onepiece-outputs", python: str | None = None,
                 min_part_bytes: int | None = None) -> None:
        """``min_part_bytes``: the smallest multipart part but the last it accepts (None: S3's 5 MiB, what
        ``onepiece up`` runs; a test server lowers it to stream a small video in several parts)."""
        super().__init__(python or envs.S3_PYTHON or "", data_dir, host)
        self.min_part_bytes = min_part_bytes
        self.port = port or free_port(host)
        self.bucket = bucket
        self.access_key, self.secret_key = ACCESS_KEY, self._credentials()

    def _credentials(self) -> str:
        path = self.data_dir / CREDENTIALS
        try:
            got = json.loads(path.read_text())
            if got.get("access_key") == ACCESS_KEY and got.get("secret_key"):
                return str(got["secret_key"])
        except (OSError, ValueError):
            pass
        self.data_dir.mkdir(parents=True, exist_ok=True)
        key = secrets.token_hex(24)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"access_key": ACCESS_KEY, "secret_key": key}, f)
        return key

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return (f"http://{quote(self.access_key, safe='')}:{quote(self.secret_key, safe='')}"
                f"@{self.host}:{self.port}/{self.bucket}")

    def _resolve(self) -> str:
        """The interpreter to run Swift with: the one given (``python``, ``ONEPIECE_S3_PYTHON``), else
        ``<venv>/s3-venv/bin/python``, else this one when it has swift."""
        if self.binary:
            return self.binary
        own = Path(sys.prefix) / S3_VENV / "bin" / "python"
        if own.exists():
            return str(own)
        if importlib.util.find_spec("swift") is not None and importlib.util.find_spec("eventlet") is not None:
            return sys.executable
        raise ServiceError(
            f"s3: no Python with OpenStack Swift: {own} does not exist; ./quickstart installs it "
            f"({sys.executable} -m venv {Path(sys.prefix) / S3_VENV} && {own} -m pip install "
            f"'{SWIFT_REQUIREMENT}'), or set ONEPIECE_S3_PYTHON, or point --object-store / "
            f"ONEPIECE_OBJECT_STORE at another S3 server, or use --object-store none")

    def _argv(self, binary: str) -> list[str]:
        # by its path: the launcher needs only the standard library and swift, not this package
        extra = [] if self.min_part_bytes is None else [str(int(self.min_part_bytes))]
        return [binary, str(LAUNCHER), str(self.data_dir), self.host, str(self.port), *extra]

    def _ready(self) -> bool:
        # any S3 answer from the proxy will do (an anonymous GET is refused with 403): its backends listen
        # before it accepts
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                s.sendall(f"GET / HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nConnection: close\r\n\r\n".encode())
                return s.recv(12).startswith(b"HTTP/1.1 ")
        except OSError:
            return False

    def start(self, timeout: float = 30.0) -> SwiftS3Server:
        super().start(timeout)
        from engine.store.objects import ObjectStore, ObjectStoreError

        store = ObjectStore.from_url(self.url)
        try:
            store.ensure_bucket()
        except ObjectStoreError as exc:
            self.stop()
            raise ServiceError(f"s3: could not create the bucket {self.bucket!r}: {exc} (log: {self.log_path})") \
                from exc
        finally:
            store.close()
        return self
