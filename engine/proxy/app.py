"""The Proxy's HTTP intake (aiohttp).

Routes:
  POST   /v1/requests               submit: JSON ``{"workflow", "params", "inputs": {name: base64},
                                    "deadline_s", "priority"}`` or multipart with a ``request``
                                    JSON part and one file part per input; 202 ``{"uid", ...}``
  GET    /v1/requests/{uid}         status (state, stage, progress 0-100, detail); ``?wait=S``: answered
                                    when the request finishes or after S seconds (at most 60)
  DELETE /v1/requests/{uid}         cancel: 202; the running stage stops at its next step
  GET    /v1/requests/{uid}/result  the result bytes (png, mp4)
  GET    /livez, /readyz            health

Order of work on submit, and why: the request is validated against the
workflow spec before anything else (400 naming the field); only then is a UID
drawn, its cost estimated and admission decided (503 + Retry-After, at once,
nothing queued); an accepted request is recorded (``accepted`` event) before
it enters the first stage's ring, so no worker ever sees a UID the store does
not know.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from engine.proxy.injector import Injector
from engine.proxy.monitor import Load, RequestMonitor
from engine.proxy.recovery import OrphanSweeper
from engine.store import JobStore, keys
from engine.worker.routes import RouteTable
from engine.workflow import InvalidRequest, get_workflow, request_workflow, workflows
from engine.workflow import message as wm

log = logging.getLogger("onepiece.proxy")

MAX_BODY = 64 << 20
CONTENT_TYPES = {"image": "image/png", "video": "video/mp4"}

STORE = web.AppKey("store", JobStore)
INJECTOR = web.AppKey("injector", Injector)
MONITOR = web.AppKey("monitor", RequestMonitor)
ROUTES = web.AppKey("routes", RouteTable)
ACCEPTED = web.AppKey("accepted", dict)  # workflow -> requests accepted since start


class BadRequest(Exception):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _error(status: int, message: str, field: str = "", headers: dict[str, str] | None = None) -> web.Response:
    body: dict[str, Any] = {"error": message}
    if field:
        body["field"] = field
    return web.json_response(body, status=status, headers=headers)


async def _read_submission(request: web.Request) -> tuple[dict[str, Any], dict[str, bytes]]:
    """(the JSON document, raw input bytes) from a JSON or multipart body."""
    inputs: dict[str, bytes] = {}
    if request.content_type.startswith("multipart/"):
        doc: dict[str, Any] | None = None
        reader = await request.multipart()
        async for part in reader:
            if part.name == "request":
                try:
                    doc = json.loads(await part.text())
                except ValueError as exc:
                    raise BadRequest("request", f"the request part is not JSON: {exc}") from None
            elif part.name:
                inputs[part.name] = bytes(await part.read())
        if doc is None:
            raise BadRequest("request", "multipart submissions need a 'request' JSON part")
    else:
        try:
            doc = await request.json()
        except ValueError as exc:
            raise BadRequest("body", f"body is not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise BadRequest("body", "the request must be a JSON object")
    raw = doc.get("inputs") or {}
    if not isinstance(raw, dict):
        raise BadRequest("inputs", "inputs must map names to base64 strings")
    for name, value in raw.items():
        try:
            inputs[name] = base64.b64decode(str(value), validate=True)
        except (binascii.Error, ValueError):
            raise BadRequest(name, f"input {name!r} is not valid base64") from None
    return doc, inputs


def _validate(doc: dict[str, Any], inputs: dict[str, bytes]) -> tuple[Any, dict[str, Any], float | None, int]:
    """(spec, resolved params, absolute deadline, priority); raises BadRequest / InvalidRequest."""
    spec = request_workflow(doc.get("workflow"))
    params = doc.get("params") or {}
    if not isinstance(params, dict):
        raise BadRequest("params", "params must be an object")
    resolved = spec.validate_request(params, inputs)
    if "image" in inputs:
        _check_image(inputs["image"])
    deadline_s = doc.get("deadline_s")
    if deadline_s is not None and (isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float))
                                   or deadline_s <= 0):
        raise BadRequest("deadline_s", "deadline_s must be a positive number of seconds")
    priority = doc.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise BadRequest("priority", "priority must be an integer")
    return spec, resolved, (time.time() + float(deadline_s)) if deadline_s else None, priority


def _check_image(data: bytes) -> None:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.verify()
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise BadRequest("image", f"image is not a readable image file: {exc}") from None


async def submit(request: web.Request) -> web.Response:
    app = request.app
    store, routes = app[STORE], app[ROUTES]
    try:
        doc, inputs = await _read_submission(request)
        spec, params, deadline, priority = _validate(doc, inputs)
    except BadRequest as exc:
        return _error(400, str(exc), exc.field)
    except InvalidRequest as exc:
        return _error(400, str(exc), exc.field)
    uid = uuid.uuid4().hex
    cost = spec.estimate_gpu_seconds(params)
    route = spec.route()
    stage_routes = await asyncio.to_thread(lambda: [routes.candidates(spec.name, s) for s in route])
    try:
        inflight, inflight_cost = await asyncio.to_thread(store.inflight, spec.name)
    except Exception as exc:  # Redis unreachable: an overload answer, never a 500
        return _error(503, f"the result store is unavailable: {exc}", headers={"Retry-After": "5"})
    load = Load(inflight, inflight_cost, sum(len(r) for r in stage_routes), len(stage_routes[0]),
                routes.capacity(spec.name))
    decision = app[MONITOR].decide(load, cost, time.time(), deadline)
    if not decision.admit:
        return _error(503, decision.reason, headers={"Retry-After": str(decision.retry_after)})
    header = wm.Header(uid=uid, workflow=spec.name, stage=route[0], route=route, deadline=deadline,
                       priority=priority, params=params, timestamps={"proxy": time.time()})
    message = wm.encode(header, {}, inputs)
    try:  # kept with the job until it finishes: a job whose node is lost starts again from it
        await asyncio.to_thread(store.accept, uid, spec.name, cost, "", message)
    except Exception as exc:  # Redis unreachable: an overload answer, never a 500
        return _error(503, f"the result store is unavailable: {exc}", headers={"Retry-After": "5"})
    try:
        target = await app[INJECTOR].inject(spec.name, route[0], message, spec.estimate_cost(params).get(route[0], 0.0))
        await asyncio.to_thread(store.located, uid, target.node, target.instance)
        app[ACCEPTED][spec.name] = app[ACCEPTED].get(spec.name, 0) + 1
    except Exception as exc:  # any send failure is an overload answer
        await asyncio.to_thread(store.finish, uid, spec.name, keys.FAILED, route[0],
                                f"could not enter {route[0]}: {exc}")
        return _error(503, f"could not hand the request to {route[0]}: {exc}", headers={"Retry-After": "1"})
    return web.json_response({"uid": uid, "state": keys.QUEUED, "workflow": spec.name, "cost_gpu_s": cost,
                              "predicted_wait_s": decision.predicted_wait_s, "instance": target.instance,
                              "deadline": deadline}, status=202)


def _uid(request: web.Request) -> str | None:
    uid = request.match_info["uid"]
    return uid if len(uid) == 32 and all(c in "0123456789abcdef" for c in uid) else None


async def _lookup(request: web.Request) -> tuple[str, Any] | web.Response:
    """(uid, status) of the request the path names, or the 404 answer."""
    uid = _uid(request)
    st = await asyncio.to_thread(request.app[STORE].status, uid) if uid else None
    if st is None or uid is None:
        return _error(404, "unknown or expired request")
    return uid, st


MAX_WAIT_S = 60.0


async def status(request: web.Request) -> web.Response:
    """The request's status; with ``?wait=S`` (at most 60), answered once it is finished or S seconds
    passed: one HTTP round trip instead of a client polling loop (which, at a few ms, costs the host
    more CPU than the stages it waits for)."""
    found = await _lookup(request)
    if isinstance(found, web.Response):
        return found
    uid, st = found
    raw = request.query.get("wait")
    if raw is not None and not st.terminal:
        try:
            wait = float(raw)
            if not 0 <= wait <= MAX_WAIT_S:
                raise ValueError
        except ValueError:
            return _error(400, f"wait must be a number of seconds in [0, {MAX_WAIT_S:.0f}]", "wait")
        store, deadline, pause = request.app[STORE], time.monotonic() + wait, 0.001
        while not st.terminal and time.monotonic() < deadline:
            await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
            pause = min(pause * 1.5, 0.02)
            st = await asyncio.to_thread(store.status, uid) or st
    return web.json_response(st.as_dict())


async def cancel(request: web.Request) -> web.Response:
    found = await _lookup(request)
    if isinstance(found, web.Response):
        return found
    uid, st = found
    if st.terminal:
        return web.json_response({"uid": uid, "state": st.state, "error": "request already finished"}, status=409)
    await asyncio.to_thread(request.app[STORE].request_cancel, uid)
    return web.json_response({"uid": uid, "state": st.state, "cancel_requested": True}, status=202)


async def result(request: web.Request) -> web.Response:
    found = await _lookup(request)
    if isinstance(found, web.Response):
        return found
    uid, st = found
    store = request.app[STORE]
    if st.state != keys.COMPLETED:
        return web.json_response({"uid": uid, "state": st.state, "error": "no result"}, status=409)
    data = await asyncio.to_thread(store.result, uid)
    if data is None:
        return _error(410, "the result expired")
    output = get_workflow(st.workflow).final_output
    return web.Response(body=data, content_type=CONTENT_TYPES.get(output, "application/octet-stream"))


async def livez(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    checks: dict[str, str] = {}
    try:
        await asyncio.to_thread(request.app[STORE].r.ping)
        checks["redis"] = "ok"
    except Exception as exc:  # reported, not raised
        checks["redis"] = f"error: {exc}"
    routes = request.app[ROUTES]
    for name, spec in sorted(workflows().items()):
        found = await asyncio.to_thread(routes.candidates, name, spec.route()[0])
        checks[f"routes:{name}"] = "ok" if found else "none"
    ok = checks["redis"] == "ok"
    return web.json_response({"status": "ok" if ok else "unavailable", "checks": checks}, status=200 if ok else 503)


async def _poll_producers(app: web.Application) -> None:
    while True:
        await asyncio.sleep(0.5)
        try:
            await app[INJECTOR].poll()
        except Exception:  # retried on the next round
            pass


async def _sweep_orphans(sweeper: OrphanSweeper, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            await sweeper.sweep()
        except Exception:  # Redis or etcd down: retried on the next round
            log.exception("orphan sweep failed")


async def _register(app: web.Application, workflow_set: str, name: str, url: str, interval: float = 1.0) -> None:
    """Keep this Proxy registered in its Workflow Set with what it accepts per second (the Node Manager's
    measure of the set's load); the registration goes with the lease when the Proxy does."""
    from engine.manager.sets import register_proxy

    client, lease, rates = app[ROUTES].client, None, {}
    last, t_last = dict(app[ACCEPTED]), time.monotonic()
    while True:
        try:
            if lease is None:
                lease = await asyncio.to_thread(client.lease, max(3, int(4 * interval)))
            now, counts = time.monotonic(), dict(app[ACCEPTED])
            for w, n in counts.items():
                rate = (n - last.get(w, 0)) / max(now - t_last, 1e-3)
                rates[w] = 0.5 * rates.get(w, rate) + 0.5 * rate
            last, t_last = counts, now
            await asyncio.to_thread(register_proxy, client, workflow_set, name, url, rates, lease)
            await asyncio.to_thread(lease.refresh)
        except Exception as exc:  # etcd unreachable: registered again on the next round
            log.warning("proxy registration failed: %s", exc)
            lease = None
        await asyncio.sleep(interval)


def make_app(store: JobStore, routes: RouteTable, injector: Injector, monitor: RequestMonitor,
             sweep_interval: float = 1.0, max_attempts: int = 3,
             registration: tuple[str, str, str] | None = None) -> web.Application:
    """The Proxy; every ``sweep_interval`` seconds it restarts jobs lost with a dead node
    (engine.proxy.recovery), at most ``max_attempts`` starts per job. With ``registration``
    (Workflow Set, name, URL) it registers itself for the Node Manager and the platform's choice of Proxy."""
    app = web.Application(client_max_size=MAX_BODY)
    app[ACCEPTED] = {}
    sweeper = OrphanSweeper(store, routes.client, injector, max_attempts)
    app[STORE], app[ROUTES], app[INJECTOR], app[MONITOR] = store, routes, injector, monitor
    app.router.add_post("/v1/requests", submit)
    app.router.add_get("/v1/requests/{uid}", status)
    app.router.add_delete("/v1/requests/{uid}", cancel)
    app.router.add_get("/v1/requests/{uid}/result", result)
    app.router.add_get("/livez", livez)
    app.router.add_get("/readyz", readyz)

    async def _background(app: web.Application) -> Any:
        tasks = [asyncio.create_task(_poll_producers(app)),
                 asyncio.create_task(_sweep_orphans(sweeper, sweep_interval))]
        if registration is not None:
            tasks.append(asyncio.create_task(_register(app, *registration)))
        yield
        for task in tasks:
            task.cancel()

    app.cleanup_ctx.append(_background)
    return app
