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

Issue 38's group (``38 ...``: "0 probes broken in a live check of the new surface") probes the object store's
surface: a second user asking for the first user's video, its content (Range included), URL, job and image,
and the store itself without a signature (404 or 403, never a byte); presigned and platform URLs tampered
(signature, key, credential, expiry, kind) and expired (an output kept 20 s); Range on every door that serves
bytes; ``output_upload_url`` at loopback, private ranges, the metadata service and a redirect (a 400 naming
it on every door, and nothing reaching a receiver on loopback); ``retention`` over the tier's ceiling (a 400
naming it). The deployment runs with ``ONEPIECE_WEBHOOK_ALLOW_PRIVATE=0``: production's egress policy
(``onepiece up``'s local settings otherwise let uploads reach this machine), http allowed as production's
``ONEPIECE_WEBHOOK_REQUIRE_HTTPS=0`` allows it, so the address check is what is judged; and with
``ONEPIECE_OBJECT_INLINE_BYTES=16384``, so that the tiny model's videos are stored (presigned URLs from the
embedded store) while its small images stay inline in Redis (the platform's own URLs).
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
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from engine.bench.figures import provenance  # noqa: E402
from engine.bench.harness import with_load_after  # noqa: E402
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
    return _user_key(live, "auditor", "low")


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
            f"'lora': [[a['name'], a['scale']] for a in (j.options or {{}}).get('lora', [])]}} "
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


# -- issue 38: the object-store surface (other users' objects, expired and tampered URLs, Range, the client's
# own bucket, retention). The deployment runs with ONEPIECE_WEBHOOK_ALLOW_PRIVATE=0: production's egress policy
# (private, loopback and link-local refused), with http allowed as ONEPIECE_WEBHOOK_REQUIRE_HTTPS=0 allows it in
# production, so that the address check is what is judged.
DAY = 86400
SHORT_RETENTION_S = 20  # the expired probes' outputs: their URLs stop at the retention's end
# the deployment's settings: production's egress policy; outputs over 16 KiB in the store (the tiny model's 67 KB
# videos: presigned URLs from the embedded store) and smaller ones inline in Redis (its jpeg images: the
# platform's own URLs), so that both kinds of URL are probed (the default, 256 KiB, keeps every tiny output inline)
AUDIT_ENV = {"ONEPIECE_WEBHOOK_ALLOW_PRIVATE": "0", "ONEPIECE_OBJECT_INLINE_BYTES": str(16 << 10)}


@dataclass
class Made:
    """What the object probes made: the first user's video (its bytes and URL), image job and short-lived
    outputs; the second user's key and own video."""

    video: str = ""
    full: bytes = b""
    url: str = ""
    image: str = ""
    short_video: str = ""
    short_urls: dict[str, dict[str, Any]] = field(default_factory=dict)
    other_key: str = ""
    other_video: str = ""
    other_url: str = ""


def _user_key(live: Live, name: str, tier: str = "") -> str:
    """A user made as an operator scripts it (with a priority tier when ``tier``); its API key."""
    code = ("from django.contrib.auth import get_user_model as g\n"
            "from onepiece_platform.accounts.models import ApiKey, PriorityTier\n"
            f"u = g().objects.create_user({name!r}, password={LOW_PASSWORD!r}, is_staff={bool(tier)})\n"
            + (f"PriorityTier.objects.create(user=u, max_priority={tier!r})\n" if tier else "")
            + "print('KEY', ApiKey.issue(u, 'audit')[1])\n")
    out = subprocess.run([sys.executable, str(REPO / "manage.py"), "shell", "-c", code], env=_manage_env(live),
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    return next(line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("KEY "))


def _submit(c: Web, path: str, body: dict[str, Any], want: int = 200) -> requests.Response:
    """POST as a client does that honours Retry-After: the user's earlier probes' jobs may still hold its
    concurrent-jobs limit (429)."""
    deadline = time.monotonic() + 300
    while (r := c.post(path, json=body)).status_code in (429, 503) and time.monotonic() < deadline:
        time.sleep(float(r.headers.get("retry-after") or 1))
    assert r.status_code == want, (path, r.status_code, r.text[:200])
    return r


def _video(live: Live, key: str, **extra: Any) -> str:
    """A completed video of ``key``'s user (2 steps); its id."""
    with live.client(key) as c:
        r = _submit(c, "/v1/videos", {**VIDEO, "num_inference_steps": 2, **extra})
        uid = r.json()["id"]
        _wait_done(c, uid)
        return uid


def _content_url(live: Live, key: str, uid: str) -> dict[str, Any]:
    with live.client(key) as c:
        r = c.get(f"/v1/videos/{uid}/content", params={"response_format": "url"})
        assert r.status_code == 200, (r.status_code, r.text[:200])
        return r.json()


def _make_objects(live: Live) -> Made:
    """The outputs the object probes look at: short-lived ones first (their retention runs meanwhile)."""
    made = Made()
    made.short_video = _video(live, live.key, retention=SHORT_RETENTION_S)
    made.short_urls["the video's URL"] = {**_content_url(live, live.key, made.short_video), "got": time.time()}
    with live.client(live.key) as c:
        r = _submit(c, "/v1/images/generations", {**IMAGE, "num_inference_steps": 2, "response_format": "url",
                                                   "output_format": "jpeg", "retention": SHORT_RETENTION_S})
        made.short_urls["the jpeg image's URL (the platform's)"] = {**r.json()["data"][0], "got": time.time()}
        made.image = _submit(c, "/api/v1/jobs", {"workflow": "sd-t2i", "params": SD}, 202).json()["uid"]
    made.video = _video(live, live.key)
    made.url = _content_url(live, live.key, made.video)["url"]
    with live.client(live.key) as c:
        made.full = c.get(f"/v1/videos/{made.video}/content").content
        deadline = time.monotonic() + 300
        while c.get(f"/api/v1/jobs/{made.image}").json()["state"] != "completed":
            assert time.monotonic() < deadline, made.image
            time.sleep(0.5)
    made.other_key = _user_key(live, "second-user")
    made.other_video = _video(live, made.other_key)
    made.other_url = _content_url(live, made.other_key, made.other_video)["url"]
    return made


def _refused(r: requests.Response, full: bytes, allowed: tuple[int, ...] = (403, 404)) -> tuple[bool, str]:
    """Refused (``allowed``), and none of the video's bytes in the answer."""
    leaked = r.content[4:8] == b"ftyp" or r.content[:4] == b"\x89PNG" or (len(r.content) > 64 and r.content in full)
    return r.status_code in allowed and not leaked, f"{r.status_code} {r.content[:120]!r}"


def other_users(live: Live, made: Made) -> None:
    """A second user (its own key) asks for the first user's video, its content, URL, job and image: 404 or
    403, never a byte; its delete and remix touch nothing of the first user's."""
    a, img = made.video, made.image
    with live.client(made.other_key) as c:
        doors: dict[str, Callable[[], requests.Response]] = {
            "video": lambda: c.get(f"/v1/videos/{a}"),
            "video content": lambda: c.get(f"/v1/videos/{a}/content"),
            "video content, Range": lambda: c.get(f"/v1/videos/{a}/content", headers={"Range": "bytes=0-99"}),
            "video content URL": lambda: c.get(f"/v1/videos/{a}/content", params={"response_format": "url"}),
            "video thumbnail": lambda: c.get(f"/v1/videos/{a}/content", params={"variant": "thumbnail"}),
            "video stream": lambda: c.get(f"/v1/videos/{a}/content", params={"stream": "true"}),
            "native job": lambda: c.get(f"/api/v1/jobs/{a}"),
            "native result": lambda: c.get(f"/api/v1/jobs/{a}/result"),
            "image job's result": lambda: c.get(f"/api/v1/jobs/{img}/result"),
            "remix": lambda: c.post(f"/v1/videos/{a}/remix", json={"prompt": "a dog"}),
            "delete": lambda: c.session.delete(f"{c.base}/v1/videos/{a}", timeout=120),
            "native preview": lambda: c.get(f"/api/v1/jobs/{a}/preview"),
            "native delete": lambda: c.session.delete(f"{c.base}/api/v1/jobs/{a}", timeout=120),
        }
        for name, send in doors.items():
            live.probe("38 other user", name, lambda send=send: _refused(send(), made.full))
    with live.client(live.key) as c:
        def still() -> tuple[bool, str]:
            r = c.get(f"/v1/videos/{a}/content")
            return r.status_code == 200 and r.content == made.full, f"{r.status_code}, {len(r.content)} bytes"

        live.probe("38 other user", "the owner's video still served, whole", still)
    _store_doors(live, made)


def _store_doors(live: Live, made: Made) -> None:
    """The store itself, without a signature: the object's URL, the bucket's listing and the store's, through
    its S3 layer and through Swift's own API (tempauth's account, no token or a made-up one), are refused: a
    4xx with none of the video's bytes and no key of it listed."""
    from engine.embedded.s3 import ACCESS_KEY

    u = urlsplit(made.url)
    if not u.query:  # the platform's own URL (no public store endpoint): the tampered probes cover it
        live.probe("38 other user", "store endpoint", lambda: (False, f"not a presigned URL: {made.url[:100]}"))
        return
    base = f"{u.scheme}://{u.netloc}"
    bucket, key = u.path.lstrip("/").split("/", 1)
    swift = f"{base}/v1/AUTH_{ACCESS_KEY.split(':', 1)[0]}"
    doors = {"S3: the object's URL without its signature": (f"{base}{u.path}", {}),
             "S3: the bucket's listing": (f"{base}/{bucket}", {}),
             "S3: the store's bucket list": (f"{base}/", {}),
             "Swift API: the object, no token": (f"{swift}/{bucket}/{key}", {}),
             "Swift API: the object, a made-up token": (f"{swift}/{bucket}/{key}", {"X-Auth-Token": "AUTH_tk" + "0" * 32}),
             "Swift API: the container's listing": (f"{swift}/{bucket}", {}),
             "Swift API: the account's listing": (swift, {})}
    for name, (url, headers) in doors.items():
        def anonymous(url: str = url, headers: dict[str, str] = headers) -> tuple[bool, str]:
            r = requests.get(url, headers=headers, timeout=30)
            ok, detail = _refused(r, made.full, tuple(range(400, 500)))
            return ok and made.video.encode() not in r.content, detail

        live.probe("38 other user", name, anonymous)


def _tokens(live: Live, uid: str, other: str) -> dict[str, str]:
    """Grants to the video route signed with the deployment's own key (read from its state folder, as an
    operator could): a fresh one (the control), one dated 2 h ago, one dated 2 h ahead, one of the image kind."""
    code = ("import json, time\nfrom django.core import signing\n"
            "from onepiece_platform.jobs.result_urls import URL_SALT, sign_result_url\n"
            "s = signing.TimestampSigner(salt=URL_SALT)\n"
            "def at(v, dt_s): return signing.Signer.sign(s, f'{v}:{signing.b62_encode(int(time.time()) + dt_s)}')\n"
            f"print('TOKENS', json.dumps({{'fresh': sign_result_url('video', {uid!r}), "
            f"'old': at('video:{uid}', -7200), 'ahead': at('video:{uid}', 7200), "
            f"'image kind': sign_result_url('image', {uid!r}), 'other': sign_result_url('video', {other!r})}}))\n")
    out = subprocess.run([sys.executable, str(REPO / "manage.py"), "shell", "-c", code], env=_manage_env(live),
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    return json.loads(next(line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("TOKENS ")))


def _flip(s: str) -> str:
    return s[:-1] + ("A" if s[-1] != "A" else "B")


def tampered(live: Live, made: Made) -> None:
    """A presigned URL with its signature, key or expiry changed is refused by the store (403); the platform's
    own signed URL, tampered, swapped to another video, of another kind, or dated out of its hour, is 404."""
    u = urlsplit(made.url)
    q = dict(parse_qsl(u.query))
    other = urlsplit(made.other_url)
    if u.query and "X-Amz-Signature" in q:
        variants = {
            "presigned: signature changed": {**q, "X-Amz-Signature": _flip(q["X-Amz-Signature"])},
            "presigned: expiry stretched to 7 days": {**q, "X-Amz-Expires": str(7 * DAY)},
            "presigned: credential changed": {**q, "X-Amz-Credential": "A" + q["X-Amz-Credential"][1:]}}
        for name, query in variants.items():
            url = urlunsplit((u.scheme, u.netloc, u.path, urlencode(query), ""))
            live.probe("38 tampered URL", name, lambda url=url: _refused(requests.get(url, timeout=30), made.full))
        swapped = urlunsplit((u.scheme, u.netloc, other.path, u.query, ""))  # the first user's grant, another key
        live.probe("38 tampered URL", "presigned: key changed to the second user's object",
                   lambda: _refused(requests.get(swapped, timeout=30), made.full))
    else:
        live.probe("38 tampered URL", "presigned", lambda: (False, f"not a presigned URL: {made.url[:100]}"))
    tokens = _tokens(live, made.video, made.other_video)
    route = live.web.rstrip("/") + "/v1/videos/content/"

    def control() -> tuple[bool, str]:
        r = requests.get(route + tokens["fresh"], timeout=60)
        return r.status_code == 200 and r.content == made.full, f"{r.status_code}, {len(r.content)} bytes"

    live.probe("38 tampered URL", "platform URL: an untampered grant serves (control)", control)
    fresh = tokens["fresh"]
    forged = {"platform URL: signature changed": _flip(fresh),
              "platform URL: video id changed": fresh.replace(made.video, made.other_video),
              "platform URL: dated 2 h ago (expired)": tokens["old"],
              "platform URL: dated 2 h ahead": tokens["ahead"],
              "platform URL: an image grant on the video route": tokens["image kind"]}
    for name, token in forged.items():
        live.probe("38 tampered URL", name,
                   lambda token=token: _refused(requests.get(route + token, timeout=60), made.full, (404,)))


def expired(live: Live, made: Made) -> None:
    """Outputs kept ``SHORT_RETENTION_S``: their URLs' ``expires_at`` is at most the retention's end; once it
    passed, the presigned GET (the store checks its expiry) and the platform's URL are refused, and the routes
    answer 410 (the clean-up that deletes the objects runs every 5 minutes: they are still stored)."""
    until = max(int(u["expires_at"]) for u in made.short_urls.values())
    live.probe("38 expired URL", f"expires_at within the {SHORT_RETENTION_S} s retention", lambda: (
        all(u["expires_at"] <= u["got"] + SHORT_RETENTION_S for u in made.short_urls.values()),
        ", ".join(f"{k}: {u['expires_at'] - u['got']:.1f} s after it was issued" for k, u in made.short_urls.items())))
    time.sleep(max(0.0, until + 2 - time.time()))  # the clock is the event: the URLs' own expiry
    for name, grant in made.short_urls.items():
        live.probe("38 expired URL", name, lambda grant=grant: _refused(
            requests.get(grant["url"], timeout=60), made.full, (400, 401, 403, 404, 410)))
    with live.client(live.key) as c:
        uid = made.short_video
        for name, send in (("video content", lambda: c.get(f"/v1/videos/{uid}/content")),
                           ("a new URL for it", lambda: c.get(f"/v1/videos/{uid}/content",
                                                              params={"response_format": "url"})),
                           ("native result", lambda: c.get(f"/api/v1/jobs/{uid}/result"))):
            live.probe("38 expired URL", f"after the retention: {name}",
                       lambda send=send: _refused(send(), made.full, (410,)))


def ranges(live: Live, made: Made) -> None:
    """A Range request returns exactly those bytes: on the presigned URL, the content route and the platform's
    signed URL; one past the end is a 416 naming the size."""
    n = len(made.full)
    tokens = _tokens(live, made.video, made.other_video)
    signed = live.web.rstrip("/") + "/v1/videos/content/" + tokens["fresh"]
    with live.client(live.key) as c:
        route = lambda h: c.get(f"/v1/videos/{made.video}/content", headers=h)  # noqa: E731
        cases = {
            "presigned bytes=10-99": (lambda h: requests.get(made.url, headers=h, timeout=60), "bytes=10-99",
                                      made.full[10:100]),
            "presigned bytes=-64": (lambda h: requests.get(made.url, headers=h, timeout=60), "bytes=-64",
                                    made.full[-64:]),
            "content route bytes=10-99": (route, "bytes=10-99", made.full[10:100]),
            f"content route bytes={n // 2}-": (route, f"bytes={n // 2}-", made.full[n // 2:]),
            "platform URL bytes=100-1099": (lambda h: requests.get(signed, headers=h, timeout=60),
                                            "bytes=100-1099", made.full[100:1100])}
        for name, (send, header, want) in cases.items():
            def check(send: Any = send, header: str = header, want: bytes = want) -> tuple[bool, str]:
                r = send({"Range": header})
                return r.status_code == 206 and r.content == want, \
                    f"{r.status_code} {len(r.content)} bytes, {r.headers.get('content-range')}"

            live.probe("38 range", name, check)

        def past_end() -> tuple[bool, str]:
            r = route({"Range": f"bytes={n}-"})
            return r.status_code == 416 and r.headers.get("content-range") == f"bytes */{n}", \
                f"{r.status_code} {r.headers.get('content-range')}"

        live.probe("38 range", f"content route bytes={n}- (past the end)", past_end)


class _Receiver:
    """An HTTP server on loopback standing for what an ``output_upload_url`` must never reach: it records every
    request; ``/redirect`` answers 307 to ``/landed``."""

    def __init__(self) -> None:
        import http.server
        import threading

        seen = self.seen = []  # type: list[str]

        class Handler(http.server.BaseHTTPRequestHandler):
            def _any(self) -> None:
                seen.append(f"{self.command} {self.path}")
                if self.path.startswith("/redirect"):
                    self.send_response(307)
                    self.send_header("Location", "/landed")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_PUT = do_POST = do_HEAD = _any

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _names(r: requests.Response, name: str) -> tuple[bool, str]:
    """A 400 that names ``name`` (the native ``field``, the OpenAI error's ``param``)."""
    try:
        body = r.json()
    except ValueError:
        body = {}
    err = body.get("error") if isinstance(body.get("error"), dict) else body
    named = err.get("param") == name or err.get("field") == name
    return r.status_code == 400 and named, f"{r.status_code} {r.text[:200]!r}"


def upload_urls(live: Live, made: Made, rx: _Receiver) -> None:
    """``output_upload_url`` at loopback (in several spellings), private ranges, the cloud's metadata service
    and a redirect: a 400 naming it at submission, on every door that takes it. (Whether anything reached the
    receiver is judged at the end of the group, once any job accepted by mistake had time to complete.)"""
    p = rx.port
    targets = {"127.0.0.1": f"http://127.0.0.1:{p}/put", "localhost": f"http://localhost:{p}/put",
               "[::1]": f"http://[::1]:{p}/put", "[::ffff:127.0.0.1]": f"http://[::ffff:127.0.0.1]:{p}/put",
               "2130706433 (127.0.0.1 as one number)": f"http://2130706433:{p}/put",
               "0.0.0.0": f"http://0.0.0.0:{p}/put", "10.0.0.1": "http://10.0.0.1/put",
               "172.16.0.1": "http://172.16.0.1/put", "192.168.1.1": "http://192.168.1.1/put",
               "169.254.169.254 (metadata)": "http://169.254.169.254/latest/meta-data/",
               "a redirect (307 to loopback)": f"http://127.0.0.1:{p}/redirect"}
    with live.client(live.key) as c:
        for name, url in targets.items():
            live.probe("38 output_upload_url", f"videos, {name}", lambda url=url: _names(
                c.post("/v1/videos", json={**VIDEO, "output_upload_url": url}), "output_upload_url"))
        for name in ("127.0.0.1", "169.254.169.254 (metadata)", "a redirect (307 to loopback)"):
            url = targets[name]
            for door, send in (
                    ("native", lambda url=url: c.post("/api/v1/jobs", json={
                        "workflow": "sd-t2i", "params": SD, "output_upload_url": url})),
                    ("native multipart", lambda url=url: c.post("/api/v1/jobs", files=_parts({
                        "workflow": "sd-t2i", "params": json.dumps(SD), "output_upload_url": url}))),
                    ("images", lambda url=url: c.post("/v1/images/generations", json={
                        **IMAGE, "output_upload_url": url})),
                    ("remix", lambda url=url: c.post(f"/v1/videos/{made.video}/remix", json={
                        "prompt": "a dog", "output_upload_url": url}))):
                live.probe("38 output_upload_url", f"{door}, {name}",
                           lambda send=send: _names(send(), "output_upload_url"))


def retention_ceiling(live: Live, made: Made) -> None:
    """``retention`` over the tier's ceiling (normal: 30 days; low: 7 days) is a 400 naming it, on every door,
    the openai SDK's included."""
    import openai

    over = 30 * DAY + 1
    with live.client(live.key) as c:
        doors = {
            "native JSON": lambda: c.post("/api/v1/jobs", json={"workflow": "sd-t2i", "params": SD,
                                                                 "retention": over}),
            "native multipart": lambda: c.post("/api/v1/jobs", files=_parts({
                "workflow": "sd-t2i", "params": json.dumps(SD), "retention": str(over)})),
            "videos JSON": lambda: c.post("/v1/videos", json={**VIDEO, "retention": over}),
            "videos form": lambda: c.post("/v1/videos", data={**VIDEO, "retention": str(over)}),
            "videos, 10^12 s": lambda: c.post("/v1/videos", json={**VIDEO, "retention": 10**12}),
            "images JSON": lambda: c.post("/v1/images/generations", json={**IMAGE, "retention": over}),
            "remix": lambda: c.post(f"/v1/videos/{made.video}/remix", json={"prompt": "a dog", "retention": over}),
        }
        for name, send in doors.items():
            live.probe("38 retention", name, lambda send=send: _names(send(), "retention"))
    with live.client(live.low_key) as c:
        live.probe("38 retention", "low tier, 8 days (its ceiling 7)", lambda: _names(c.post(
            "/api/v1/jobs", json={"workflow": "sd-t2i", "params": SD, "retention": 8 * DAY}), "retention"))
    client = openai.OpenAI(base_url=live.web + "v1", api_key=live.key, max_retries=0, timeout=120)

    def sdk() -> tuple[bool, str]:
        try:
            client.videos.create(prompt="a cat", size="64x64", model="wan2.1-t2v", extra_body={"retention": over})
        except openai.BadRequestError as exc:
            param = (exc.body or {}).get("param") if isinstance(exc.body, dict) else None
            return param == "retention" and "ceiling" in str(exc), f"400 param={param}: {str(exc)[:160]}"
        return False, "accepted"

    live.probe("38 retention", "openai SDK, videos.create", sdk)


def objects_surface(live: Live) -> None:
    """Issue 38's goal: 0 probes broken in a live check of the object store's surface."""
    made = _make_objects(live)
    rx = _Receiver()
    try:
        for part in (other_users, tampered, ranges, retention_ceiling):
            part(live, made)
        upload_urls(live, made, rx)
        expired(live, made)  # last: its outputs' retention has been running meanwhile
        live.probe("38 output_upload_url", "nothing reached the receiver",
                   lambda: (not rx.seen, f"{len(rx.seen)} requests: {rx.seen[:3]}"))
    finally:
        rx.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "audit" / f"{dt.date.today()}.json")
    p.add_argument("--keep-state", action="store_true", help="keep the temporary state folder")
    p.add_argument("--only", default="", help="comma-separated parts to run (e.g. objects_surface); default all")
    args = p.parse_args()
    before = provenance(sys.argv)
    state = Path(tempfile.mkdtemp(prefix="onepiece-audit-"))
    proc, lines = start_up(state / "state", env_extra=AUDIT_ENV)
    live = Live(proc, lines, state / "state", web=lines["web"], key=lines["api key"])
    try:
        live.low_key = _low_tier_user(live)
        for part in (nested_lora, low_tier, low_tier_openai, interop, multipart_fields, malformed_adapters,
                     full_width, objects_surface, redis_down, still_serves):
            if not args.only or part.__name__ in args.only.split(","):
                part(live)
    finally:
        stop_up(proc)
    broken = [r for r in live.results if not r["held"]]
    print(f"audit re-run: {len(live.results) - len(broken)} held, {len(broken)} broken of {len(live.results)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"provenance": with_load_after(before), "held": len(live.results) - len(broken),
                                    "broken": len(broken), "probes": live.results}, indent=1) + "\n")
    if not args.keep_state:
        subprocess.run(["rm", "-rf", str(state)], check=False)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
