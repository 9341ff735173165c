"""``onepiece up``: the whole system on one machine with embedded defaults.

Starts (unless URLs are configured) a redis-server and an etcd on free loopback
ports, prepares the SQLite ledger, and serves the web platform; prints where
everything listens; on Ctrl-C (or SIGTERM) stops every child it started.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from engine import envs
from engine.embedded import EtcdServer, RedisServer, ServiceError, free_port

REPO_ROOT = Path(__file__).resolve().parents[1]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", type=Path, default=None, help="where data, models and logs go (default: .onepiece)")
    p.add_argument("--host", default=None, help="address to bind (default: 127.0.0.1)")
    p.add_argument("--web-port", type=int, default=8000, help="web platform port (a free one if taken)")
    p.add_argument(
        "--exit-after-ready",
        action="store_true",
        help="start everything, print the addresses, then shut down (a smoke test)",
    )


def _say(line: str) -> None:
    print(line, flush=True)


def _port_or_free(host: str, port: int) -> int:
    import socket

    if port == 0:
        return free_port(host)
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return port
        except OSError:
            return free_port(host)


def _wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServiceError(f"web platform exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise ServiceError(f"web platform not ready at {url} within {timeout}s")


def run(args: argparse.Namespace) -> int:
    state = (args.state_dir or envs.STATE_DIR).resolve()
    host = args.host or envs.BIND_HOST
    state.mkdir(parents=True, exist_ok=True)
    logs = state / "logs"
    logs.mkdir(exist_ok=True)

    stop = {"flag": False}

    def _on_signal(signum: int, frame: object) -> None:
        stop["flag"] = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)

    with ExitStack() as stack:
        try:
            redis_url = envs.REDIS_URL
            if not redis_url:
                r = RedisServer(envs.REDIS_SERVER_BIN, state / "redis", host).start()
                stack.callback(r.stop)
                redis_url = r.url
            _say(f"redis: {redis_url}")
            etcd_url = envs.ETCD_URL
            if not etcd_url:
                e = EtcdServer(envs.ETCD_BIN, state / "etcd", host).start()
                stack.callback(e.stop)
                etcd_url = e.url
            _say(f"etcd: {etcd_url}")

            env = dict(os.environ)
            env.update(
                ONEPIECE_STATE_DIR=str(state),
                ONEPIECE_REDIS_URL=redis_url,
                ONEPIECE_ETCD_URL=etcd_url,
                DJANGO_SETTINGS_MODULE="onepiece_platform.settings.local",
                PYTHONPATH=os.pathsep.join([str(REPO_ROOT / "platform"), env.get("PYTHONPATH", "")]),
            )
            manage = [sys.executable, str(REPO_ROOT / "manage.py")]
            subprocess.run([*manage, "migrate", "--noinput", "-v", "0"], env=env, check=True, cwd=REPO_ROOT)
            admin_user, admin_password = _ensure_admin(manage, env, state)

            port = _port_or_free(host, args.web_port)
            web_log = open(logs / "web.log", "ab")
            web = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "onepiece_platform.asgi:application",
                 "--host", host, "--port", str(port), "--log-level", "warning"],
                env=env, cwd=REPO_ROOT, stdout=web_log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
            )
            web_log.close()
            stack.callback(_terminate, web)
            base = f"http://{host}:{port}"
            _wait_http(base + "/livez", 60, web)
        except (ServiceError, subprocess.CalledProcessError) as exc:
            _say(f"error: {exc}")
            return 1

        _say(f"web: {base}/")
        _say(f"admin: {base}/admin/ (user {admin_user}, password {admin_password})")
        _say(f"health: {base}/livez {base}/readyz")
        _say(f"state: {state}")
        _say("ready (Ctrl-C stops everything)")
        if args.exit_after_ready:
            return 0
        while not stop["flag"]:
            if web.poll() is not None:
                _say(f"error: web platform exited with {web.returncode}; see {logs / 'web.log'}")
                return 1
            time.sleep(0.2)
        _say("stopping")
    _say("stopped")
    return 0


def _terminate(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout)


def _ensure_admin(manage: list[str], env: dict[str, str], state: Path) -> tuple[str, str]:
    """Create the local staff user once; its password is kept in the state dir (mode 0600)."""
    pw_file = state / "admin-password"
    if pw_file.exists():
        password = pw_file.read_text().strip()
    else:
        password = secrets.token_urlsafe(12)
        pw_file.write_text(password + "\n")
        pw_file.chmod(0o600)
    code = (
        "from django.contrib.auth import get_user_model;"
        "U=get_user_model();"
        "u,_=U.objects.get_or_create(username='admin', defaults={'is_staff':True,'is_superuser':True});"
        f"u.set_password({password!r});u.is_staff=True;u.is_superuser=True;u.save()"
    )
    subprocess.run([*manage, "shell", "-c", code], env=env, check=True, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
    return "admin", password
