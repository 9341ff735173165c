"""Start and stop redis-server and etcd on free loopback ports."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote

from engine.coord.auth import ENGINE_USER, EtcdAuthSetupError, ensure_auth
from engine.embedded import children


class ServiceError(RuntimeError):
    """An embedded service could not be started; the message says why and how to fix it."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class _ChildService:
    name = "service"
    apt_package = ""

    def __init__(self, binary: str, data_dir: Path, host: str = "127.0.0.1") -> None:
        self.binary = binary
        self.data_dir = Path(data_dir)
        self.host = host
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.data_dir / f"{self.name}.log"

    def _resolve(self) -> str:
        found = shutil.which(self.binary)
        if not found:
            raise ServiceError(
                f"{self.name}: binary {self.binary!r} not found on PATH; "
                f"install the Debian package {self.apt_package!r} (the quick start does this) "
                f"or point ONEPIECE_{self.name.upper()}_URL at a running server"
            )
        return found

    def _argv(self, binary: str) -> list[str]:
        raise NotImplementedError

    def _ready(self) -> bool:
        raise NotImplementedError

    def start(self, timeout: float = 20.0) -> _ChildService:
        binary = self._resolve()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        # own session (Ctrl-C reaches the launcher, which stops us cleanly), SIGTERM if the launcher dies
        self.proc = children.popen(self._argv(binary), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise ServiceError(f"{self.name} exited with {self.proc.returncode}; log tail:\n{tail}")
            if self._ready():
                return self
            time.sleep(0.05)
        self.stop()
        raise ServiceError(f"{self.name} did not become ready within {timeout}s (log: {self.log_path})")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout)

    def __enter__(self) -> _ChildService:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisServer(_ChildService):
    """A redis-server child with no persistence (results are transient by design).

    It always has a password (``password``, else the one an earlier server used in the same folder, else a
    random one) and protected mode on: anyone
    else on the host, or on the network when it binds beyond loopback, gets nothing without it. The
    password is in :attr:`url` (``redis://:password@host:port/0``), which is what every client is given.
    It reaches redis-server through its config on stdin, never its command line (``ps`` shows that).
    """

    name = "redis"
    apt_package = "redis-server"

    def __init__(self, binary: str, data_dir: Path, host: str = "127.0.0.1", port: int | None = None,
                 password: str | None = None):
        super().__init__(binary, data_dir, host)
        self.port = port or free_port(host)
        self.password = password or self._previous_password() or secrets.token_urlsafe(24)

    def _previous_password(self) -> str | None:
        """The password of an earlier server in the same folder: a restart keeps its clients' URLs valid."""
        try:
            line = (self.data_dir / "redis.conf").read_text().strip()
        except OSError:
            return None
        if line.startswith('requirepass "') and line.endswith('"'):
            return line[len('requirepass "'):-1] or None
        return None

    @property
    def url(self) -> str:
        return f"redis://:{quote(self.password, safe='')}@{self.host}:{self.port}/0"

    def _argv(self, binary: str) -> list[str]:
        conf = self.data_dir / "redis.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f'requirepass "{self.password}"\n')
        return [
            binary, str(conf), "--port", str(self.port), "--bind", self.host, "--save", "",
            "--appendonly", "no", "--dir", str(self.data_dir), "--protected-mode", "yes",
        ]

    def _ready(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                s.sendall(f"AUTH {self.password}\r\nPING\r\n".encode())
                got = b""
                while got.count(b"\r\n") < 2:
                    chunk = s.recv(64)
                    if not chunk:
                        return False
                    got += chunk
                return got.endswith(b"+PONG\r\n")
        except OSError:
            return False


class EtcdServer(_ChildService):
    """A single-member etcd child listening on free loopback ports.

    Given ``password`` (and ``root_password``), it has authentication on once started
    (:func:`engine.coord.auth.ensure_auth`): only the engine user ``onepiece`` with that password
    reads or writes the engine's keys, and :attr:`url` carries the credentials
    (``http://onepiece:<password>@host:port``), which is what every client is given.
    """

    name = "etcd"
    apt_package = "etcd-server"

    def __init__(
        self,
        binary: str,
        data_dir: Path,
        host: str = "127.0.0.1",
        client_port: int | None = None,
        peer_port: int | None = None,
        password: str | None = None,
        root_password: str | None = None,
    ):
        super().__init__(binary, data_dir, host)
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        self.password = password
        self.root_password = root_password or password

    @property
    def plain_url(self) -> str:
        """The client URL without credentials (health checks, logs)."""
        return f"http://{self.host}:{self.client_port}"

    @property
    def url(self) -> str:
        if not self.password:
            return self.plain_url
        return f"http://{ENGINE_USER}:{quote(self.password, safe='')}@{self.host}:{self.client_port}"

    def start(self, timeout: float = 20.0) -> EtcdServer:
        super().start(timeout)
        if self.password:
            try:
                assert self.root_password
                ensure_auth(self.plain_url, self.root_password, self.password)
            except (EtcdAuthSetupError, OSError) as exc:
                self.stop()
                raise ServiceError(
                    f"etcd: could not enable authentication: {exc} (an etcd data folder from another "
                    f"installation? its root password differs; remove {self.data_dir / 'etcd-data'})"
                ) from exc
        return self

    def _argv(self, binary: str) -> list[str]:
        peer = f"http://{self.host}:{self.peer_port}"
        return [
            binary,
            "--name", "onepiece",
            "--data-dir", str(self.data_dir / "etcd-data"),
            "--listen-client-urls", self.plain_url,
            "--advertise-client-urls", self.plain_url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"onepiece={peer}",
            "--log-level", "warn",
        ]

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.plain_url + "/health", timeout=0.5) as r:
                return b'"health":"true"' in r.read()
        except (urllib.error.URLError, OSError):
            return False
