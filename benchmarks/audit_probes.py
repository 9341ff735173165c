"""A live re-run of the audit's broken probes (issue 39, "Right answers at every door") against a freshly
started ``onepiece up``, through its public doors, with real clients (requests, the ``openai`` SDK, the
``onepiece`` CLI).

    python benchmarks/audit_probes.py [--out FILE] [--keep-state]

The audit found 36 probes broken, in seven findings and four interop items. Each is re-sent here as the
auditor sent it, and judged by what a client must get: a typed 4xx where the input is bad, the option the
client asked for recorded on the job, a 503 with Retry-After before any byte of a response while Redis is
down, one ``error:`` line from the CLI. One line per probe (``held`` or ``BROKEN``, and what came back), a
total, and JSON (``--out``, default ``benchmarks/audit/<date>.json``) with provenance. Exit status 1 when any
probe is broken.

The set-up is the operator's: ``onepiece up`` on tiny models in a temporary state folder; a staff user whose
priority tier an operator set to low (made with ``manage.py shell``, as an operator would script it);
``onepiece adapters add`` for the adapter. Redis is taken down by stopping the launcher (SIGSTOP, so its
supervisor does not restart Redis at once) and killing redis-server; both come back afterwards, and a last
job checks that the deployment still serves.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.bench.figures import provenance  # noqa: E402
from tests.e2e.up import start_up, stop_up  # noqa: E402
from tests.engine.adapters.test_malformed import MALFORMED  # noqa: E402

DEEP = "[" * 1999 + "]" * 1999  # a lora nested ~2000 deep, 3,998 characters (finding 1)
SD = {"prompt": "a cat", "height": 64, "width": 64, "num_inference_steps": 2}
VIDEO = {"prompt": "a wave", "model": "wan2.1-t2v", "size": "64x64"}
IMAGE = {"prompt": "a cat", "size": "64x64"}
LOW_PASSWORD = "an-auditor-password-of-some-length"


class Web:
    """A client of the web platform: one session (cookies kept), paths under its base URL."""

    def __init__(self, base: str, headers: dict[str, str], follow: bool = True) -> None:
        self.session = requests.Session()
        self.session.headers.update(headers)
        self.base, self.follow = base.rstrip("/"), follow
        self.headers, self.cookies = self.session.headers, self.session.cookies

    def get(self, path: str, **kw: Any) -> requests.Response:
        return self.session.get(self.base + path, allow_redirects=self.follow, timeout=120, **kw)

    def post(self, path: str, **kw: Any) -> requests.Response:
        return self.session.post(self.base + path, allow_redirects=self.follow, timeout=120, **kw)

    def __enter__(self) -> Web:
        return self

    def __exit__(self, *exc: object) -> None:
        self.session.close()


@dataclass
class Live:
    """The deployment under audit and the credentials the probes use."""

    proc: subprocess.Popen[str]
    lines: dict[str, str]
    state: Path
    web: str = ""
    key: str = ""  # the quick start's key (normal tier)
    low_key: str = ""  # the low-tier staff user's key
    results: list[dict[str, Any]] = field(default_factory=list)

    def client(self, key: str | None = None, follow_redirects: bool = True) -> Web:
        return Web(self.web, {"Authorization": f"Bearer {key}"} if key else {}, follow_redirects)

    def probe(self, finding: str, name: str, check: Callable[[], tuple[bool, str]]) -> None:
        try:
            held, detail = check()
        except Exception as exc:  # a probe that cannot even be judged is broken, with what went wrong
            held, detail = False, f"{type(exc).__name__}: {exc}"[:300]
        self.results.append({"finding": finding, "probe": name, "held": held, "detail": detail})
        print(f"{'held  ' if held else 'BROKEN'} [{finding}] {name}: {detail}", flush=True)


def _status(r: requests.Response, want: int) -> tuple[bool, str]:
    return r.status_code == want, f"{r.status_code} {r.text[:160]!r}"


def _manage_env(live: Live) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ONEPIECE_", "DJANGO_"))}
    env.update(DJANGO_SETTINGS_MODULE="onepiece_platform.settings.local", ONEPIECE_STATE_DIR=str(live.state),
               PYTHONPATH=str(REPO / "platform"),
               DJANGO_SECRET_KEY=(live.state / "secrets" / "django-secret-key").read_text().strip())
    return env


def _low_tier_user(live: Live) -> str:
    """A staff user (so that it may sign in) whose tier an operator set to low; its API key."""
    code = ("from django.contrib.auth import get_user_model as g\n"
            "from onepiece_platform.accounts.models import ApiKey, PriorityTier\n"
            f"u = g().objects.create_user('auditor', password={LOW_PASSWORD!r}, is_staff=True)\n"
            "PriorityTier.objects.create(user=u, max_priority='low')\n"
            "print('KEY', ApiKey.issue(u, 'audit')[1])\n")
    out = subprocess.run([sys.executable, str(REPO / "manage.py"), "shell", "-c", code], env=_manage_env(live),
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    return next(line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("KEY "))


def _signed_in(live: Live, user: str, password: str) -> Web:
    """A browser's session: the admin's sign-in form, with its CSRF token."""
    c = live.client(follow_redirects=False)
    page = c.get("/admin/login/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
    assert token is not None, page.status_code
    r = c.post("/admin/login/", data={"username": user, "password": password, "next": "/admin/",
                                      "csrfmiddlewaretoken": token.group(1)}, headers={"Referer": live.web})
    assert r.status_code == 302, (r.status_code, r.text[:200])
    c.headers["X-CSRFToken"] = c.cookies["csrftoken"]
    return c


def _job(live: Live, key: str, uid: str) -> dict[str, Any]:
    with live.client(key) as c:
        return c.get(f"/api/v1/jobs/{uid}").json()


def nested_lora(live: Live) -> None:
    """Finding 1: a lora nested ~2000 deep is a 400 on every door that takes it (was a 500)."""
    native = {"workflow": "sd-t2i", "params": json.dumps(SD)}
    with live.client(live.key) as c:
        for name, send in (
                ("native JSON", lambda: c.post("/api/v1/jobs", json={"workflow": "sd-t2i", "params": SD,
                                                                      "lora": DEEP})),
                ("native multipart", lambda: c.post("/api/v1/jobs", files=_parts({**native, "lora": DEEP}))),
                ("images JSON", lambda: c.post("/v1/images/generations", json={**IMAGE, "lora": DEEP})),
                ("videos JSON", lambda: c.post("/v1/videos", json={**VIDEO, "lora": DEEP})),
                ("videos multipart", lambda: c.post("/v1/videos", files=_parts({**VIDEO, "lora": DEEP}))),
                ("videos form", lambda: c.post("/v1/videos", data={**VIDEO, "lora": DEEP}))):
            live.probe("1 nested lora", name, lambda send=send: _status(send(), 400))


def low_tier(live: Live) -> None:
    """Finding 2: the tier belongs to the user: signing in or minting a key from the session gives no more."""
    session = _signed_in(live, "auditor", LOW_PASSWORD)
    live.probe("2 tier", "session asks normal", lambda: _status(
        session.post("/api/v1/jobs", json={"workflow": "sd-t2i", "params": SD, "priority": "normal"}), 403))
    minted = session.post("/api/v1/keys", json={"name": "fresh"})
    live.probe("2 tier", "key minted from the session",
               lambda: (minted.status_code in (200, 201) and minted.json().get("max_priority") == "low",
                        f"{minted.status_code} max_priority={minted.json().get('max_priority')}"))
    with live.client(minted.json()["key"]) as c:
        r = c.post("/api/v1/jobs", json={"workflow": "sd-t2i", "params": SD})
    live.probe("2 tier", "minted key, no priority named",
               lambda: (r.status_code == 202 and r.json().get("priority") == "low",
                        f"{r.status_code} priority={r.json().get('priority')}"))


def low_tier_openai(live: Live) -> None:
    """Finding 4: a low-tier key is a plain OpenAI client: the default request works, remix too (was 403)."""
    import openai

    client = openai.OpenAI(base_url=live.web + "v1", api_key=live.low_key, max_retries=0, timeout=120)
    extra = {"num_inference_steps": 2}

    def image() -> tuple[bool, str]:
        r = client.images.generate(prompt="a cat", size="64x64", response_format="b64_json", extra_body=extra)
        return len(r.data) == 1, f"{len(r.data)} image"

    made: dict[str, Any] = {}

    def video() -> tuple[bool, str]:
        v = client.videos.create_and_poll(prompt="a cat", size="64x64", model="wan2.1-t2v", extra_body=extra,
                                          poll_interval_ms=200)
        made["id"] = v.id
        return v.status == "completed", f"{v.status} priority={_job(live, live.low_key, v.id).get('priority')}"

    def remix() -> tuple[bool, str]:
        r = client.videos.remix(made["id"], prompt="a dog")
        return r.remixed_from_video_id == made["id"], f"{r.status} priority={_job(live, live.low_key, r.id)['priority']}"

    for name, check in (("images, defaults", image), ("videos, defaults", video), ("remix", remix)):
        live.probe("4 low-tier openai", name, check)


def multipart_fields(live: Live) -> None:
    """Finding 5: the native multipart submit reads priority, deadline_s and lora (it dropped them)."""
    base = {"workflow": "sd-t2i", "params": json.dumps(SD)}
    asked = {"priority": {"priority": "low"}, "deadline_s": {"deadline_s": "600"},
             "lora": {"lora": json.dumps([{"name": "ink", "scale": 0.5}])}}
    want = {"priority": "low", "deadline_s": 600.0, "lora": [["ink", 0.5]]}
    uids: dict[str, str] = {}
    with live.client(live.key) as c:
        for name, extra in asked.items():
            r = c.post("/api/v1/jobs", files=_parts({**base, **extra}))
            if r.status_code == 202:
                uids[name] = r.json()["uid"]
            else:
                live.probe("5 multipart", name, lambda r=r: (False, f"{r.status_code} {r.text[:160]!r}"))
    recorded = _recorded(live, list(uids.values()))
    for name, uid in uids.items():
        got = recorded[uid][name]
        live.probe("5 multipart", name, lambda got=got, name=name: (got == want[name], f"recorded {got!r}"))


def _parts(fields: dict[str, str]) -> dict[str, tuple[None, str]]:
    """A multipart/form-data body of plain fields (no file), as a browser's form sends it."""
    return {k: (None, v) for k, v in fields.items()}


def _recorded(live: Live, uids: list[str]) -> dict[str, dict[str, Any]]:
    """What the ledger recorded of each job (priority, deadline, adapters), read as an operator would."""
    code = ("import json\nfrom onepiece_platform.jobs.models import Job\n"
            f"print('JOBS', json.dumps({{j.uid: {{'priority': j.priority, 'deadline_s': j.deadline_s, "
            f"'lora': [[a['name'], a['scale']] for a in (j.params or {{}}).get('lora', [])]}} "
            f"for j in Job.objects.filter(uid__in={uids!r})}}))\n")
    out = subprocess.run([sys.executable, str(REPO / "manage.py"), "shell", "-c", code], env=_manage_env(live),
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    return json.loads(next(line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("JOBS ")))


def malformed_adapters(live: Live) -> None:
    """Finding 6: a malformed safetensors file is one ``error:`` line from the CLI (status 2) and a form error
    in the admin, never a traceback or a 500."""
    admin_user, admin_password = _admin(live)
    session = _signed_in(live, admin_user, admin_password)
    for name in ("deep nesting", "bad data_offsets", "bad shape", "bad dtype"):
        raw = MALFORMED[_malformed_key(name)]
        path = live.state / f"audit-{_malformed_key(name)}.safetensors"
        path.write_bytes(raw)

        def cli(path: Path = path) -> tuple[bool, str]:
            p = _onepiece(live, "adapters", "add", "bad", str(path), "--workflow", "sd-t2i")
            lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
            ok = p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:")
            return ok, f"status {p.returncode}: {' | '.join(lines)[:160]}"

        def upload(raw: bytes = raw) -> tuple[bool, str]:
            r = session.post("/admin/adapters/adapteraction/add/", data={
                "action": "add", "name": "bad", "workflow": "sd-t2i", "scale_default": "1",
                "csrfmiddlewaretoken": session.cookies["csrftoken"]},
                files={"file": ("lora.safetensors", raw)}, headers={"Referer": live.web})
            error = re.search(r'<ul class="errorlist[^>]*>\s*<li>(.*?)</li>', r.text, re.S)
            return r.status_code == 200 and error is not None, \
                f"{r.status_code} form error: {error.group(1)[:120] if error else '-'}"

        live.probe("6 malformed adapter", f"CLI, {name}", cli)
        live.probe("6 malformed adapter", f"admin upload, {name}", upload)


def _malformed_key(name: str) -> str:
    return {"deep nesting": "deep", "bad data_offsets": "offsets-reversed", "bad shape": "shape-negative",
            "bad dtype": "dtype-unknown"}[name]


def _admin(live: Live) -> tuple[str, str]:
    m = re.search(r"\(user (\S+), password (\S+)\)", live.lines["admin"])
    assert m is not None, live.lines["admin"]
    return m.group(1), m.group(2)


def _onepiece(live: Live, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ONEPIECE_STATE_DIR": str(live.state)}
    return subprocess.run([str(Path(sys.executable).parent / "onepiece"), *argv], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def full_width(live: Live) -> None:
    """Finding 7: float fields read ASCII digits only (they took "６０" and "５")."""
    with live.client(live.key) as c:
        for name, send in (
                ("native deadline_s", lambda: c.post("/api/v1/jobs", json={"workflow": "sd-t2i", "params": SD,
                                                                           "deadline_s": "\uff16\uff10"})),
                ("native guidance_scale", lambda: c.post("/api/v1/jobs", json={
                    "workflow": "sd-t2i", "params": {**SD, "guidance_scale": "\uff15"}})),
                ("native multipart deadline_s", lambda: c.post("/api/v1/jobs", files=_parts({
                    "workflow": "sd-t2i", "params": json.dumps(SD), "deadline_s": "\uff16\uff10"}))),
                ("videos guidance_scale", lambda: c.post("/v1/videos", json={**VIDEO, "guidance_scale": "\uff15"}))):
            live.probe("7 full-width digits", name, lambda send=send: _status(send(), 400))


def interop(live: Live) -> None:
    """Interop: an empty ``after=``, the size refusal's list, ``model: "default"``, a diffusers LoRA folder."""
    with live.client(live.key) as c:
        live.probe("interop", "GET /v1/videos?after=", lambda: _status(c.get("/v1/videos?after="), 200))

        def size() -> tuple[bool, str]:
            r = c.post("/v1/images/generations", json={"prompt": "a cat", "size": "13x13"})
            listed = set(re.findall(r"\d+x\d+", r.text)) - {"13x13"}
            return r.status_code == 400 and bool(listed), f"{r.status_code} {r.text[:200]!r}"

        live.probe("interop", "size refusal lists the sizes", size)

        def default_model() -> tuple[bool, str]:
            r = c.post("/v1/images/generations", json={**IMAGE, "model": "default", "response_format": "b64_json",
                                                       "num_inference_steps": 2})
            return r.status_code == 200 and len(r.json().get("data", [])) == 1, f"{r.status_code} {r.text[:120]!r}"

        live.probe("interop", 'model "default"', default_model)
    live.probe("interop", "adapters add takes a diffusers LoRA folder", lambda: _lora_folder(live))


def _lora_folder(live: Live) -> tuple[bool, str]:
    """The folder diffusers' ``save_lora_weights`` writes, for the deployment's sd-t2i model: added as "ink"
    (finding 5's multipart probe then names it)."""
    from engine.adapters.tiny import make_tiny_lora

    model = live.state / "models" / "sd-t2i"
    weights = make_tiny_lora("sd-t2i", live.state / "audit-lora", 1, model_dir=model)
    folder = weights if weights.is_dir() else weights.parent
    p = _onepiece(live, "adapters", "add", "ink", str(folder), "--workflow", "sd-t2i")
    return p.returncode == 0, f"status {p.returncode}: {(p.stdout + p.stderr).strip()[-160:]}"


def redis_down(live: Live) -> None:
    """Finding 3: with Redis down, the doors that read it answer 503 with Retry-After before a response starts
    (the admin sign-in, the dashboard's preview, the Proxy's and the platform's streams)."""
    with live.client(live.key) as c:
        uid = c.post("/v1/videos", json={**VIDEO, "num_inference_steps": 2}).json()["id"]
        _wait_done(c, uid)
    admin_user, admin_password = _admin(live)
    staff = _signed_in(live, admin_user, admin_password)
    form = live.client(follow_redirects=False)
    page = form.get("/admin/login/")
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
    redis_pid = _redis_pid(live)
    os.kill(live.proc.pid, signal.SIGSTOP)  # the launcher: its supervisor would restart Redis at once
    try:
        os.kill(redis_pid, signal.SIGKILL)
        _gone(redis_pid)
        doors = {
            "admin sign-in": lambda: form.post("/admin/login/", data={
                "username": admin_user, "password": admin_password, "next": "/admin/",
                "csrfmiddlewaretoken": token.group(1) if token else ""}, headers={"Referer": live.web}),
            "dashboard preview": lambda: staff.get(f"/dashboard/api/jobs/{uid}/preview"),
            "proxy stream": lambda: requests.get(f"{live.lines['proxy']}/v1/requests/{uid}/result",
                                              params={"stream": "true"}, headers=_proxy_auth(live), timeout=30),
            "platform stream": lambda: live.client(live.key).get(f"/v1/videos/{uid}/content",
                                                                 params={"stream": "true"})}
        for name, send in doors.items():
            live.probe("3 redis down", name, lambda send=send: _unavailable(send()))
    finally:
        os.kill(live.proc.pid, signal.SIGCONT)


def _unavailable(r: requests.Response) -> tuple[bool, str]:
    retry = r.headers.get("retry-after", "")
    return r.status_code == 503 and retry.isdigit() and int(retry) > 0, \
        f"{r.status_code} Retry-After={retry or '-'} {r.text[:100]!r}"


def _proxy_auth(live: Live) -> dict[str, str]:
    from engine.proxy.auth import auth_headers

    return auth_headers((live.state / "secrets" / "proxy-token").read_text().strip())


def _redis_pid(live: Live) -> int:
    port = live.lines["redis"].rsplit(":", 1)[1].split("/")[0]
    out = subprocess.run(["pgrep", "-f", f"redis-server .*:{port}"], capture_output=True, text=True).stdout.split()
    assert len(out) == 1, (port, out)
    return int(out[0])


def _gone(pid: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:  # killed and not yet reaped (its parent, the launcher, is stopped): a zombie is gone
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.05)  # polling a process's exit: there is no event to wait on for a non-child
    raise TimeoutError(f"redis-server {pid} still running")


def _wait_done(c: Web, uid: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = c.get(f"/v1/videos/{uid}").json().get("status")
        if status in ("completed", "failed"):
            assert status == "completed", uid
            return
        time.sleep(0.5)
    raise TimeoutError(uid)


def still_serves(live: Live) -> None:
    """After all of it (Redis back, restarted by the supervisor), a default request completes."""
    import openai

    client = openai.OpenAI(base_url=live.web + "v1", api_key=live.key, max_retries=3, timeout=300)

    def image() -> tuple[bool, str]:
        r = client.images.generate(prompt="a cat", size="64x64", response_format="b64_json",
                                   extra_body={"num_inference_steps": 2})
        return len(r.data) == 1, f"{len(r.data)} image after the outage"

    live.probe("after", "a default request completes", image)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "audit" / f"{dt.date.today()}.json")
    p.add_argument("--keep-state", action="store_true", help="keep the temporary state folder")
    args = p.parse_args()
    state = Path(tempfile.mkdtemp(prefix="onepiece-audit-"))
    proc, lines = start_up(state / "state")
    live = Live(proc, lines, state / "state", web=lines["web"], key=lines["api key"])
    try:
        live.low_key = _low_tier_user(live)
        for part in (nested_lora, low_tier, low_tier_openai, interop, multipart_fields, malformed_adapters,
                     full_width, redis_down, still_serves):
            part(live)
    finally:
        stop_up(proc)
    broken = [r for r in live.results if not r["held"]]
    print(f"audit re-run: {len(live.results) - len(broken)} held, {len(broken)} broken of {len(live.results)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"provenance": provenance(sys.argv), "held": len(live.results) - len(broken),
                                    "broken": len(broken), "probes": live.results}, indent=1) + "\n")
    if not args.keep_state:
        subprocess.run(["rm", "-rf", str(state)], check=False)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
