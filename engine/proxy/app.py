"""The Proxy's HTTP intake (aiohttp).

Routes:
  POST   /v1/requests               submit: JSON ``{"workflow", "params", "inputs": {name: base64},
                                    "deadline_s", "priority"}`` or multipart with a ``request``
                                    JSON part and one file part per input; 202 ``{"uid", ...}``
  GET    /v1/requests/{uid}         status (state, stage, progress 0-100, detail); ``?wait=S``: answered
                                    when the request finishes or after S seconds (at most 60)
  DELETE /v1/requests/{uid}         cancel: 202; the running stage stops at its next step
  GET    /v1/requests/{uid}/result  the result bytes (png, mp4)
  DELETE /v1/requests/{uid}/result  drop the result bytes now instead of at their TTL (a deleted video):
                                    200 {"uid", "dropped": bool}; 409 while the job runs (cancel it first)
  GET    /livez, /readyz            health

Every route but /livez and /readyz needs the Proxy's shared secret (engine.proxy.auth).

Order of work on submit, and why: a refusal must cost less than an acceptance,
so what can be decided without the body is decided first (credential, the
declared size, whether the named workflow, ``?workflow=``, or any workflow has
room: 503 + Retry-After with nothing read). Then the body is read, bounded as
it streams; the rest is the one :class:`engine.proxy.intake.Intake` the
in-process engine client uses too, run off the event loop where it computes or
reads the store: parsed and validated against the workflow spec (400/413
naming the field); only then is a UID drawn (or the caller's taken), its cost
estimated and admission decided with its cost and deadline (503, at once,
nothing queued); the message must fit the first stage's ring (413 naming the
largest input); an accepted request is recorded (``accepted`` event) before it
enters the first stage's ring, so no worker ever sees a UID the store does not
know.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from engine.proxy import auth, deadlines, eta, preview
from engine.proxy.drain import DrainMeter
from engine.proxy.injector import Injector
from engine.proxy.intake import BadRequest, Intake, Ticket, taken
from engine.proxy.monitor import Decision, Load, RequestMonitor
from engine.proxy.recovery import OrphanSweeper
from engine.store import JobStore, keys, outage
from engine.transport.errors import MessageTooLarge
from engine.worker.routes import RouteTable
from engine.workflow import get_workflow, images, workflows
from engine.workflow.pricing import Fit, Pricer

log = logging.getLogger("onepiece.proxy")

# A submission's body: the largest input image (base64) plus its parameters.
MAX_BODY = images.MAX_BYTES * 4 // 3 + (1 << 20)
CONTENT_TYPES = {"image": "image/png", "video": "video/mp4"}

STORE = web.AppKey("store", JobStore)
INJECTOR = web.AppKey("injector", Injector)
ROUTES = web.AppKey("routes", RouteTable)
INTAKE = web.AppKey("intake", Intake)
ACCEPTED = web.AppKey("accepted", dict)  # workflow -> requests accepted since start
DRAIN = web.AppKey("drain", DrainMeter)  # what the engine finishes per second (sampled in the background)
DRAIN_SAMPLE_S = 0.25  # how often the drain meter samples the store's counters
ADMITTING = web.AppKey("admitting", dict)  # workflow -> asyncio.Lock held from the count read to acceptance
ENDINGS = web.AppKey("endings", dict)  # uid -> asyncio.Event set when the job's terminal event is seen
PRICER = web.AppKey("pricer", Pricer)  # stage fits the instances published: a request's seconds of work here
PRICE_REFRESH_S = 2.0
BOOK = web.AppKey("book", eta.Book)  # the jobs this Proxy accepted and has not seen end: their place in line
HISTORIES = web.AppKey("histories", dict)  # (workflow, priority) -> eta.History of its finished jobs
BOOK_PRUNE_S = 5.0  # how often the book drops jobs whose end it missed (one store read per workflow)
ETA_HEADER = eta.HEADER  # on submit and status answers of unfinished jobs: eta.Estimate.header()


@dataclass
class Limits:
    """Bounds on what one request, and all requests being read at once, may cost the Proxy."""

    max_body: int = MAX_BODY
    intake_bytes: int = 4 * MAX_BODY  # bodies being read and parsed at once (declared sizes)
    max_image_bytes: int = images.MAX_BYTES
    max_image_pixels: int = images.MAX_PIXELS
    reading: int = 0  # bytes reserved by the bodies being read now (event-loop only: no lock)


LIMITS = web.AppKey("limits", Limits)


def _error(status: int, message: str, field: str = "", headers: dict[str, str] | None = None) -> web.Response:
    body: dict[str, Any] = {"error": message}
    if field:
        body["field"] = field
    return web.json_response(body, status=status, headers=headers)


KEEP_ALIVE_BODY = 64 << 10  # a refused body at most this large is drained to keep the connection alive


def _busy(reason: str, retry_after: int, request: web.Request | None = None) -> web.Response:
    """503 with Retry-After. A refused body is not read: a large or undeclared one closes the connection
    (never drained), while a small declared one keeps it alive, so a client retrying on its
    connection does not pay a new handshake for every refusal."""
    resp = _error(503, reason, headers={"Retry-After": str(max(1, retry_after))})
    length = request.content_length if request is not None else None
    if length is None or length > KEEP_ALIVE_BODY:
        resp.force_close()  # a Connection header alone would still have aiohttp read the body to its end
    return resp


def _instances(routes: RouteTable, name: str) -> tuple[int, int]:
    """(published instances across the workflow's stages, of its first stage), from the route cache."""
    stage_routes = [routes.candidates(name, s) for s in get_workflow(name).route()]
    return sum(len(r) for r in stage_routes), len(stage_routes[0])


def _load(app: web.Application, name: str, inflight: int, inflight_cost: float) -> Load:
    routes = app[ROUTES]
    instances, entry = _instances(routes, name)
    return Load(inflight, inflight_cost, instances, entry, routes.capacity(name),
                app[DRAIN].rate(name, time.monotonic()), routes.base_latency(name))


def _loads(app: web.Application, names: list[str]) -> dict[str, Load]:
    """What the Request Monitor needs about each workflow (blocking: route cache and one Redis read each)."""
    return {name: _load(app, name, *app[STORE].inflight(name)) for name in names}


def _cached_loads(app: web.Application, names: list[str]) -> dict[str, Load] | None:
    """The same from the drain meter's last sample (at most a second old), without any I/O: what a
    refusal is decided on, so that refusing costs the event loop microseconds. None when stale."""
    meter, now, out = app[DRAIN], time.monotonic(), {}
    for name in names:
        last = meter.latest.get(name)
        if last is None or now - last.t > 4 * DRAIN_SAMPLE_S:
            return None
        out[name] = _load(app, name, last.inflight, 0.0)
    return out


async def _sample_drain(app: web.Application) -> None:
    """Feed the drain meter: every workflow's in-flight and finished counts, a few times a second."""
    store, routes, meter = app[STORE], app[ROUTES], app[DRAIN]
    names = sorted(workflows())
    while True:
        try:
            counts = await asyncio.to_thread(store.drain_sample, names)
            now = time.monotonic()
            for name, (inflight, finished) in counts.items():
                meter.record(name, now, inflight, finished, _instances(routes, name)[0])
        except Exception as exc:  # Redis unreachable: decisions fall back to reading the store
            log.warning("drain sample failed: %s", exc)
        await asyncio.sleep(DRAIN_SAMPLE_S)


def _published_fits(app: web.Application) -> dict[tuple[str, str], list[Fit]]:
    """(workflow, stage) -> the pricing fits its routed instances published (blocking: one Redis round trip)."""
    routes = app[ROUTES]
    where = {(r.instance, name): stage for name, spec in workflows().items() for stage in spec.route()
             for r in routes.candidates(name, stage)}
    out: dict[tuple[str, str], list[Fit]] = {}
    for (instance, name), raw in app[STORE].price_fits(where).items():
        fit = Fit.from_json(raw)
        if fit is not None:
            out.setdefault((name, where[instance, name]), []).append(fit)
    return out


async def _refresh_prices(app: web.Application) -> None:
    """Keep the pricer current with what the instances measured (every couple of seconds)."""
    while True:
        try:
            app[PRICER].update(await asyncio.to_thread(_published_fits, app))
        except Exception as exc:  # Redis away: the last fits are kept
            log.warning("reading the stage fits failed: %s", exc)
        await asyncio.sleep(PRICE_REFRESH_S)


async def workflow_list(request: web.Request) -> web.Response:
    """Every workflow's parameters as the loaded models allow them (defaults, bounds, and why a bound is
    tighter than the spec's): what the web platform checks and fills requests with."""
    intake, out = request.app[INTAKE], {}
    for name in sorted(workflows()):
        spec = intake.spec(name)
        fits = {stage: {"runs": f.n, "largest_units": f.u_max} for (wf, stage), f in request.app[PRICER].fits.items()
                if wf == name}
        out[name] = {"params": {p.name: {"default": p.default, "minimum": p.minimum, "maximum": p.maximum,
                                         "why": p.why} for p in spec.params},
                     "limits": request.app[ROUTES].limits(name) or {},
                     "priced_stages": fits}
    return web.json_response({"workflows": out})


async def _pre_admit(request: web.Request) -> web.Response | None:
    """The refusal of a request that cannot be admitted whatever its body says, decided from headers and
    the queue state alone (nothing read, nothing decoded): a body over the limit, intake memory in use, or
    no named workflow (``?workflow=``; else none at all) with room in its queue."""
    app = request.app
    length = request.content_length
    if length is not None and length > app[LIMITS].max_body:
        resp = _error(413, f"request body of {length} bytes is over the limit of {app[LIMITS].max_body}", "body")
        resp.force_close()
        return resp
    hint = request.query.get("workflow")
    names = [hint] if hint in workflows() else sorted(workflows())
    loads = _cached_loads(app, names)
    if loads is None:
        try:
            loads = await asyncio.to_thread(_loads, app, names)
        except Exception as exc:  # Redis unreachable: an overload answer, never a 500
            return _busy(f"the result store is unavailable: {exc}", 5)
    decision = app[INTAKE].room(loads, time.time())
    return None if decision.admit else _busy(decision.reason, decision.retry_after, request)


async def _read_body(request: web.Request) -> bytes:
    """The body, counted as it streams (a chunked body has no Content-Length to check in advance)."""
    try:
        return await request.read()  # aiohttp stops at client_max_size with 413
    except web.HTTPRequestEntityTooLarge:
        raise BadRequest("body", f"request body is over the limit of {request.app[LIMITS].max_body} bytes",
                         413) from None


def _parsed_ticket(intake: Intake, body: bytes, content_type: str) -> Ticket:
    return intake.ticket(intake.parse(body, content_type))


async def submit(request: web.Request) -> web.Response:
    """Order of work: the cheap refusals first (credential, declared size, queue state: nothing read), then
    the body, bounded as it streams, parsed and validated off the event loop; then the admission decision
    with the request's cost and deadline; then the store and the ring."""
    app = request.app
    refused = await _pre_admit(request)
    if refused is not None:
        return refused
    reserve = request.content_length if request.content_length is not None else app[LIMITS].max_body
    if app[LIMITS].reading + reserve > app[LIMITS].intake_bytes:
        return _busy("intake is busy reading other requests", 1)
    app[LIMITS].reading += reserve
    try:
        body = await _read_body(request)
        intake, ctype = app[INTAKE], request.headers.get("Content-Type", "")
        # parsed, validated and made a message in one trip off the loop (each trip costs the CPU a handoff)
        ticket = await asyncio.to_thread(_parsed_ticket, intake, body, ctype)
        del body
    except BadRequest as exc:
        return _error(exc.status, str(exc), exc.field)
    finally:
        app[LIMITS].reading -= reserve
    return await _admit(request, ticket)


async def _admit(request: web.Request, ticket: Ticket) -> web.Response:
    """:meth:`Intake.submit`'s steps on the event loop: the ring's limit, the admission decision, the
    acceptance and the injection."""
    app = request.app
    intake, store, spec, uid = app[INTAKE], app[STORE], ticket.sub.spec, ticket.uid
    try:
        intake.check_fits(ticket, await app[INJECTOR].max_message(spec.name, ticket.entry), app[ROUTES].max_message)
    except BadRequest as exc:
        return _error(exc.status, str(exc), exc.field)
    # One decision at a time per workflow: concurrent submits must not all be admitted on the same
    # in-flight count (a burst would overshoot the queue bound and the deadline rule); the lock covers
    # the read, the decision and the acceptance, which moves the count.
    async with app[ADMITTING].setdefault(spec.name, asyncio.Lock()):
        stage_s: list[float] = []

        def admission() -> Decision | None:
            """The claim check, the load read, the decision and the acceptance: one trip off the loop (None:
            the caller's UID is taken)."""
            if intake.claimed(store, ticket):
                return None
            decision = intake.decide(ticket, _loads(app, [spec.name])[spec.name], time.time(),
                                     app[BOOK].counts(spec.name))
            if decision.admit:
                intake.accept(store, ticket)
                stage_s.extend(eta.stage_seconds(app[PRICER].fits, spec, ticket.sub.params,
                                                 app[ROUTES].base_latency(spec.name)))
            return decision

        try:
            decision = await asyncio.to_thread(admission)
        except BadRequest as exc:  # claimed meanwhile
            return _error(exc.status, str(exc), exc.field)
        except Exception as exc:  # Redis unreachable: an overload answer, never a 500
            return _busy(f"the result store is unavailable: {exc}", 5)
        if decision is None:
            bad = taken()
            return _error(bad.status, str(bad), bad.field)
        if not decision.admit:
            return _busy(decision.reason, decision.retry_after, request)
    app[DRAIN].note_accepted(spec.name)  # in flight in the store from now on
    estimate = _booked(app, ticket, stage_s)
    try:
        # where it went is recorded by the injecting thread, right after the send (no second trip)
        target = await app[INJECTOR].inject(spec.name, ticket.entry, ticket.message, ticket.entry_cost,
                                            after=lambda r: store.located(uid, r.node, r.instance))
        app[ACCEPTED][spec.name] = app[ACCEPTED].get(spec.name, 0) + 1
    except MessageTooLarge as exc:  # a ring smaller than the one measured above: refused, and the job failed
        app[BOOK].end(uid)
        bad = intake.too_large(ticket, exc.size, exc.limit)
        await asyncio.to_thread(store.finish, uid, spec.name, keys.FAILED, ticket.entry, str(bad))
        return _error(bad.status, str(bad), bad.field)
    except Exception as exc:  # any send failure is an overload answer
        app[BOOK].end(uid)
        await asyncio.to_thread(store.finish, uid, spec.name, keys.FAILED, ticket.entry,
                                f"could not enter {ticket.entry}: {exc}")
        return _busy(f"could not hand the request to {ticket.entry}: {exc}", 1)
    return web.json_response({"uid": uid, "state": keys.QUEUED, "workflow": spec.name, "cost_gpu_s": ticket.cost,
                              "predicted_wait_s": decision.predicted_wait_s, "instance": target.instance,
                              "deadline": ticket.sub.deadline, **estimate.as_dict()}, status=202,
                             headers={ETA_HEADER: estimate.header()})


def _booked(app: web.Application, ticket: Ticket, stage_s: list[float]) -> eta.Estimate:
    """Enter an accepted request in the book; the estimate it is told now (judged when it ends)."""
    job = app[BOOK].add(ticket.uid, ticket.sub.spec.name, ticket.sub.priority, time.monotonic(), stage_s)
    estimate, job.raw_s = _estimate(app, job, None, 0, job.accepted)
    job.p50_s, job.p90_s = estimate.eta_s, estimate.eta_p90_s
    return estimate


def _rate(app: web.Application, workflow: str) -> float | None:
    """Requests/s the workflow's line drains at: measured while saturated, else the Node Manager's capacity."""
    return app[DRAIN].rate(workflow, time.monotonic()) or app[ROUTES].capacity(workflow) or None


def _estimate(app: web.Application, job: eta.Entry, stage_index: int | None, progress: float,
              now: float) -> tuple[eta.Estimate, float]:
    """(the calibrated estimate, the raw model) of ``job`` now, from cached values only (no I/O)."""
    ahead = app[BOOK].ahead(job, now)
    rate = _rate(app, job.workflow)
    raw = eta.raw(eta.remaining_work(job.stage_s, stage_index, progress), ahead, rate, max(job.stage_s, default=0.0))
    history = app[HISTORIES].setdefault((job.workflow, job.priority), eta.History())
    return history.estimate(raw, ahead, rate), raw


def _status_estimate(app: web.Application, st: Any) -> eta.Estimate:
    """The estimate of an unfinished job: from the book when this Proxy accepted it, else (another Proxy's,
    or accepted before a restart) as a normal job behind everything this Proxy knows, its stage times the
    Node Manager's."""
    now = time.monotonic()
    route = get_workflow(st.workflow).route()
    job = app[BOOK].entries.get(st.uid)
    if job is None:
        base = app[ROUTES].base_latency(st.workflow)
        job = eta.Entry(st.uid, st.workflow, 0, 1 << 62, now - max(0.0, time.time() - st.created),
                        tuple([base / len(route)] * len(route)))
    index = route.index(st.stage) if st.state == keys.IN_PROGRESS and st.stage in route else None
    return _estimate(app, job, index, st.progress, now)[0]


def _status_response(app: web.Application, st: Any) -> web.Response:
    """The status; an unfinished job's with its ETA (eta_s, eta_p90_s, provisional, queue_ahead) and the
    ``OnePiece-ETA`` header."""
    body = st.as_dict()
    if st.terminal:
        return web.json_response(body)
    estimate = _status_estimate(app, st)
    return web.json_response({**body, **estimate.as_dict()}, headers={ETA_HEADER: estimate.header()})


def _uid(request: web.Request) -> str | None:
    uid = request.match_info["uid"]
    return uid if len(uid) == 32 and all(c in "0123456789abcdef" for c in uid) else None


async def _lookup(request: web.Request) -> tuple[str, Any] | web.Response:
    """(uid, status) of the request the path names, or the 404 answer (503 while Redis is away)."""
    uid = _uid(request)
    try:
        st = await asyncio.to_thread(request.app[STORE].status, uid) if uid else None
    except outage.UNAVAILABLE as exc:
        return _store_down(exc)
    if st is None or uid is None:
        return _error(404, "unknown or expired request")
    return uid, st


def _store_down(exc: BaseException) -> web.Response:
    return _busy(f"the result store is unavailable: {exc}", outage.RETRY_AFTER_S)


Handler = Callable[[web.Request], Awaitable[web.Response]]


def _store_guarded(handler: Handler) -> Handler:
    """The route answers 503 + Retry-After when Redis goes away between its lookup and its own store call
    (a stopped or restarting Redis is a moment's overload, never a 500)."""
    @functools.wraps(handler)
    async def guarded(request: web.Request) -> web.Response:
        try:
            return await handler(request)
        except outage.UNAVAILABLE as exc:
            return _store_down(exc)

    return guarded


MAX_WAIT_S = 60.0


async def _wait_terminal(app: web.Application, uid: str, st: Any, wait: float) -> Any:
    """The job's status once it is terminal or ``wait`` seconds passed. Woken by the terminal event
    (:func:`_watch_endings` reads the endings stream once for every waiter of this Proxy), so a waiter
    costs nothing while it waits and hears of the end within a millisecond; the status is read again
    every second as well, in case an event was missed (a Redis restart, a trimmed stream)."""
    store, endings = app[STORE], app[ENDINGS]
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
        st = await read(st)  # it may have ended before we listened
        while not st.terminal and (left := deadline - time.monotonic()) > 0:
            try:
                await asyncio.wait_for(ended.wait(), min(1.0, left))
            except TimeoutError:
                pass
            st = await read(st)
    finally:
        entry[1] -= 1
        if entry[1] == 0 and endings.get(uid) is entry:
            del endings[uid]
    return st


async def _watch_endings(app: web.Application) -> None:
    """Tail the stream of terminal events (keys.ENDINGS: one entry per finished job, not the dozen events
    each job writes) and wake the long polls of jobs that just ended."""
    store, endings, after = app[STORE], app[ENDINGS], "$"
    while True:
        try:
            after, events = await asyncio.to_thread(store.read_events, after, 1000, 1000, keys.ENDINGS)
            now = time.monotonic()
            for e in events:
                if e.get("type") in keys.TERMINAL:
                    if entry := endings.get(e.get("uid", "")):
                        entry[0].set()
                    _ended(app, e.get("uid", ""), e.get("type", ""), now)
        except Exception as exc:  # Redis unreachable: the waiters read the status every second meanwhile
            log.warning("reading the event stream failed: %s", exc)
            after = "$"
            await asyncio.sleep(1.0)


def _ended(app: web.Application, uid: str, state: str, now: float) -> None:
    """A job left the line: out of the book, and a completed one's time against what it was told at submit
    into its history (the ETA's calibration)."""
    job = app[BOOK].end(uid)
    if job is not None and state == keys.COMPLETED:
        app[HISTORIES].setdefault((job.workflow, job.priority), eta.History()).record(
            job.raw_s, job.p50_s, job.p90_s, now - job.accepted)


def _inflight_uids(store: JobStore, names: list[str]) -> set[str]:
    """Every UID the store has in flight for these workflows (one round trip)."""
    pipe = store.r.pipeline(transaction=False)
    for name in names:
        pipe.zrange(keys.inflight_key(name), 0, -1)
    return {u.decode() for members in pipe.execute() for u in members}


async def _prune_book(app: web.Application) -> None:
    """Drop from the book the jobs whose end the endings stream did not show (a Redis restart, a trimmed
    stream): what the store no longer has in flight."""
    store, names = app[STORE], sorted(workflows())
    while True:
        await asyncio.sleep(BOOK_PRUNE_S)
        try:
            before = time.monotonic()
            uids = await asyncio.to_thread(_inflight_uids, store, names)
            app[BOOK].keep(uids, before)
        except Exception as exc:  # Redis away: pruned on a later round
            log.warning("pruning the ETA book failed: %s", exc)


@_store_guarded
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
        st = await _wait_terminal(request.app, uid, st, wait)
    return _status_response(request.app, st)


@_store_guarded
async def cancel(request: web.Request) -> web.Response:
    found = await _lookup(request)
    if isinstance(found, web.Response):
        return found
    uid, st = found
    if st.terminal:
        return web.json_response({"uid": uid, "state": st.state, "error": "request already finished"}, status=409)
    await asyncio.to_thread(request.app[STORE].request_cancel, uid)
    return web.json_response({"uid": uid, "state": st.state, "cancel_requested": True}, status=202)


@_store_guarded
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


@_store_guarded
async def drop_result(request: web.Request) -> web.Response:
    found = await _lookup(request)
    if isinstance(found, web.Response):
        return found
    uid, st = found
    if not st.terminal:  # its result is still to come: dropping now would not stop it from being written
        return web.json_response({"uid": uid, "state": st.state, "error": "request not finished"}, status=409)
    dropped = await asyncio.to_thread(request.app[STORE].drop_results, [uid])
    return web.json_response({"uid": uid, "dropped": bool(dropped)})


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
    ttl = max(3, int(4 * interval))
    published: dict[str, float] | None = None  # the rates last written, and when; the lease's last refresh
    t_put = t_refresh = 0.0
    while True:
        try:
            if lease is None:
                lease, published = await asyncio.to_thread(client.lease, ttl), None
                t_refresh = time.monotonic()
            now, counts = time.monotonic(), dict(app[ACCEPTED])
            for w, n in counts.items():
                rate = (n - last.get(w, 0)) / max(now - t_last, 1e-3)
                rates[w] = 0.5 * rates.get(w, rate) + 0.5 * rate
            last, t_last = counts, now
            # written when the rates moved by a tenth or more (or every 5 s), the lease refreshed every third of
            # its time: about one etcd call a second instead of two, for the same freshness
            if published is None or now - t_put >= 5.0 or any(
                    abs(r - published.get(w, 0.0)) > 0.1 * max(published.get(w, 0.0), 0.5) for w, r in rates.items()):
                await asyncio.to_thread(register_proxy, client, workflow_set, name, url, rates, lease)
                published, t_put = dict(rates), now
            if now - t_refresh >= ttl / 3:
                await asyncio.to_thread(lease.refresh)
                t_refresh = now
        except Exception as exc:  # etcd unreachable: registered again on the next round
            log.warning("proxy registration failed: %s", exc)
            lease = None
        await asyncio.sleep(interval)


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
    app[ACCEPTED], app[LIMITS], app[DRAIN], app[ENDINGS], app[ADMITTING] = {}, limits, DrainMeter(), {}, {}
    sweeper = OrphanSweeper(store, routes.client, injector, max_attempts)
    app[STORE], app[ROUTES], app[INJECTOR] = store, routes, injector
    app[PRICER] = Pricer()
    app[BOOK], app[HISTORIES] = eta.Book(), {}
    # requests are checked against the loaded models' limits (published with the routes) and priced
    # from the stage times the instances measured
    app[INTAKE] = Intake(limits.max_image_bytes, limits.max_image_pixels, monitor, limits=routes.limits,
                         price=app[PRICER].price)
    app.router.add_get("/v1/workflows", workflow_list)
    app.router.add_post("/v1/requests", submit)
    app.router.add_get("/v1/requests/{uid}", status)
    app.router.add_delete("/v1/requests/{uid}", cancel)
    app.router.add_get("/v1/requests/{uid}/result", result)
    app.router.add_delete("/v1/requests/{uid}/result", drop_result)
    from engine.proxy import stream  # ?stream=true on the result route: the fragments as they come
    stream.install(app, store)
    preview.install(app, store)  # GET /v1/requests/{uid}/preview: the latest live preview
    app.router.add_get("/livez", livez)
    app.router.add_get("/readyz", readyz)

    async def _background(app: web.Application) -> Any:
        tasks = [asyncio.create_task(_poll_producers(app)),
                 asyncio.create_task(_sweep_orphans(sweeper, sweep_interval)),
                 asyncio.create_task(_sample_drain(app)),
                 asyncio.create_task(_refresh_prices(app)),
                 asyncio.create_task(_watch_endings(app)),
                 asyncio.create_task(_prune_book(app))]
        if registration is not None:
            tasks.append(asyncio.create_task(_register(app, *registration)))
        yield
        for task in tasks:
            task.cancel()

    app.cleanup_ctx.append(_background)
    return app
