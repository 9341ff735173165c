"""The Proxy's HTTP routes (aiohttp): requests and responses only; the rest is engine.proxy's.

Routes:
  POST   /v1/requests               submit: JSON ``{"workflow", "params", "inputs": {name: base64},
                                    "deadline_s", "priority"}`` or multipart with a ``request``
                                    JSON part and one file part per input; 202 ``{"uid", ...}``
  GET    /v1/requests/{uid}         status (state, stage, progress 0-100, detail); ``?wait=S``: answered
                                    when the request finishes or after S seconds (at most 60)
  DELETE /v1/requests/{uid}         cancel: 202; the running stage stops at its next step
  GET    /v1/requests/{uid}/result  the result bytes (png, mp4); with an object store, also for a job
                                    Redis no longer knows
  GET    /v1/requests/{uid}/result/url  a presigned GET from the object store (engine.proxy.result_url)
  DELETE /v1/requests/{uid}/result  drop the result bytes now instead of at their TTL (a deleted video):
                                    200 {"uid", "dropped": bool}; 409 while the job runs (cancel it first)
  GET    /livez, /readyz            health

Every route but /livez and /readyz needs the Proxy's shared secret (engine.proxy.auth).

Order of work on submit, and why: a refusal must cost less than an acceptance,
so what can be decided without the body is decided first (credential, the
declared size, whether the named workflow, ``?workflow=``, or any workflow has
room: 503 + Retry-After with nothing read). Then the body is read, bounded as
it streams, and parsed and validated against the workflow spec off the event
loop (400/413 naming the field; :class:`engine.proxy.intake.Intake`). The rest
is :meth:`engine.proxy.intake.Intake.admit`, the one admission order the
in-process engine client runs too, on this Proxy's ports
(:class:`engine.proxy.state.ProxyState`): the message must fit the first
stage's ring (413 naming the largest input); the claim check of a caller's UID
(409), the admission decision with its cost and deadline (503, at once,
nothing queued) and the acceptance in one trip off the loop; an accepted
request is recorded (``accepted`` event) before it enters the first stage's
ring, so no worker ever sees a UID the store does not know. This module only
translates: the exceptions into 400/409/413/503 answers, the admission into the
202. The background loops are engine.proxy.loops.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aiohttp import web

from engine.coord.routes import RouteTable
from engine.proxy import auth, deadlines, eta, loops, preview, result_url, stream
from engine.proxy.answers import CONTENT_TYPES, busy, error, store_down
from engine.proxy.injector import Injector
from engine.proxy.intake import Intake, Overloaded, Ticket
from engine.proxy.monitor import RequestMonitor
from engine.proxy.parsing import BadRequest
from engine.proxy.state import MAX_BODY, Limits, ProxyState
from engine.store import JobStore, keys, outage
from engine.store.objects import ObjectStoreError, sniff_content_type
from engine.workflow import get_workflow, workflows

__all__ = ["MAX_BODY", "STATE", "Limits", "make_app"]

T = TypeVar("T")
log = logging.getLogger("onepiece.proxy")

STATE = web.AppKey("state", ProxyState)  # the store, the caches, the book: engine.proxy.state
ETA_HEADER = eta.HEADER  # on submit and status answers of unfinished jobs: eta.Estimate.header()


async def workflow_list(request: web.Request) -> web.Response:
    """Every workflow's parameters as the loaded models allow them (defaults, bounds, and why a bound is
    tighter than the spec's): what the web platform checks and fills requests with."""
    state, out = request.app[STATE], {}
    for name in sorted(workflows()):
        spec = state.intake.spec(name)
        fits = {stage: {"runs": f.n, "largest_units": f.u_max} for (wf, stage), f in state.pricer.fits.items()
                if wf == name}
        out[name] = {"params": {p.name: {"default": p.default, "minimum": p.minimum, "maximum": p.maximum,
                                         "why": p.why} for p in spec.params},
                     "limits": state.routes.limits(name) or {},
                     "priced_stages": fits}
    return web.json_response({"workflows": out})


async def _pre_admit(request: web.Request) -> web.Response | None:
    """The refusal of a request that cannot be admitted whatever its body says, decided from headers and
    the queue state alone (nothing read, nothing decoded): a body over the limit, intake memory in use, or
    no named workflow (``?workflow=``; else none at all) with room in its queue."""
    state = request.app[STATE]
    length = request.content_length
    if length is not None and length > state.limits.max_body:
        resp = error(413, f"request body of {length} bytes is over the limit of {state.limits.max_body}", "body")
        resp.force_close()
        return resp
    hint = request.query.get("workflow")
    names = [hint] if hint in workflows() else sorted(workflows())
    loads = state.cached_loads(names)
    if loads is None:
        try:
            loads = await asyncio.to_thread(state.loads, names)
        except Exception as exc:  # Redis unreachable: an overload answer, never a 500
            return busy(f"the result store is unavailable: {exc}", 5)
    decision = state.intake.room(loads, time.time())
    return None if decision.admit else busy(decision.reason, decision.retry_after, request)


async def _read_body(request: web.Request) -> bytes:
    """The body, counted as it streams (a chunked body has no Content-Length to check in advance)."""
    try:
        return await request.read()  # aiohttp stops at client_max_size with 413
    except web.HTTPRequestEntityTooLarge:
        raise BadRequest("body", f"request body is over the limit of {request.app[STATE].limits.max_body} bytes",
                         413) from None


def _parsed_ticket(intake: Intake, body: bytes, content_type: str) -> Ticket:
    return intake.ticket(intake.parse(body, content_type))


async def submit(request: web.Request) -> web.Response:
    """Order of work: the cheap refusals first (credential, declared size, queue state: nothing read), then
    the body, bounded as it streams, parsed and validated off the event loop; then the one admission order
    (:meth:`engine.proxy.intake.Intake.admit`, on this Proxy's ports) and the 202."""
    state = request.app[STATE]
    refused = await _pre_admit(request)
    if refused is not None:
        return refused
    limits = state.limits
    reserve = request.content_length if request.content_length is not None else limits.max_body
    if limits.reading + reserve > limits.intake_bytes:
        return busy("intake is busy reading other requests", 1)
    limits.reading += reserve
    try:
        body = await _read_body(request)
        ctype = request.headers.get("Content-Type", "")
        # parsed, validated and made a message in one trip off the loop (each trip costs the CPU a handoff)
        ticket = await asyncio.to_thread(_parsed_ticket, state.intake, body, ctype)
        del body
    except BadRequest as exc:
        return error(exc.status, str(exc), exc.field)
    finally:
        limits.reading -= reserve
    try:
        admitted = await state.intake.admit(ticket, state)
    except BadRequest as exc:
        return error(exc.status, str(exc), exc.field)
    except Overloaded as exc:
        return busy(exc.decision.reason, exc.decision.retry_after, request)
    estimate = admitted.estimate
    return web.json_response({"uid": ticket.uid, "state": keys.QUEUED, "workflow": ticket.sub.spec.name,
                              "cost_gpu_s": ticket.cost, "predicted_wait_s": admitted.decision.predicted_wait_s,
                              "instance": admitted.instance, "deadline": ticket.sub.deadline,
                              **estimate.as_dict()}, status=202, headers={ETA_HEADER: estimate.header()})


def _status_response(app: web.Application, st: Any) -> web.Response:
    """The status; an unfinished job's with its ETA (eta_s, eta_p90_s, provisional, queue_ahead) and the
    ``OnePiece-ETA`` header."""
    body = st.as_dict()
    if st.terminal:
        return web.json_response(body)
    estimate = app[STATE].status_estimate(st)
    return web.json_response({**body, **estimate.as_dict()}, headers={ETA_HEADER: estimate.header()})


def _uid(request: web.Request) -> str | None:
    uid = request.match_info["uid"]
    return uid if len(uid) == 32 and all(c in "0123456789abcdef" for c in uid) else None


async def _lookup(request: web.Request) -> tuple[str, Any] | web.Response:
    """(uid, status) of the request the path names, or the 404 answer (503 while Redis is away)."""
    uid = _uid(request)
    try:
        st = await asyncio.to_thread(request.app[STATE].store.status, uid) if uid else None
    except outage.UNAVAILABLE as exc:
        return store_down(exc)
    if st is None or uid is None:
        return error(404, "unknown or expired request")
    return uid, st


Handler = Callable[[web.Request], Awaitable[web.Response]]
JobHandler = Callable[[web.Request, str, Any], Awaitable[web.Response]]


def _job_route(handler: JobHandler) -> Handler:
    """The route of the job the path names, called with its (uid, status) once it is found (404 when it is
    not); answers 503 + Retry-After when Redis goes away between its lookup and its own store call (a
    stopped or restarting Redis is a moment's overload, never a 500)."""
    @functools.wraps(handler)
    async def guarded(request: web.Request) -> web.Response:
        found = await _lookup(request)
        if isinstance(found, web.Response):
            return found
        try:
            return await handler(request, *found)
        except outage.UNAVAILABLE as exc:
            return store_down(exc)

    return guarded


MAX_WAIT_S = 60.0


RECHECK_S, RECHECK_MAX_S = 1.0, 8.0  # a long poll's own status reads: after 1 s, doubling up to every 8 s


async def _wait_terminal(app: web.Application, uid: str, st: Any, wait: float) -> Any:
    """The job's status once it is terminal or ``wait`` seconds passed. Woken by the terminal event
    (:func:`engine.proxy.loops.watch_endings` reads the endings stream once for every waiter of this Proxy), so a waiter
    costs nothing while it waits and hears of the end within a millisecond. In case an event was missed (a
    Redis restart, a trimmed stream) the status is read again after 1 s, then 2, 4 and every 8 s: a read a
    second per waiter was the Proxy's largest CPU cost per request under load (a client's 30 s poll read
    the status 31 times; now 7). A job whose end the stream already showed (before this waiter listened) is
    in the Proxy's recent ends: its status is read at once; one that ends later wakes the waiter, so no read
    is needed before the wait."""
    store, endings = app[STATE].store, app[STATE].endings
    entry = endings.setdefault(uid, [asyncio.Event(), 0])  # [event, waiters]: several polls may wait on one job
    entry[1] += 1
    ended = entry[0]
    deadline = time.monotonic() + wait
    async def read(st: Any) -> Any:
        try:
            return await asyncio.to_thread(store.status, uid) or st
        except Exception as exc:  # Redis away: answer what is known when the wait ends, never a 500
            log.warning("status of %s unreadable during a long poll: %s", uid, exc)
            return st

    try:
        if uid in app[STATE].recent_ends:  # it ended before we listened: its end was read, so read its status
            st = await read(st)
        pause = RECHECK_S
        while not st.terminal and (left := deadline - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(ended.wait(), min(pause, left))
            except TimeoutError:
                pass
            st = await read(st)
            pause = min(2 * pause, RECHECK_MAX_S)
    finally:
        entry[1] -= 1
        if entry[1] == 0 and endings.get(uid) is entry:
            del endings[uid]
    return st


@_job_route
async def status(request: web.Request, uid: str, st: Any) -> web.Response:
    """The request's status; with ``?wait=S`` (at most 60), answered once it is finished or S seconds
    passed: one HTTP round trip instead of a client polling loop (which, at a few ms, costs the host
    more CPU than the stages it waits for)."""
    raw = request.query.get("wait")
    if raw is not None and not st.terminal:
        try:
            wait = float(raw)
            if not 0 <= wait <= MAX_WAIT_S:
                raise ValueError
        except ValueError:
            return error(400, f"wait must be a number of seconds in [0, {MAX_WAIT_S:.0f}]", "wait")
        st = await _wait_terminal(request.app, uid, st, wait)
    return _status_response(request.app, st)


@_job_route
async def cancel(request: web.Request, uid: str, st: Any) -> web.Response:
    if st.terminal:
        return web.json_response({"uid": uid, "state": st.state, "error": "request already finished"}, status=409)
    await asyncio.to_thread(request.app[STATE].store.request_cancel, uid)
    # out of the ETA's line now (the stage that holds it drops it only when it reaches it, and until then the
    # jobs behind it would count it ahead of them); it stays in the book until it ends
    request.app[STATE].book.cancelling(uid)
    return web.json_response({"uid": uid, "state": st.state, "cancel_requested": True}, status=202)


async def result(request: web.Request) -> web.Response:
    """The result's bytes. With an object store, also for a job Redis no longer knows (restarted, expired):
    its output is found in the store by the UID. The status and the bytes are read in one trip off the loop."""
    store, uid = request.app[STATE].store, _uid(request)
    if uid is None:
        return error(404, "unknown or expired request")

    def read() -> tuple[Any, bytes | None]:
        st = store.status(uid)
        if st is not None and st.state != keys.COMPLETED:
            return st, None
        if st is None and store.objects is None:
            return None, None
        return st, store.result(uid)

    got = await _read_result(read)
    if isinstance(got, web.Response):
        return got
    st, data = got
    if st is None:
        return error(404, "unknown or expired request") if data is None else \
            web.Response(body=data, content_type=sniff_content_type(data))
    if st.state != keys.COMPLETED:
        return web.json_response({"uid": uid, "state": st.state, "error": "no result"}, status=409)
    if data is None:
        return error(410, "the result expired")
    output = get_workflow(st.workflow).final_output
    return web.Response(body=data, content_type=CONTENT_TYPES.get(output, "application/octet-stream"))


async def _read_result(read: Callable[[], T]) -> T | web.Response:
    """``read()`` off the loop (the result's bytes, with its status), or the 503 that Redis or the object
    store being away answers."""
    try:
        return await asyncio.to_thread(read)
    except outage.UNAVAILABLE as exc:
        return store_down(exc)
    except ObjectStoreError as exc:
        return busy(f"the object store is unavailable: {exc}", outage.RETRY_AFTER_S)


@_job_route
async def drop_result(request: web.Request, uid: str, st: Any) -> web.Response:
    if not st.terminal:  # its result is still to come: dropping now would not stop it from being written
        return web.json_response({"uid": uid, "state": st.state, "error": "request not finished"}, status=409)
    dropped = await asyncio.to_thread(request.app[STATE].store.drop_results, [uid])
    return web.json_response({"uid": uid, "dropped": bool(dropped)})


async def livez(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    checks: dict[str, str] = {}
    try:
        await asyncio.to_thread(request.app[STATE].store.r.ping)
        checks["redis"] = "ok"
    except Exception as exc:  # reported, not raised
        checks["redis"] = f"error: {exc}"
    routes = request.app[STATE].routes
    for name, spec in sorted(workflows().items()):
        found = await asyncio.to_thread(routes.candidates, name, spec.route()[0])
        checks[f"routes:{name}"] = "ok" if found else "none"
    ok = checks["redis"] == "ok"
    return web.json_response({"status": "ok" if ok else "unavailable", "checks": checks}, status=200 if ok else 503)


def make_app(store: JobStore, routes: RouteTable, injector: Injector, monitor: RequestMonitor,
             sweep_interval: float = 1.0, max_attempts: int = 3,
             registration: tuple[str, str, str] | None = None, *, token: str,
             limits: Limits | None = None) -> web.Application:
    """The Proxy; callers present ``token`` (engine.proxy.auth; ``ValueError`` if it is too weak). Every
    ``sweep_interval`` seconds it restarts jobs lost with a dead node (engine.proxy.recovery), at most
    ``max_attempts`` starts per job, and drops in-flight entries of jobs that are gone or finished. With
    ``registration`` (Workflow Set, name, URL) it registers itself for the Node Manager and the platform's
    choice of Proxy."""
    limits = limits or Limits()
    # the credential first (nothing read for a stranger), then the body's read deadline (engine.proxy.deadlines)
    app = web.Application(client_max_size=limits.max_body,
                          middlewares=[auth.middleware(token), deadlines.body_deadline()])
    app[STATE] = state = ProxyState.build(store, routes, injector, monitor, limits)
    app.router.add_get("/v1/workflows", workflow_list)
    app.router.add_post("/v1/requests", submit)
    app.router.add_get("/v1/requests/{uid}", status)
    app.router.add_delete("/v1/requests/{uid}", cancel)
    app.router.add_get("/v1/requests/{uid}/result", result)
    app.router.add_delete("/v1/requests/{uid}/result", drop_result)
    stream.install(app, store)  # ?stream=true on the result route: the fragments as they come
    preview.install(app, store)  # GET /v1/requests/{uid}/preview: the latest live preview
    result_url.install(app, store)  # GET /v1/requests/{uid}/result/url: a presigned GET from the object store
    app.router.add_get("/livez", livez)
    app.router.add_get("/readyz", readyz)
    app.cleanup_ctx.append(loops.background(state, sweep_interval, max_attempts, registration))
    return app
