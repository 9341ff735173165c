"""Start and stop redis-server and etcd on free loopback ports."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


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
        self.proc = subprocess.Popen(
            self._argv(binary),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C in the terminal reaches the launcher, which stops us cleanly
        )
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
    """A redis-server child with no persistence (results are transient by design)."""

    name = "redis"
    apt_package = "redis-server"

    def __init__(self, binary: str, data_dir: Path, host: str = "127.0.0.1", port: int | None = None):
        super().__init__(binary, data_dir, host)
        self.port = port or free_port(host)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def _argv(self, binary: str) -> list[str]:
        return [
            binary, "--port", str(self.port), "--bind", self.host, "--save", "",
            "--appendonly", "no", "--dir", str(self.data_dir), "--protected-mode", "no",
        ]

    def _ready(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False


class EtcdServer(_ChildService):
    """A single-member etcd child listening on free loopback ports."""

    name = "etcd"
    apt_package = "etcd-server"

    def __init__(
        self,
        binary: str,
        data_dir: Path,
        host: str = "127.0.0.1",
        client_port: int | None = None,
        peer_port: int | None = None,
    ):
        super().__init__(binary, data_dir, host)
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port(host)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    def _argv(self, binary: str) -> list[str]:
        peer = f"http://{self.host}:{self.peer_port}"
        return [
            binary,
            "--name", "onepiece",
            "--data-dir", str(self.data_dir / "etcd-data"),
            "--listen-client-urls", self.url,
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"onepiece={peer}",
            "--log-level", "warn",
        ]

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=0.5) as r:
                return b'"health":"true"' in r.read()
        except (urllib.error.URLError, OSError):
            return False
