"""EngineClient over the Proxy's HTTP API (engine/proxy/app.py)."""

from __future__ import annotations

import base64
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from engine.store.keys import TERMINAL
from engine.workflow.options import DEFAULT as DEFAULT_OPTIONS
from engine.workflow.options import Options, Priority
from onepiece_platform import conf
from onepiece_platform.engine_link.client import (
    Accepted,
    EngineClient,
    EngineError,
    EngineRejected,
    EngineStatus,
    ResultUrl,
    api_params,
)

ETA_FIELDS = ("eta_s", "eta_p90_s", "provisional", "queue_ahead")  # what the Proxy's status adds (engine.proxy.eta)
DISCOVER = "etcd"  # PROXY_URL value: ask the Node Manager's Workflow Sets which Proxy to use, per workflow
DISCOVERY_TTL_S = 1.0
LIMITS_TTL_S = 5.0  # how long the loaded models' limits are reused before the Proxy is asked again

log = logging.getLogger(__name__)


class ProxyEngineClient(EngineClient):
    """With ``PROXY_URL`` a URL, every call goes to that Proxy. With ``PROXY_URL = "etcd"``, a submission
    goes to a Proxy of the least loaded Workflow Set serving its workflow (engine.coord.proxies.which_proxy,
    re-asked at most every second); status, cancel and result go to any Proxy (they all read one store)."""

    def __init__(self, base_url: str | None = None, timeout: float | None = None, token: str | None = None) -> None:
        self.base = (base_url or conf.get("PROXY_URL")).rstrip("/")
        # the Proxy's shared secret (engine.proxy.auth): every route but its health probes needs it
        self.token = token if token is not None else conf.get("PROXY_TOKEN")
        self.timeout = float(timeout if timeout is not None else conf.get("PROXY_TIMEOUT_S"))
        self._chosen: dict[str, tuple[float, str]] = {}
        self._etcd: Any = None
        self._limits: dict[str, tuple[float, dict[str, Any] | None]] = {}  # workflow -> (when asked, limits)

    def _base_for(self, workflow: str | None) -> str:
        if self.base != DISCOVER:
            return self.base
        import time

        now = time.monotonic()
        key = workflow or ""
        got = self._chosen.get(key)
        if got is not None and now - got[0] < DISCOVERY_TTL_S:
            return got[1]
        from django.conf import settings

        from engine.coord import etcd_client
        from engine.coord.proxies import NoProxy, which_proxy

        if self._etcd is None:
            self._etcd = etcd_client(settings.ETCD_URL)
        try:
            url = which_proxy(self._etcd, workflow, conf.get("ETCD_ROOT")).rstrip("/")
        except NoProxy as exc:
            raise EngineRejected(503, str(exc), "", 5) from exc
        except Exception as exc:  # etcd unreachable
            raise EngineError(f"cannot ask etcd which Proxy to use: {exc}") from exc
        self._chosen[key] = (now, url)
        return url

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, bytes, Any]:
        data = json.dumps(body).encode() if body is not None else None
        if self.base == DISCOVER and body is None:
            # a look-up (status, cancel, result): every Proxy reads the same store; try them in turn
            last: EngineError | None = None
            for base in self._all_proxies():
                try:
                    return self._send(base, method, path, data)
                except EngineError as exc:
                    last = exc
            raise last or EngineError("no Proxy is registered in any workflow set")
        return self._send(self._base_for(body.get("workflow") if body else None), method, path, data)

    def _all_proxies(self) -> list[str]:
        import random

        from django.conf import settings

        from engine.coord import etcd_client
        from engine.coord.proxies import all_proxies

        if self._etcd is None:
            self._etcd = etcd_client(settings.ETCD_URL)
        try:
            urls = all_proxies(self._etcd, conf.get("ETCD_ROOT"))
        except Exception as exc:  # etcd unreachable
            raise EngineError(f"cannot ask etcd which Proxies there are: {exc}") from exc
        random.shuffle(urls)
        return [u.rstrip("/") for u in urls]

    def _send(self, base: str, method: str, path: str, data: bytes | None) -> tuple[int, bytes, Any]:
        headers = {"Content-Type": "application/json"} if data else {}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        req = urllib.request.Request(base + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                return r.status, r.read(), r.headers
        except urllib.error.HTTPError as e:
            return e.code, e.read(), e.headers
        except (OSError, ValueError) as exc:
            raise EngineError(f"proxy at {base} unreachable: {exc}") from exc

    @staticmethod
    def _json(raw: bytes) -> dict[str, Any]:
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise EngineError(f"proxy answered non-JSON: {raw[:100]!r}") from exc
        if not isinstance(doc, dict):
            raise EngineError("proxy answered a non-object")
        return doc

    def limits(self, workflow: str) -> dict[str, dict[str, Any]] | None:
        """The loaded model's limits for ``workflow`` as the Proxy that would take its submissions has them
        (its ``GET /v1/workflows``, from its routes), reused for :data:`LIMITS_TTL_S`; a workflow the Proxy
        has none for yet (no route published) is asked again after a second, never cached as "none". None
        while no Proxy answers (the Proxy checks every request again). Malformed entries are dropped
        (engine.workflow.limits.parse): never a 500 here."""
        from engine.workflow import limits as model_limits

        now = time.monotonic()
        got = self._limits.get(workflow)
        if got is not None and now - got[0] < (LIMITS_TTL_S if got[1] is not None else 1.0):
            return got[1]
        try:
            code, raw, _ = self._send(self._base_for(workflow), "GET", "/v1/workflows", None)
            found = self._json(raw).get("workflows") if code == 200 else None
        except (EngineError, EngineRejected) as exc:
            log.warning("cannot read the loaded models' limits: %s", exc)
            return got[1] if got is not None else None
        entry = found.get(workflow) if isinstance(found, dict) else None
        parsed = model_limits.parse(entry.get("limits")) if isinstance(entry, dict) else None
        self._limits[workflow] = (now, parsed or None)
        return parsed or None

    def submit(self, workflow: str, params: dict[str, Any], inputs: dict[str, bytes],
               options: Options = DEFAULT_OPTIONS, uid: str | None = None) -> Accepted:
        body: dict[str, Any] = {"workflow": workflow, "params": api_params(params, options),
                                "inputs": {k: base64.b64encode(v).decode() for k, v in inputs.items()}}
        if options.deadline_s is not None:
            body["deadline_s"] = options.deadline_s
        if uid is not None:
            body["uid"] = uid
        if options.priority != Priority.NORMAL:
            body["priority"] = options.priority.value
        # ?workflow= lets the Proxy refuse an overloaded workflow before it reads the body
        code, raw, headers = self._call("POST", f"/v1/requests?workflow={urllib.parse.quote(workflow)}", body)
        doc = self._json(raw)
        if code == 202:
            return Accepted(str(doc["uid"]), float(doc.get("cost_gpu_s", 0.0)),
                            float(doc.get("predicted_wait_s", 0.0)))
        if code in (400, 409, 413, 503):
            retry = headers.get("Retry-After")
            raise EngineRejected(code, str(doc.get("error", "")), str(doc.get("field", "")),
                                 int(retry) if retry and retry.isdigit() else None)
        raise EngineError(f"proxy answered {code}: {doc}")

    def status(self, uid: str, wait_s: float | None = None) -> EngineStatus | None:
        query = "" if wait_s is None else f"?wait={wait_s:.3f}"
        code, raw, _ = self._call("GET", f"/v1/requests/{uid}{query}")
        if code == 404:
            return None
        if code != 200:
            raise EngineError(f"proxy answered {code} to a status request")
        d = self._json(raw)
        eta = {k: d[k] for k in ETA_FIELDS if k in d} or None  # the Proxy's estimate of an unfinished job
        return EngineStatus(uid, d["state"], d.get("workflow", ""), d.get("stage", ""), int(d.get("progress", 0)),
                            d.get("detail", ""), eta)

    def wait(self, uid: str, timeout: float) -> EngineStatus | None:
        """The Proxy's long poll (``?wait=S``, woken by the job's terminal event), in rounds of at most its
        60 s cap and half this client's HTTP timeout (so a late answer is not an error). A round that fails
        (a Proxy restarting) is tried again until the deadline; only then is the error raised."""
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            rnd = max(0.0, min(deadline - time.monotonic(), 60.0, self.timeout / 2))
            try:
                st = self.status(uid, rnd)
            except EngineError:
                if deadline - time.monotonic() <= 0:
                    raise
                time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
                continue
            if st is None or st.state in TERMINAL or deadline - time.monotonic() <= 0:
                return st
            if rnd < 0.05:  # a tiny HTTP timeout must not make this a busy loop
                time.sleep(0.05)

    def cancel(self, uid: str) -> bool:
        code, _, _ = self._call("DELETE", f"/v1/requests/{uid}")
        if code in (202, 409):  # 409: already finished, which is fine for an idempotent cancel
            return True
        if code == 404:
            return False
        raise EngineError(f"proxy answered {code} to a cancel")

    def result(self, uid: str) -> bytes | None:
        code, raw, _ = self._call("GET", f"/v1/requests/{uid}/result")
        if code == 200:
            return raw
        if code in (404, 409, 410):
            return None
        raise EngineError(f"proxy answered {code} to a result request")

    def result_url(self, uid: str, expires_s: int = 3600) -> ResultUrl | None:
        code, raw, _ = self._call("GET", f"/v1/requests/{uid}/result/url?expires_s={int(expires_s)}")
        if code == 200:
            d = json.loads(raw)
            return ResultUrl(d["url"], int(d["expires_at"]), int(d["size"]), d["sha256"], d["content_type"])
        if code in (404, 409, 410):
            return None
        raise EngineError(f"proxy answered {code} to a result URL request")

    def drop_result(self, uid: str) -> bool:
        code, raw, _ = self._call("DELETE", f"/v1/requests/{uid}/result")
        if code == 200:
            return bool(json.loads(raw)["dropped"])
        if code in (404, 409):
            return False
        raise EngineError(f"proxy answered {code} to a result deletion")
