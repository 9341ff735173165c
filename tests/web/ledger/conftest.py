"""The ledger's real processes: PostgreSQL, and the web platform plus the reconciler as ``onepiece up``
starts them (uvicorn serving the ASGI app; ``manage.py reconcile``), over a real engine.

PostgreSQL is Debian's (``postgresql``), started by :class:`PostgresServer` in a
temporary folder on a free loopback port, as redis and etcd are; it refuses to
run as root, so the server runs as the ``postgres`` system user the package
creates.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.embedded import free_port
from tests.conftest import REPO_ROOT

PG_USER = "postgres"


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if not found:
        pytest.fail("PostgreSQL is not installed: install the Debian package 'postgresql' (./quickstart does)")
    return found[-1]


class PostgresServer:
    """initdb + postgres on 127.0.0.1:<free port>, trust authentication, one database ``onepiece``."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="onepiece-pg-"))
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self._as: dict[str, Any] = {}
        if os.geteuid() == 0:  # postgres refuses root; its package's system user runs it
            pw = pwd.getpwnam(PG_USER)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
            self._as = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}

    def _run(self, *argv: str) -> None:
        subprocess.run(argv, check=True, capture_output=True, **self._as)

    def start(self) -> PostgresServer:
        data = self.dir / "data"
        self._run(_pg_bin("initdb"), "-D", str(data), "-U", PG_USER, "--auth=trust", "-E", "UTF8", "--no-sync")
        log = open(self.dir / "postgres.log", "ab")
        self.proc = subprocess.Popen(
            [_pg_bin("postgres"), "-D", str(data), "-p", str(self.port), "-k", str(self.dir),
             "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off", "-c", "full_page_writes=off",
             "-c", "max_connections=200"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, **self._as)
        log.close()
        import psycopg

        deadline = time.monotonic() + 60
        while True:
            try:
                with psycopg.connect(self.dsn("postgres"), autocommit=True) as conn:
                    conn.execute("CREATE DATABASE onepiece")
                return self
            except psycopg.OperationalError:
                assert self.proc.poll() is None, (self.dir / "postgres.log").read_text()
                assert time.monotonic() < deadline, "postgres did not start"
                time.sleep(0.2)

    def dsn(self, db: str = "onepiece") -> str:
        return f"host=127.0.0.1 port={self.port} user={PG_USER} dbname={db}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # fast shutdown
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def postgres_server() -> Iterator[PostgresServer]:
    server = PostgresServer().start()
    try:
        yield server
    finally:
        server.stop()


class Platform:
    """The web process and the reconciler over one database, started as ``onepiece up`` starts them."""

    def __init__(self, state: Path, env: dict[str, str]) -> None:
        self.state, self.env = state, env
        self.manage = [sys.executable, str(REPO_ROOT / "manage.py")]
        self.web: subprocess.Popen[bytes] | None = None
        self.reconciler: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.logs = state / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)

    def run_manage(self, *args: str, stdin: str | None = None) -> str:
        return subprocess.run([*self.manage, *args], env=self.env, cwd=REPO_ROOT, check=True, capture_output=True,
                              text=True, input=stdin).stdout

    def start_web(self) -> None:
        port = free_port()
        with open(self.logs / "web.log", "ab") as log:
            self.web = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "onepiece_platform.asgi:application", "--host", "127.0.0.1",
                 "--port", str(port), "--log-level", "warning"],
                env=self.env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=5) as r:
                    if json.loads(r.read()).get("checks", {}).get("database") == "ok":
                        return
            except OSError:
                pass
            assert self.web.poll() is None, (self.logs / "web.log").read_text()
            assert time.monotonic() < deadline, "the web process did not become ready"
            time.sleep(0.2)

    def start_reconciler(self, extra_env: dict[str, str] | None = None) -> None:
        with open(self.logs / "reconciler.log", "ab") as log:
            self.reconciler = subprocess.Popen([*self.manage, "reconcile", "--sweep-every", "2"],
                                               env={**self.env, **(extra_env or {})},
                                               cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, start_new_session=True)

    def kill_reconciler(self) -> None:
        assert self.reconciler is not None and self.reconciler.poll() is None, self.log_text()
        self.reconciler.send_signal(signal.SIGKILL)
        self.reconciler.wait(10)

    def log_text(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.logs.glob("*.log")))

    def stop(self) -> None:
        for p in (self.reconciler, self.web):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(10)
