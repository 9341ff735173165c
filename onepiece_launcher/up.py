"""``onepiece up``: the whole system on one machine with embedded defaults.

Starts (unless URLs are configured) a redis-server and an etcd on free loopback
ports, prepares the SQLite ledger, serves the web platform, builds the tiny
models on first run (into the state dir), and runs the engine: a TaskManager
(``onepiece node``) with one instance per stage of every workflow under a
static assignment, the Proxy (``onepiece proxy``), then a Node Manager
(``onepiece manager``) that takes the assignment over. Secrets (the web
platform's SECRET_KEY, the Proxy's shared secret, Redis's password) are
generated once into ``<state>/secrets/`` (0600); everything under the state
folder is private to the user; DEBUG stays off unless ``--debug``. Prints
where everything listens; on Ctrl-C (or SIGTERM)
stops every child it started, the engine first, so no worker process or
shared-memory ring is left behind.
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
from typing import TYPE_CHECKING

from engine import envs
from engine.coord import redact
from engine.embedded import EtcdServer, RedisServer, ServiceError, children, free_port
from engine.embedded.credentials import secret
from engine.embedded.statelock import StateLock
from engine.embedded.supervisor import STATUS_FILE, Child, Supervisor

if TYPE_CHECKING:
    from engine.embedded.s3 import SwiftS3Server

REPO_ROOT = Path(__file__).resolve().parents[1]
# where outputs go when neither --object-store nor ONEPIECE_OBJECT_STORE says: the embedded S3 server, so the
# default exercises the production path (outputs outlive Redis)
DEFAULT_OBJECT_STORE = "embedded"


# How every deployment runs the web platform's server (deploy/ repeats these flags; a test compares):
# uvicorn reads no X-Forwarded-For (by default it believes the header from 127.0.0.1, so a client on this
# host, or behind any local reverse proxy, could name itself any address and walk past the failed-
# authentication lockout). The platform reads the header itself, trusting only ONEPIECE_TRUSTED_PROXY_HOPS
# hops (onepiece_platform.accounts.authentication.client_address; X-Forwarded-Proto: the production
# settings' SECURE_PROXY_SSL_HEADER). --http: uvicorn's httptools protocol with a deadline on each request's
# head (uvicorn has none: a client trickling headers held a connection as long as it liked) and prompt
# answers to websocket upgrades the websockets library cannot parse (onepiece_platform/ops/httpguard.py).
WEB_APP = "onepiece_platform.asgi:application"
WEB_SERVER_FLAGS = ("--no-proxy-headers", "--http", "onepiece_platform.ops.httpguard:GuardedHttpToolsProtocol")


def web_command(host: str, port: int) -> list[str]:
    """The web platform's server as ``onepiece up`` starts it (and the tests that check it do)."""
    return [sys.executable, "-m", "uvicorn", WEB_APP, "--host", host, "--port", str(port), *WEB_SERVER_FLAGS,
            "--log-level", "warning"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state-dir", type=Path, default=None, help="where data, models and logs go (default: .onepiece)")
    p.add_argument("--host", default=None, help="address to bind (default: 127.0.0.1)")
    p.add_argument("--web-port", type=int, default=8000, help="web platform port (a free one if taken)")
    p.add_argument("--proxy-port", type=int, default=None,
                   help="engine Proxy port (default: ONEPIECE_PROXY_PORT; a free one if taken)")
    p.add_argument("--models", type=Path, default=None,
                   help="folder with one model folder per workflow (default: tiny models built in the state dir)")
    p.add_argument("--workflows", default=None, metavar="NAME[,NAME...]",
                   help="serve these workflows, or all (default: sd-t2i and the Wan2.1 pair on tiny models, every "
                   "workflow with a folder under --models); each workflow "
                   "costs one worker process per stage, each ~430 MB and seconds of imports")
    p.add_argument("--ring-bytes", type=int, default=None, help="buffer bytes per stage inbox ring")
    p.add_argument("--spare-slots", type=int, default=None, metavar="N",
                   help="instance slots beyond one per stage pool, for the Node Manager to give to bottleneck stages "
                   "(shared among the workflows by weight; each is one more worker process when used; default: "
                   "on a host without a GPU, its usable cores minus one, so that the bottleneck stage can use "
                   "every core; with a GPU, 0)")
    p.add_argument("--threads-per-instance", default=None, metavar="N|auto",
                   help="CPU threads per stage instance (default: ONEPIECE_THREADS_PER_INSTANCE or auto: the "
                   "host's cores shared among the instances)")
    p.add_argument("--object-store", default=None, metavar="embedded|URL|none",
                   help="where final outputs go: 'embedded' starts an S3 server (OpenStack Swift with s3api) on "
                   "loopback with its data in the state folder; an S3 URL with the bucket "
                   "(http://HOST:PORT/BUCKET, s3://BUCKET; see docs/operations.md) uses that store; 'none' keeps "
                   "the bytes in Redis (default: ONEPIECE_OBJECT_STORE, else embedded)")
    p.add_argument("--debug", action="store_true",
                   help="run the web platform with Django's DEBUG on (error pages show settings and service "
                   "URLs: never where others can reach it)")
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


def _wait_http(url: str, timeout: float, proc: subprocess.Popen[bytes], name: str = "web platform") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServiceError(f"{name} exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise ServiceError(f"{name} not ready at {url} within {timeout}s")


def run(args: argparse.Namespace) -> int:
    state = (args.state_dir or envs.STATE_DIR).resolve()
    host = args.host or envs.BIND_HOST
    # everything written under the state folder (ledger, logs, secrets, Redis and etcd data) by us and our
    # children is private to this user
    os.umask(0o077)
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    state.chmod(0o700)
    logs = state / "logs"
    logs.mkdir(exist_ok=True)

    stop = _stop_on_signals()
    with ExitStack() as stack:
        try:
            # one onepiece up per state folder: a second is refused at once, naming the first
            lock = stack.enter_context(StateLock(state))
            # every child holds the lock too, and gets SIGTERM if this process dies (engine/embedded/children.py)
            children.hold_in_children(lock.fd)
            stack.callback(children.hold_in_children, None)
            # every child is restarted with backoff when it exits (engine/embedded/supervisor.py)
            sup = Supervisor(state, _say)
            stack.callback(sup.forget_status)
            env = _child_env(args, state, host, *_start_services(stack, sup, state, host))
            env["ONEPIECE_OBJECT_STORE"] = _start_object_store(args.object_store, stack, sup, state, host)
            env.update(_public_store_env(args.object_store, env["ONEPIECE_OBJECT_STORE"]))
            manage = [sys.executable, str(REPO_ROOT / "manage.py")]
            subprocess.run([*manage, "migrate", "--noinput", "-v", "0"], env=env, check=True, cwd=REPO_ROOT)
            for db_file in state.glob("db.sqlite3*"):  # made by an earlier version with the default umask
                db_file.chmod(0o600)
            admin_user, admin_password = _ensure_admin(manage, env, state)
            # the web platform reaches the engine through the Proxy: fix its port before either starts
            args.proxy_port = _port_or_free(host, envs.PROXY_PORT if args.proxy_port is None else args.proxy_port)
            env["ONEPIECE_PROXY_URL"] = f"http://{host}:{args.proxy_port}"
            api_key_line = subprocess.run([*manage, "ensure_demo_user"], env=env, check=True, cwd=REPO_ROOT,
                                          capture_output=True, text=True).stdout.strip().splitlines()[-1]

            port = _port_or_free(host, args.web_port)
            web = _spawn(sup, stack, "web", web_command(host, port), env, logs / "web.log")
            base = f"http://{host}:{port}"
            _wait_http(base + "/livez", 60, web.proc)
            proxy_url, instances = _start_engine(args, stack, sup, env, state, host, logs)
            # moves ledger rows along the engine's event stream (and submits again jobs lost with Redis)
            _spawn(sup, stack, "reconciler", [*manage, "reconcile"], env, logs / "reconciler.log")
            # sends the completion webhooks from the ledger's outbox (retries for up to 24 h)
            _spawn(sup, stack, "webhooks", [*manage, "deliver_webhooks"], env, logs / "webhooks.log")
        except (ServiceError, subprocess.CalledProcessError) as exc:
            _say(f"error: {exc}")
            return 1

        _say_ready(base, admin_user, admin_password, api_key_line, proxy_url, instances, sup, state)
        if args.exit_after_ready:
            return 0
        sup.run(lambda: stop["flag"])
        _say("stopping")
    _say("stopped")
    return 0


def _stop_on_signals() -> dict[str, bool]:
    """``{"flag": ...}``, set by Ctrl-C or SIGTERM: the supervisor's loop ends and everything is stopped."""
    stop = {"flag": False}

    def _on_signal(signum: int, frame: object) -> None:
        stop["flag"] = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    return stop


def _start_services(stack: ExitStack, sup: Supervisor, state: Path, host: str) -> tuple[str, str]:
    """(Redis URL, etcd URL): the configured ones, else a redis-server and an etcd of our own, supervised
    (a restarted Redis is empty: the platform submits its jobs in flight again; etcd keeps its data)."""
    keep = state / "secrets"
    redis_url = envs.REDIS_URL
    if not redis_url:
        r = RedisServer(envs.REDIS_SERVER_BIN, state / "redis", host, password=secret(keep, "redis-password")).start()
        stack.callback(r.stop)
        sup.watch(_service_child("redis", r))
        redis_url = r.url
    _say(f"redis: {redact(redis_url)}")
    etcd_url = envs.ETCD_URL
    if not etcd_url:
        # authentication on: only holders of the engine user's password read or write its keys
        e = EtcdServer(envs.ETCD_BIN, state / "etcd", host, password=secret(keep, "etcd-password"),
                       root_password=secret(keep, "etcd-root-password")).start()
        stack.callback(e.stop)
        sup.watch(_service_child("etcd", e))
        etcd_url = e.url
    _say(f"etcd: {redact(etcd_url)}")
    return redis_url, etcd_url


def _start_object_store(choice: str | None, stack: ExitStack, sup: Supervisor, state: Path, host: str) -> str:
    """The ``ONEPIECE_OBJECT_STORE`` every child gets: ``none`` (outputs in Redis), the URL given, or the URL of
    an embedded Swift s3api server of our own (``embedded``), supervised like Redis (its data and its
    generated secret in the state folder, so outputs and presigned URLs outlive a restart)."""
    from engine.store.objects import ObjectStore, ObjectStoreError, parse_url

    choice = (choice or envs.OBJECT_STORE or DEFAULT_OBJECT_STORE).strip()
    if choice.lower() == "none":
        _say("object store: none (outputs in Redis)")
        return "none"
    if choice.lower() == "embedded":
        from engine.embedded.s3 import SwiftS3Server

        s3 = SwiftS3Server(state / "s3", host).start()
        stack.callback(s3.stop)
        sup.watch(_service_child("s3", s3))
        choice = s3.url
    else:
        try:
            config = parse_url(choice)
        except ValueError as exc:
            raise ServiceError(f"--object-store: {exc}") from exc
        store = ObjectStore(config, connect_timeout=3.0)
        try:
            store.ensure_bucket()  # reachable, the credentials work, the bucket is there (made when missing)
        except ObjectStoreError as exc:
            raise ServiceError(f"--object-store: {exc}") from exc
        finally:
            store.close()
    _say(f"object store: {parse_url(choice).redacted()}")
    return choice


def _public_store_env(choice: str | None, url: str) -> dict[str, str]:
    """``ONEPIECE_OBJECT_STORE_PUBLIC_URL`` for the web platform when nothing set it: the embedded store's
    endpoint when it listens on loopback (reachable by clients on this machine: result URLs are presigned GETs
    from it), else nothing (the platform's own signed URLs)."""
    import ipaddress
    from urllib.parse import urlsplit

    from engine.store.objects import parse_url

    embedded = (choice or envs.OBJECT_STORE or DEFAULT_OBJECT_STORE).strip().lower() == "embedded"
    if envs.OBJECT_STORE_PUBLIC_URL is not None or not embedded:
        return {}
    endpoint = parse_url(url).endpoint or ""
    try:
        loopback = ipaddress.ip_address(urlsplit(endpoint).hostname or "").is_loopback
    except ValueError:
        loopback = False
    return {"ONEPIECE_OBJECT_STORE_PUBLIC_URL": endpoint} if loopback else {}


def _service_child(name: str, service: RedisServer | EtcdServer | SwiftS3Server) -> Child:
    """A started embedded service as a supervised child: restarted through its own ``start`` (same ports,
    same password, ready before it counts as started)."""
    def start() -> subprocess.Popen[bytes]:
        proc = service.start().proc
        assert proc is not None  # start() returns a running server or raises
        return proc

    assert service.proc is not None
    return Child(name, start, service.proc, service.log_path)


def _child_env(args: argparse.Namespace, state: Path, host: str, redis_url: str, etcd_url: str) -> dict[str, str]:
    keep = state / "secrets"
    env = dict(os.environ)
    env.update(
        ONEPIECE_STATE_DIR=str(state),
        ONEPIECE_REDIS_URL=redis_url,
        ONEPIECE_ETCD_URL=etcd_url,
        # the supervisor's view of every child, which /readyz and the dashboard show
        ONEPIECE_SUPERVISOR_STATUS=str(state / STATUS_FILE),
        DJANGO_SETTINGS_MODULE="onepiece_platform.settings.local",
        PYTHONPATH=os.pathsep.join([str(REPO_ROOT / "platform"), env.get("PYTHONPATH", "")]),
        # generated once per state folder (0600), never a constant: signed URLs and sessions cannot
        # be forged with a key from the source, and the Proxy only serves holders of its secret
        DJANGO_SECRET_KEY=secret(keep, "django-secret-key", 50),
        ONEPIECE_PROXY_TOKEN=envs.PROXY_TOKEN or secret(keep, "proxy-token"),
        ONEPIECE_DEBUG="1" if args.debug else "",
    )
    if host not in ("127.0.0.1", "localhost", "::1", "0.0.0.0", "::"):
        env["DJANGO_ALLOWED_HOSTS"] = env.get("DJANGO_ALLOWED_HOSTS", "localhost,127.0.0.1,[::1]") + "," + host
    return env


def _spawn(sup: Supervisor, stack: ExitStack, name: str, argv: list[str], env: dict[str, str], log: Path,
           stop_timeout: float = 10.0) -> Child:
    """Start ``argv`` (output appended to ``log``), supervised by ``sup`` (its ticks begin once everything is
    ready: a child that dies while ``onepiece up`` starts fails the start), stopped when ``stack`` closes."""
    def start() -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            return children.popen(argv, env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)

    child = sup.watch(Child(name, start, start(), log, stop_timeout))
    stack.callback(child.terminate)
    return child


def _say_ready(base: str, admin_user: str, admin_password: str, api_key_line: str, proxy_url: str,
               instances: int, sup: Supervisor, state: Path) -> None:
    logs = state / "logs"
    _say(f"web: {base}/")
    _say(f"admin: {base}/admin/ (user {admin_user}, password {admin_password})")
    _say(f"health: {base}/livez {base}/readyz")
    _say(f"api: {base}/v1")
    _say(api_key_line)
    _say(f"proxy: {proxy_url}")
    _say(f"workers: {instances} stage instances ready (logs: {logs / 'node' / 'logs'})")
    _say(f"manager: leading, rebalancing every 2 s (log: {logs / 'manager.log'})")
    _say(f"supervisor: {', '.join(sup.children)} restarted when they exit (log: {sup.log_path})")
    _say(f"state: {state}")
    _say("ready (Ctrl-C stops everything)")


def _ensure_admin(manage: list[str], env: dict[str, str], state: Path) -> tuple[str, str]:
    """Create the local staff user once; its password is kept in the state dir (mode 0600)."""
    pw_file = state / "admin-password"
    if pw_file.exists():
        password = pw_file.read_text().strip()
    else:
        password = secrets.token_urlsafe(12)
        fd = os.open(pw_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password + "\n")
    pw_file.chmod(0o600)
    # on stdin, never on a command line (visible to every user of the host in ps)
    subprocess.run([*manage, "ensure_admin", "--username", "admin"], input=password + "\n", text=True, env=env,
                   check=True, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
    return "admin", password




# What `onepiece up` serves on its own tiny models without --workflows: the first workflows, which every
# test and demo uses. Each workflow costs worker processes (~430 MB each) on a small machine; the others
# (make-tiny builds them on demand) are one flag away: --workflows NAME,... or --workflows all.
DEFAULT_WORKFLOWS = ("sd-t2i", "wan2.1-i2v", "wan2.1-t2v")


def _wanted(args: argparse.Namespace) -> list[str] | None:
    """The workflows --workflows names (every known one for ``all``); None without the flag."""
    from engine.workflow import workflows

    text = (getattr(args, "workflows", None) or "").strip()
    if not text:
        return None
    if text == "all":
        return sorted(workflows())
    wanted = [w.strip() for w in text.split(",") if w.strip()]
    unknown = [w for w in wanted if w not in workflows()]
    if unknown:
        raise ServiceError(f"--workflows: unknown workflow {', '.join(unknown)} (known: {', '.join(sorted(workflows()))})")
    return wanted


def _ensure_models(args: argparse.Namespace, env: dict[str, str], state: Path) -> dict[str, str]:
    """workflow -> model folder; builds the tiny models it serves once (with progress bars) when none are given.

    The build goes to a scratch folder renamed into place, so an interrupted
    first run never leaves a half-written model behind.
    """
    from engine.workflow import workflows

    root = (args.models or state / "models").resolve()
    wanted = _wanted(args)
    if args.models is None:
        from engine.stages.tiny import BUILDERS

        serve = wanted if wanted is not None else list(DEFAULT_WORKFLOWS)
        missing = [w for w in serve if w in BUILDERS and not (root / w / "model_index.json").exists()]
        if missing:
            _say(f"building tiny models ({', '.join(missing)}) into {root} (first run only)")
            scratch = state / f"models.tmp-{os.getpid()}"
            for w in missing:
                subprocess.run([sys.executable, "-m", "engine.cli", "models", "make-tiny", "--workflow", w,
                                "--out", str(scratch / w)], env=env, check=True, cwd=REPO_ROOT,
                               stdout=subprocess.DEVNULL)
            root.mkdir(parents=True, exist_ok=True)
            for folder in scratch.iterdir():
                if not (root / folder.name).exists():
                    folder.rename(root / folder.name)
            import shutil

            from engine.workflow.pools import link_identical

            shutil.rmtree(scratch, ignore_errors=True)
            link_identical(root)  # what the workflows share (same bytes, e.g. the Wan2.1 pair's umT5) once on disk
    found = {w: str(root / w) for w in workflows() if (root / w / "model_index.json").exists()}
    if args.models is None:  # tiny models of an earlier run: their serving defaults, if they predate them
        from engine.stages.tiny import ensure_serving

        for w, folder in found.items():
            ensure_serving(Path(folder), w)
    if wanted is None and args.models is None:
        wanted = [w for w in DEFAULT_WORKFLOWS if w in found]
    if wanted is not None:
        unknown = [w for w in wanted if w not in found]
        if unknown:
            raise ServiceError(f"--workflows: no model folder for {', '.join(unknown)} under {root} "
                               f"(have: {', '.join(sorted(found))})")
        found = {w: found[w] for w in wanted}
    if not found:
        raise ServiceError(f"no model folder for any workflow under {root}")
    return found


def _start_engine(args: argparse.Namespace, stack: ExitStack, sup: Supervisor, env: dict[str, str], state: Path,
                  host: str, logs: Path) -> tuple[str, int]:
    """Start ``onepiece node`` (static assignment) and ``onepiece proxy``, wait until every instance serves,
    then start ``onepiece manager`` and wait until it leads."""
    from engine.coord import etcd_client
    from engine.coord.keys import Keyspace, read_prefix
    from engine.worker.config import default_assignment

    models = _ensure_models(args, env, state)
    assignment = default_assignment(models)
    node_dir = logs / "node"
    node_dir.mkdir(exist_ok=True)
    (node_dir / "assignment.json").write_text(assignment.to_json())
    cli = [sys.executable, "-m", "engine.cli"]
    procs: dict[str, subprocess.Popen[bytes]] = {}  # as first started: what the start waits on
    node_cmd = [*cli, "node", "--node", "local", "--run-dir", str(node_dir), "--assignment",
                str(node_dir / "assignment.json"), "--ring-prefix", f"up-{os.getpid()}-"]
    if args.ring_bytes:
        node_cmd += ["--ring-bytes", str(args.ring_bytes)]
    if args.threads_per_instance:
        node_cmd += ["--threads-per-instance", str(args.threads_per_instance)]
    proxy_port = _port_or_free(host, envs.PROXY_PORT if args.proxy_port is None else args.proxy_port)
    proxy_cmd = [*cli, "proxy", "--host", host, "--port", str(proxy_port)]
    for name, cmd in (("node", node_cmd), ("proxy", proxy_cmd)):
        # the node needs time to stop its workers (they finish the request at hand)
        procs[name] = _spawn(sup, stack, name, cmd, env, logs / f"{name}.log", 30.0).proc
    proxy_url = f"http://{host}:{proxy_port}"
    _wait_http(proxy_url + "/livez", 60, procs["proxy"], "proxy")
    etcd = etcd_client(env["ONEPIECE_ETCD_URL"])
    keys = Keyspace.from_env()
    want = {i.id for i in assignment.instances}
    deadline = time.monotonic() + 600
    while True:
        published = {name.rsplit("/", 1)[1] for name in read_prefix(etcd, keys.routes())}
        if want <= published and _proxy_sees_routes(proxy_url, set(models)):
            break
        if procs["node"].poll() is not None:
            raise ServiceError(f"node exited with {procs['node'].returncode}; see {logs / 'node.log'}")
        if time.monotonic() > deadline:
            raise ServiceError(f"stage workers not ready: {sorted(want - published)}; see {node_dir / 'logs'}")
        time.sleep(0.25)
    # The Node Manager takes over from the static assignment (keeping its instances: one node, one slot per
    # instance) and from then on measures stage times, rebalances, applies operators' actions and feeds the
    # Proxy's admission control with the measured capacity.
    manager_cmd = [*cli, "manager", "--name", "local-manager", "--slots-per-node", str(len(want) + spare_slots(args.spare_slots)),
                   *(a for wf, folder in sorted(models.items()) for a in ("--workflow", f"{wf}={folder}"))]
    procs["manager"] = _spawn(sup, stack, "manager", manager_cmd, env, logs / "manager.log", 15.0).proc
    while not etcd.get(keys.leader()):
        if procs["manager"].poll() is not None:
            raise ServiceError(f"manager exited with {procs['manager'].returncode}; see {logs / 'manager.log'}")
        if time.monotonic() > deadline:
            raise ServiceError(f"the Node Manager did not take the lead; see {logs / 'manager.log'}")
        time.sleep(0.1)
    return proxy_url, len(want)


def spare_slots(explicit: int | None) -> int:
    """Instance slots beyond one per stage pool. Default on a host without a GPU: its usable cores minus one.
    Every instance there has a budget of one thread when the instances outnumber the cores, so with one slot
    per pool the bottleneck stage runs on one core while the others idle (measured, sd-t2i on 2 cores: the
    stage workers kept 1.18 of 2 cores busy at saturation); the spare slots let the Node Manager give that
    stage an instance per remaining core. With a GPU the stages share the device, and the slots stay 0."""
    from engine.worker.threads import is_cuda, usable_cores

    if explicit is not None:
        return max(0, explicit)
    return 0 if is_cuda(None) else max(0, usable_cores() - 1)


def _proxy_sees_routes(proxy_url: str, served: set[str]) -> bool:
    """Whether the Proxy's own route cache has the first stage of every workflow in ``served`` (it refreshes
    on its own clock); a known workflow without a model folder is not served and has no route."""
    import json

    try:
        with urllib.request.urlopen(proxy_url + "/readyz", timeout=2) as r:
            checks = json.loads(r.read())["checks"]
    except (OSError, ValueError, KeyError):
        return False
    return all(checks.get(f"routes:{w}") == "ok" for w in served)
