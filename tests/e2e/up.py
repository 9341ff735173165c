"""``onepiece up`` as a user starts it, for the tests that drive the whole system (e2e, abuse, load)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def start_up(state: Path, *args: str, timeout: float = 400,
             env_extra: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], dict[str, str]]:
    """Start ``onepiece up`` (free ports, small rings, no inherited ``ONEPIECE_*``/``DJANGO_*`` settings but
    ``env_extra``) and return it with the ``name: value`` lines it printed, once it says ``ready``. The caller
    stops it with :func:`stop_up` (in a ``finally``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ONEPIECE_", "DJANGO_"))}
    env.update(env_extra or {})
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "onepiece"), "up", "--state-dir", str(state), "--web-port", "0",
         "--proxy-port", "0", "--ring-bytes", str(16 << 20), *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: dict[str, str] = {}
    deadline = time.monotonic() + timeout  # a first run builds the tiny models and starts every stage worker
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            if ": " in line:
                k, v = line.rstrip("\n").split(": ", 1)
                lines[k] = v
            if line.startswith("ready"):
                break
            assert time.monotonic() < deadline, "onepiece up took too long"
        assert "web" in lines, lines
    except BaseException:
        stop_up(proc)
        raise
    return proc, lines


def stop_up(proc: subprocess.Popen[str], timeout: float = 120) -> str:
    """Ctrl-C, as a user stops it; returns what it printed after ``ready``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out or ""


def call(lines: dict[str, str], method: str, path: str, body: dict[str, Any] | None = None,
         timeout: float = 60) -> tuple[int, Any]:
    """(status, body) of a request to the web platform ``onepiece up`` printed (``lines``: its ``web`` URL and
    ``api key``): JSON answers decoded, others as bytes."""
    req = urllib.request.Request(lines["web"] + path, method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {lines['api key']}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, ctype = r.read(), r.headers.get("Content-Type", "")
            return r.status, json.loads(raw) if ctype.startswith("application/json") else raw
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
