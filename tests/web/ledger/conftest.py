"""The ledger's real processes: PostgreSQL, and the web platform plus the reconciler as ``onepiece up``
starts them (uvicorn serving the ASGI app; ``manage.py reconcile``), over a real engine.

PostgreSQL is the ``postgres_server`` plugin (tests.fixtures.postgres).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from engine import procs
from engine.embedded import free_port
from tests.fixtures import REPO_ROOT


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
            if p is not None:
                procs.stop(p, timeout=20)
