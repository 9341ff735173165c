"""A bounded abuse run against ``onepiece up`` (issue 16): a few hundred anonymous and malformed requests
at the web platform's and the Proxy's ports. Every one is answered 4xx (never 5xx, never accepted); after
them a normal user's request still completes, and no job is left unfinished in the engine or the ledger."""

from __future__ import annotations

import base64
import json
import struct
import time
import urllib.error
import urllib.request
import uuid
import zlib
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.up import start_up, stop_up

SD = {"prompt": "a lighthouse", "height": 64, "width": 64, "num_inference_steps": 2}


def _call(method: str, url: str, data: bytes | None = None, headers: dict[str, str] | None = None,
          timeout: float = 30) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _bomb() -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    z = zlib.compressobj(9)
    idat = b"".join(z.compress(b"\x00" * 20_001) for _ in range(20_000)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 20_000, 20_000, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


def _bodies(workflow_key: str) -> list[tuple[bytes, str]]:
    """Malformed submissions (body, content type); ``workflow_key`` is "workflow" (both surfaces use it)."""
    sd = json.dumps(SD)[1:-1]
    bomb = base64.b64encode(_bomb()).decode()
    docs = [
        f'{{"{workflow_key}": "sd-t2i", "params": {{{sd}, "guidance_scale": NaN}}}}',
        f'{{"{workflow_key}": "sd-t2i", "params": {{{sd}, "seed": Infinity}}}}',
        "[" * 100_000 + "]" * 100_000,
        '{"a":' * 50_000 + "1" + "}" * 50_000,
        json.dumps({workflow_key: "sd-t2i", "params": {**SD, "prompt": "x" * 1_100_000}}),
        json.dumps({workflow_key: "sd-t2i", "params": {**SD, "prompt": "é" * 200_000}}),
        json.dumps({workflow_key: "sd-t2i", "params": SD, "surprise": 1}),
        json.dumps({workflow_key: "wan2.1-i2v", "params": {**SD, "num_frames": 5}, "inputs": {"image": bomb}}),
        json.dumps({workflow_key: "wan2.1-i2v", "params": {**SD, "num_frames": 5}, "inputs": {"image": "%%%"}}),
        json.dumps({workflow_key: "sd-t2i", "params": {**SD, "height": 10**400}}),
        json.dumps({workflow_key: "nope", "params": {}}),
    ]
    out = [(d.encode(), "application/json") for d in docs]
    out += [(b"\xff\xfe not json", "application/json"), (b"--x\r\nbroken", "multipart/form-data; boundary=x")]
    return out


@pytest.mark.timeout(600)
def test_abuse_leaves_the_service_serving_and_nothing_unfinished(tmp_path: Path,
                                                                 tiny_models: dict[str, Path]) -> None:
    state = tmp_path / "state"
    models = next(iter(tiny_models.values())).parent
    # the workflows its requests name (valid: sd-t2i; refused images: wan2.1-i2v), not text-to-video's workers
    proc, lines = start_up(state, "--models", str(models), "--workflows", "sd-t2i,wan2.1-i2v")
    try:
        web, proxy, key = lines["web"].rstrip("/"), lines["proxy"], lines["api key"]
        secrets_dir = state / "secrets"
        assert {p.name for p in secrets_dir.iterdir()} >= {"django-secret-key", "proxy-token", "redis-password"}
        assert all(p.stat().st_mode & 0o077 == 0 for p in [*secrets_dir.iterdir(), state / "db.sqlite3"])
        token = (secrets_dir / "proxy-token").read_text().strip()

        answers: list[tuple[str, int]] = []

        def hit(what: str, method: str, url: str, data: bytes | None = None, **headers: str) -> None:
            answers.append((what, _call(method, url, data, headers)[0]))

        valid = json.dumps({"workflow": "sd-t2i", "params": SD}).encode()
        for i in range(40):  # anonymous and wrong credentials at the Proxy: every route
            uid = uuid.uuid4().hex
            auth = {} if i % 2 else {"Authorization": f"Bearer {token[:-1]}x"}
            hit("proxy submit", "POST", proxy + "/v1/requests", valid, **{"Content-Type": "application/json"}, **auth)
            hit("proxy status", "GET", f"{proxy}/v1/requests/{uid}", **auth)
            hit("proxy result", "GET", f"{proxy}/v1/requests/{uid}/result", **auth)
            hit("proxy cancel", "DELETE", f"{proxy}/v1/requests/{uid}", **auth)
        for i in range(40):  # anonymous and bad keys at the web platform
            auth = {} if i % 2 else {"Authorization": f"Bearer op_{i:012d}_nothing"}
            hit("web submit", "POST", web + "/api/v1/jobs", valid, **{"Content-Type": "application/json"}, **auth)
            hit("web list", "GET", web + "/api/v1/jobs", **auth)
            hit("openai image", "POST", web + "/v1/images/generations", b'{"prompt": "x"}',
                **{"Content-Type": "application/json"}, **auth)
        bearer = {"Authorization": f"Bearer {token}"}
        for _ in range(3):  # malformed, with the right credentials
            for body, ctype in _bodies("workflow"):
                hit("proxy malformed", "POST", proxy + "/v1/requests", body, **{"Content-Type": ctype}, **bearer)
                hit("web malformed", "POST", web + "/api/v1/jobs", body, **{"Content-Type": ctype},
                    Authorization=f"Bearer {key}")
        assert len(answers) >= 300
        bad = [(w, s) for w, s in answers if not 400 <= s < 500]
        assert not bad, bad[:20]

        # a normal user's request still completes
        status, raw = _call("POST", web + "/api/v1/jobs", valid,
                            {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        assert status == 202, raw
        uid = json.loads(raw)["uid"]
        deadline = time.monotonic() + 180
        while True:
            status, raw = _call("GET", f"{web}/api/v1/jobs/{uid}", headers={"Authorization": f"Bearer {key}"})
            doc = json.loads(raw)
            if doc["state"] in ("completed", "failed", "cancelled", "expired"):
                break
            assert time.monotonic() < deadline, doc
            time.sleep(0.5)
        assert doc["state"] == "completed", doc
        status, png = _call("GET", f"{web}/api/v1/jobs/{uid}/result", headers={"Authorization": f"Bearer {key}"})
        assert status == 200 and png[:8] == b"\x89PNG\r\n\x1a\n"

        # nothing unfinished anywhere: the ledger, and the engine's in-flight sets and status hashes
        status, raw = _call("GET", web + "/api/v1/jobs?page_size=100", headers={"Authorization": f"Bearer {key}"})
        jobs: list[dict[str, Any]] = json.loads(raw)["results"]
        assert [j["uid"] for j in jobs] == [uid] and jobs[0]["state"] == "completed"
        import redis

        r = redis.Redis(host="127.0.0.1", port=int(lines["redis"].rsplit(":", 1)[1].split("/")[0]),
                        password=(secrets_dir / "redis-password").read_text().strip())
        try:
            from engine.store import keys

            assert all(r.zcard(keys.inflight_key(wf)) == 0 for wf in ("sd-t2i", "wan2.1-i2v"))
            states = {r.hget(k, "state") for k in r.scan_iter(keys.job_key("*"))}
            assert states == {b"completed"}, states
        finally:
            r.close()
    finally:
        out = stop_up(proc)
    assert proc.returncode == 0, out
