"""Taking a request in: validation, cost, admission, acceptance and injection, in that order.

One :class:`Intake` serves the Proxy's HTTP handler (engine.proxy.app, which
adds what only HTTP has: credentials, bounded body reads, the response) and
the in-process engine client of the web platform's tests
(onepiece_platform.engine_link.local), so both refuse the same requests with
the same answers. Its rules are pure and synchronous (CPU-bound: the Proxy
runs them in a thread). The admission order is written once, :meth:`Intake.admit`
(the ring's limit, then under the workflow's lock one trip for the claim check,
the load read, the decision and the acceptance, then the ETA book and the
injection); where it runs comes in as :class:`AdmissionPorts`: the Proxy's
event loop (engine.proxy.state) or the calling thread (:class:`InProcessPorts`,
through :meth:`Intake.admit_sync`).

Reading and checking the request is :class:`engine.proxy.parsing.Parser`'s
(what it refuses, and how). Here :class:`engine.proxy.parsing.BadRequest` refuses
messages larger than the first stage's ring (413) and a taken UID (409), and
:class:`Overloaded` (503) says the Request Monitor has no room now. A request the
monitor says can never fit (its own stage work, priced from this deployment's
measurements, is over its deadline even on an idle engine: ``Decision.final``) is
a ``BadRequest`` (400 naming ``deadline_s``): a 503 says "come back later", and
clients (the openai SDK among them) retry it, three times over, for an answer that
cannot change (docs/api.md says why 400 and not ``x-should-retry: false``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, replace
from typing import Any, Protocol, TypeVar

from engine.dispatch import order
from engine.proxy.monitor import Decision, Load, RequestMonitor
from engine.proxy.parsing import BadRequest, Parser, largest, taken
from engine.store import keys
from engine.transport.errors import MessageTooLarge
from engine.workflow import WorkflowSpec, images
from engine.workflow import message as wm
from engine.workflow.request import Request

log = logging.getLogger("onepiece.proxy")
T = TypeVar("T")


class Overloaded(Exception):
    """No room for the request now (503): the Request Monitor's refusal, with its ``retry_after``."""

    def __init__(self, decision: Decision) -> None:
        super().__init__(decision.reason)
        self.decision = decision


@dataclass(frozen=True)
class Ticket:
    """A valid submission made ready to enter the engine: its UID, message and cost."""

    sub: Request
    uid: str
    header: wm.Header
    message: bytes  # the Workflow Message for the first stage
    cost: float  # predicted GPU-seconds of the whole request (admission and the store's in-flight cost)
    entry: str  # the first stage
    entry_cost: float  # its share of the cost (the delivery policy's weight)
    # its seconds of stage work here, priced from measured stage times (engine.workflow.pricing); None
    # before any stage of its workflow was measured
    seconds: float | None = None


LOW_SHARE = 0.5  # low-priority requests are admitted while the queue holds under this share of its budget


def as_seen_by(priority: int, load: Load, by_priority: Mapping[int, int] | None = None) -> Load:
    """The load a request of ``priority`` is admitted on, so that under overload low is refused before
    normal and high, and high keeps its latency. A low request sees every job in flight as 1/LOW_SHARE
    jobs: it is refused at half the fill (the queue bound, and with a deadline the predicted finish) at
    which the others still enter, so half of the admission budget is kept for normal and high. A high
    request is served before every waiting lower one (engine.dispatch.order), so the low jobs in flight
    (``by_priority``) are not ahead of it: it sees only the rest, bounded below by one job per instance
    (those being served, which it cannot pass). Normal sees the load as it is."""
    if priority < 0:
        return replace(load, inflight=math.ceil(load.inflight / LOW_SHARE),
                       inflight_cost=load.inflight_cost / LOW_SHARE)
    if priority > 0 and by_priority:
        low = by_priority.get(-1, 0)
        seen = max(min(load.inflight, load.instances), load.inflight - low)
        if seen < load.inflight:
            share = seen / max(1, load.inflight)
            return replace(load, inflight=seen, inflight_cost=load.inflight_cost * share)
    return load


class Intake(Parser):
    """The rules of taking a request in (see the module's docstring): a :class:`Parser`'s validated
    submission, then its cost, the admission decision, acceptance and injection. Holds no connection:
    thread-safe."""

    def __init__(self, max_image_bytes: int = images.MAX_BYTES, max_image_pixels: int = images.MAX_PIXELS,
                 monitor: RequestMonitor | None = None,
                 limits: Callable[[str], Mapping[str, Mapping[str, Any]] | None] | None = None,
                 price: Callable[[WorkflowSpec, Mapping[str, Any]], float | None] | None = None) -> None:
        """``monitor``: the admission policy; None admits everything (an in-process engine that never
        runs out of room). ``limits``: see :class:`Parser`. ``price(spec, params)``: the request's seconds
        of stage work as measured on this deployment (:mod:`engine.workflow.pricing`), None where nothing
        was measured yet."""
        super().__init__(max_image_bytes, max_image_pixels, limits)
        self.monitor = monitor
        self.price = price

    # -- cost and the message ------------------------------------------------------------------
    def ticket(self, sub: Request) -> Ticket:
        """The UID (the caller's, or a new one), the first stage's message and the cost of ``sub``;
        :class:`BadRequest` if its header would be too large for a stage to read."""
        uid = sub.uid or uuid.uuid4().hex
        route = sub.spec.route()
        header = wm.Header(uid=uid, workflow=sub.spec.name, stage=route[0], route=route, deadline=sub.deadline,
                           priority=sub.priority, params=sub.params, options=sub.options.to_json(),
                           timestamps={"proxy": time.time()})
        message = wm.encode(header, {}, sub.spec.message_inputs(sub.inputs))
        header_len = int.from_bytes(message[8:12], "little")
        if header_len > wm.MAX_HEADER_BYTES:  # the spec's limits keep this from happening; never let it reach a ring
            field = largest({**sub.params, **sub.options.params()})
            raise BadRequest(field, f"the request's header would be {header_len} bytes, over the limit of "
                                    f"{wm.MAX_HEADER_BYTES}; {field} is the largest part")
        seconds = self.price(sub.spec, sub.params) if self.price is not None else None
        return Ticket(sub, uid, header, message, sub.spec.estimate_gpu_seconds(sub.params), route[0],
                      sub.spec.estimate_cost(sub.params).get(route[0], 0.0), seconds)

    @staticmethod
    def too_large(ticket: Ticket, size: int, limit: int) -> BadRequest:
        """The 413 of a message of ``size`` bytes over the ``limit`` its first stage's ring takes."""
        inputs = ticket.sub.inputs
        field = max(inputs, key=lambda k: len(inputs[k]), default="params")
        return BadRequest(field, f"the request would be {size} bytes, over the {limit} bytes its first stage's "
                                 f"ring can hold; {field} is the largest part", 413)

    def check_fits(self, ticket: Ticket, limit: int | None,
                   hop_limit: Callable[[str, str], int | None] | None = None) -> None:
        """:meth:`too_large` unless the message fits ``limit`` (None: unknown, the send will say), and a 413
        naming the request's size unless what later stages are handed fits their rings (``hop_limit(workflow,
        stage)``, published with the routes): a clip whose decoded frames outgrow the encoder's ring would
        otherwise be accepted, denoised, and fail at the last hop."""
        if limit is not None and len(ticket.message) > limit:
            raise self.too_large(ticket, len(ticket.message), limit)
        if hop_limit is None:
            return
        spec, params = ticket.sub.spec, ticket.sub.params
        for stage, size in spec.hop_bytes(params, ticket.sub.inputs).items():
            cap = hop_limit(spec.name, stage)
            if cap is not None and size > cap:
                field = "num_frames" if "num_frames" in params else "width"
                raise BadRequest(field, f"what {stage} is handed would be at least {size / 2**20:.1f} MiB, over "
                                        f"the {cap / 2**20:.1f} MiB its ring takes here (--ring-bytes); ask for "
                                        "fewer frames or a smaller size", 413)

    # -- admission -----------------------------------------------------------------------------
    def room(self, loads: Mapping[str, Load], now: float) -> Decision:
        """Whether any of these workflows could admit a request whatever its body says (the refusal
        decided before a body is read): the first admission found, else the refusal that asks for the
        shortest wait."""
        if self.monitor is None or not loads:
            return Decision(True)
        refusals = []
        for load in loads.values():
            decision = self.monitor.decide(load, 0.0, now, None)
            if decision.admit:
                return decision
            refusals.append(decision)
        return min(refusals, key=lambda d: d.retry_after)

    def decide(self, ticket: Ticket, load: Load | None, now: float,
               by_priority: Mapping[int, int] | None = None) -> Decision:
        """Admit or refuse the request with its cost, deadline and priority (never queues): see
        :func:`as_seen_by`. ``by_priority``: the in-flight jobs per level this caller knows of (the
        Proxy's own book), None where unknown."""
        if self.monitor is None or load is None:
            return Decision(True)
        # the queue bound holds for every level (it bounds what the rings and the store hold)
        full = load.inflight >= self.monitor.max_queue
        seen = load if full else as_seen_by(ticket.sub.priority, load, by_priority)
        decision = self.monitor.decide(seen, ticket.cost, now, ticket.sub.deadline, ticket.seconds)
        if not decision.admit and ticket.sub.priority < 0 and not full and not decision.final:
            return replace(decision, reason=f"{decision.reason}; {order.name_of(ticket.sub.priority)} priority "
                                            f"is admitted while the queue is below {LOW_SHARE:.0%} of its budget")
        return decision

    # -- acceptance ----------------------------------------------------------------------------
    @staticmethod
    def claimed(store: Any, ticket: Ticket) -> bool:
        """Whether a caller-chosen UID is already the name of an accepted request (cheap, before admission)."""
        return ticket.sub.uid is not None and store.status(ticket.uid) is not None

    @staticmethod
    def accept(store: Any, ticket: Ticket) -> None:
        """Record the request as accepted (``queued``, its cost in flight) with its message, kept until it
        finishes so a job lost with its node starts again from it; :func:`taken` (409) when its UID was
        claimed meanwhile. ``store`` is an :class:`engine.store.JobStore`. Before injection, so no stage
        ever sees a UID the store does not know."""
        spec = ticket.sub.spec
        if not store.accept(ticket.uid, spec.name, ticket.cost, "", ticket.message):
            raise taken()

    # -- the whole order, once ------------------------------------------------------------------
    async def admit(self, ticket: Ticket, ports: AdmissionPorts) -> Admitted:
        """The admission order of a valid ticket, the same for every door: the first stage's ring must take
        its message (413 naming the largest input); then, under the workflow's lock (concurrent submits must
        not all be admitted on one in-flight count: a burst would overshoot the queue bound and the deadline
        rule), one trip off the loop for the claim check (409), the load read, the decision (503) and the
        acceptance, which moves the count; then the ETA book and the injection. Raises :class:`BadRequest`
        or :class:`Overloaded`; a store that cannot be reached is an overload (503), never a 500."""
        self.check_fits(ticket, await ports.ring_limit(ticket), ports.hop_limit)
        async with ports.lock(ticket.sub.spec.name):
            decision, stage_s = await ports.off_loop(functools.partial(self._decide_and_accept, ticket, ports))
        estimate = ports.entered(ticket, stage_s)  # in flight in the store from now on
        return Admitted(ticket, decision, await self._inject(ticket, ports), estimate)

    def admit_sync(self, ticket: Ticket, ports: AdmissionPorts) -> Admitted:
        """:meth:`admit` for a caller without an event loop (the in-process engine client): run to its end on
        this thread, or on a thread of its own when this one runs an event loop already."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.admit(ticket, ports))
        with ThreadPoolExecutor(1, thread_name_prefix="onepiece-admit") as pool:
            return pool.submit(_run, self.admit(ticket, ports)).result()

    def _decide_and_accept(self, ticket: Ticket, ports: AdmissionPorts) -> tuple[Decision, list[float]]:
        """The claim check, the load read, the decision and the acceptance (blocking: one trip off the loop);
        with the accepted request's stage seconds (the ETA's model)."""
        name = ticket.sub.spec.name
        try:
            if self.claimed(ports.store, ticket):
                raise taken()
            decision = self.decide(ticket, ports.load(name), time.time(), ports.by_priority(name))
            if decision.final:  # it can never fit: a client error, not an overload to retry
                raise BadRequest("deadline_s", decision.reason)
            if not decision.admit:
                raise Overloaded(decision)
            stage_s = ports.stage_seconds(ticket)  # before the acceptance: nothing may fail after it but Redis
            self.accept(ports.store, ticket)
            return decision, stage_s
        except (BadRequest, Overloaded):
            raise
        except Exception as exc:  # Redis unreachable: an overload answer, never a 500
            log.warning("admission of %s failed: %s", ticket.uid, exc)
            raise Overloaded(Decision(False, f"the result store is unavailable: {exc}", 5)) from exc

    async def _inject(self, ticket: Ticket, ports: AdmissionPorts) -> str | None:
        """Hand the accepted request to its first stage (the instance it went to, None where unknown). A send
        that fails fails the job it had accepted (never left queued with no stage holding it): a ring smaller
        than the one measured is a 413, any other failure an overload (503)."""
        try:
            return await ports.inject(ticket)
        except MessageTooLarge as exc:
            bad = self.too_large(ticket, exc.size, exc.limit)
            await self._failed(ticket, ports, str(bad))
            raise bad from None
        except Exception as exc:  # any send failure is an overload answer
            log.warning("%s could not enter %s: %s", ticket.uid, ticket.entry, exc)
            await self._failed(ticket, ports, f"could not enter {ticket.entry}: {exc}")
            raise Overloaded(Decision(False, f"could not hand the request to {ticket.entry}: {exc}", 1)) from exc

    @staticmethod
    async def _failed(ticket: Ticket, ports: AdmissionPorts, detail: str) -> None:
        """The accepted job that could not enter its first stage, failed; a store that cannot record it is
        logged, and the caller's 413/503 still answers (never a 500)."""
        ports.withdrawn(ticket)
        try:
            await ports.off_loop(functools.partial(ports.store.finish, ticket.uid, ticket.sub.spec.name,
                                                   keys.FAILED, ticket.entry, detail))
        except Exception as exc:
            log.warning("%s could not be failed after its send failed (%s): %s", ticket.uid, detail, exc)


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


@dataclass(frozen=True)
class Admitted:
    """An accepted request: its ticket, the decision that let it in (the predicted wait), the instance of the
    first stage it entered (None where the caller injects nothing or does not say) and the estimate it is
    told (an :class:`engine.proxy.eta.Estimate`; None without an ETA book)."""

    ticket: Ticket
    decision: Decision
    instance: str | None
    estimate: Any = None


class AdmissionPorts(Protocol):
    """Where :meth:`Intake.admit` runs: the Proxy's event loop (engine.proxy.state.ProxyState) or the calling
    thread (:class:`InProcessPorts`). ``load``, ``by_priority`` and ``stage_seconds`` are called inside
    ``off_loop`` (they may block); the others on the caller's loop."""

    store: Any  # an engine.store.JobStore

    async def ring_limit(self, ticket: Ticket) -> int | None: ...  # the first stage's ring (None: unknown)
    def hop_limit(self, workflow: str, stage: str) -> int | None: ...  # a later stage's ring (None: unknown)
    def lock(self, workflow: str) -> AbstractAsyncContextManager[Any]: ...
    def off_loop(self, fn: Callable[[], T]) -> Awaitable[T]: ...
    def load(self, workflow: str) -> Load | None: ...  # None: no admission policy, admitted
    def by_priority(self, workflow: str) -> Mapping[int, int] | None: ...
    def stage_seconds(self, ticket: Ticket) -> list[float]: ...
    def entered(self, ticket: Ticket, stage_s: list[float]) -> Any: ...  # booked: the estimate, or None
    async def inject(self, ticket: Ticket) -> str | None: ...
    def withdrawn(self, ticket: Ticket) -> None: ...  # out of the book again (its send failed)


class InProcessPorts:
    """The ports of an in-process caller: everything on the calling thread, one thread lock per workflow
    (process-wide, as the Proxy's are per event loop), no rings (their limits unknown), no ETA book.
    ``load(workflow)``: the admission's figures (None: admitted); ``inject(ticket)``: hands the message to
    the first stage (None: the caller plays the stages)."""

    _locks: dict[str, threading.Lock] = {}

    def __init__(self, store: Any, load: Callable[[str], Load | None] | None = None,
                 inject: Callable[[Ticket], Any] | None = None) -> None:
        self.store = store
        self._load = load
        self._inject = inject

    async def ring_limit(self, ticket: Ticket) -> int | None:
        return None

    def hop_limit(self, workflow: str, stage: str) -> int | None:
        return None

    @contextlib.asynccontextmanager
    async def lock(self, workflow: str) -> AsyncIterator[None]:
        with self._locks.setdefault(workflow, threading.Lock()):
            yield

    async def off_loop(self, fn: Callable[[], T]) -> T:
        return fn()

    def load(self, workflow: str) -> Load | None:
        return self._load(workflow) if self._load is not None else None

    def by_priority(self, workflow: str) -> Mapping[int, int] | None:
        return None

    def stage_seconds(self, ticket: Ticket) -> list[float]:
        return []

    def entered(self, ticket: Ticket, stage_s: list[float]) -> Any:
        return None

    async def inject(self, ticket: Ticket) -> str | None:
        if self._inject is not None:
            self._inject(ticket)
        return None

    def withdrawn(self, ticket: Ticket) -> None:
        return None
