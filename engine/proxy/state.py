"""The Proxy's state, shared by its HTTP routes (engine.proxy.app) and its loops (engine.proxy.loops).

:class:`ProxyState` holds what one Proxy keeps between requests (the store, the
route cache, the injector, the drain meter, the pricer, the ETA book) and is
the :class:`engine.proxy.intake.AdmissionPorts` through which
:meth:`engine.proxy.intake.Intake.admit` runs on the event loop: blocking work
goes off the loop in one trip each (the admission's store round trip, the
injector's send), and everything else is read from caches on the loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from engine.coord.routes import RouteTable
from engine.proxy import eta
from engine.proxy.drain import DrainMeter
from engine.proxy.injector import Injector
from engine.proxy.intake import Intake, Ticket
from engine.proxy.monitor import Load, RequestMonitor
from engine.store import JobStore, keys
from engine.workflow import get_workflow, images
from engine.workflow.pricing import Pricer

RECENT_ENDS = 10_000  # ended jobs remembered (a long poll started within seconds of its job's end)

T = TypeVar("T")

# A submission's body: the largest input image (base64) plus its parameters.
MAX_BODY = images.MAX_BYTES * 4 // 3 + (1 << 20)
DRAIN_SAMPLE_S = 0.25  # how often the drain meter samples the store's counters (engine.proxy.loops)


@dataclass
class Limits:
    """Bounds on what one request, and all requests being read at once, may cost the Proxy."""

    max_body: int = MAX_BODY
    intake_bytes: int = 4 * MAX_BODY  # bodies being read and parsed at once (declared sizes)
    max_image_bytes: int = images.MAX_BYTES
    max_image_pixels: int = images.MAX_PIXELS
    reading: int = 0  # bytes reserved by the bodies being read now (event-loop only: no lock)


@dataclass
class ProxyState:
    """One Proxy's state (event-loop only unless a method says otherwise)."""

    store: JobStore
    routes: RouteTable
    injector: Injector
    limits: Limits
    intake: Intake
    pricer: Pricer  # stage fits the instances published: a request's seconds of work here
    drain: DrainMeter = field(default_factory=DrainMeter)  # what the engine finishes per second
    book: eta.Book = field(default_factory=eta.Book)  # jobs this Proxy accepted and has not seen end
    histories: dict[tuple[str, int], eta.History] = field(default_factory=dict)  # finished jobs' ETA record
    endings: dict[str, list[Any]] = field(default_factory=dict)  # uid -> [Event set at its end, waiters]
    # the last RECENT_ENDS jobs the endings stream said ended (oldest first): a long poll that starts after its
    # job's end was read looks here, not in Redis (engine.proxy.app._wait_terminal)
    recent_ends: OrderedDict[str, None] = field(default_factory=OrderedDict)
    accepted: dict[str, int] = field(default_factory=dict)  # workflow -> requests accepted since start
    admitting: dict[str, asyncio.Lock] = field(default_factory=dict)  # workflow -> held from count to acceptance

    @classmethod
    def build(cls, store: JobStore, routes: RouteTable, injector: Injector, monitor: RequestMonitor,
              limits: Limits) -> ProxyState:
        """Requests are checked against the loaded models' limits (published with the routes) and priced from
        the stage times the instances measured."""
        pricer = Pricer()
        intake = Intake(limits.max_image_bytes, limits.max_image_pixels, monitor, limits=routes.limits,
                        price=pricer.price)
        return cls(store, routes, injector, limits, intake, pricer)

    # -- what the Request Monitor is told ------------------------------------------------------
    def instances(self, name: str) -> tuple[int, int]:
        """(published instances across the workflow's stages, of its first stage), from the route cache."""
        stage_routes = [self.routes.candidates(name, s) for s in get_workflow(name).route()]
        return sum(len(r) for r in stage_routes), len(stage_routes[0])

    def load_with(self, name: str, inflight: int, inflight_cost: float) -> Load:
        instances, entry = self.instances(name)
        return Load(inflight, inflight_cost, instances, entry, self.routes.capacity(name),
                    self.drain.rate(name, time.monotonic()), self.routes.base_latency(name))

    def loads(self, names: list[str]) -> dict[str, Load]:
        """Each workflow's load (blocking: route cache and one Redis read each)."""
        return {name: self.load_with(name, *self.store.inflight(name)) for name in names}

    def cached_loads(self, names: list[str]) -> dict[str, Load] | None:
        """The same from the drain meter's last sample (at most a second old), without any I/O: what a
        refusal is decided on, so that refusing costs the event loop microseconds. None when stale."""
        now, out = time.monotonic(), {}
        for name in names:
            last = self.drain.latest.get(name)
            if last is None or now - last.t > 4 * DRAIN_SAMPLE_S:
                return None
            out[name] = self.load_with(name, last.inflight, 0.0)
        return out

    # -- the ETA -------------------------------------------------------------------------------
    def rate(self, workflow: str) -> float | None:
        """Requests/s the workflow's line drains at: measured while saturated, else the Node Manager's capacity."""
        return self.drain.rate(workflow, time.monotonic()) or self.routes.capacity(workflow) or None

    def estimate(self, job: eta.Entry, stage_index: int | None, progress: float,
                 now: float) -> tuple[eta.Estimate, float]:
        """(the calibrated estimate, the raw model) of ``job`` now, from cached values only (no I/O)."""
        ahead = self.book.ahead(job, now)
        rate = self.rate(job.workflow)
        raw = eta.raw(eta.remaining_work(job.stage_s, stage_index, progress), ahead, rate,
                      max(job.stage_s, default=0.0))
        history = self.histories.setdefault((job.workflow, job.priority), eta.History())
        return history.estimate(raw, ahead, rate), raw

    def status_estimate(self, st: Any) -> eta.Estimate:
        """The estimate of an unfinished job: from the book when this Proxy accepted it, else (another
        Proxy's, or accepted before a restart) as a normal job behind everything this Proxy knows, its stage
        times the Node Manager's."""
        now = time.monotonic()
        route = get_workflow(st.workflow).route()
        job = self.book.entries.get(st.uid)
        if job is None:
            base = self.routes.base_latency(st.workflow)
            job = eta.Entry(st.uid, st.workflow, 0, 1 << 62, now - max(0.0, time.time() - st.created),
                            tuple([base / len(route)] * len(route)))
        index = route.index(st.stage) if st.state == keys.IN_PROGRESS and st.stage in route else None
        return self.estimate(job, index, st.progress, now)[0]

    def ended(self, uid: str, state: str, now: float) -> None:
        """A job left the line: out of the book, and a completed one's time against what it was told at submit
        into its history (the ETA's calibration)."""
        self.recent_ends[uid] = None
        if len(self.recent_ends) > RECENT_ENDS:
            self.recent_ends.popitem(last=False)
        job = self.book.end(uid)
        if job is not None and state == keys.COMPLETED:
            self.histories.setdefault((job.workflow, job.priority), eta.History()).record(
                job.raw_s, job.p50_s, job.p90_s, now - job.accepted, job.ahead)

    # -- the admission ports (engine.proxy.intake.AdmissionPorts) ------------------------------
    async def ring_limit(self, ticket: Ticket) -> int | None:
        return await self.injector.max_message(ticket.sub.spec.name, ticket.entry)

    def hop_limit(self, workflow: str, stage: str) -> int | None:
        return self.routes.max_message(workflow, stage)

    def lock(self, workflow: str) -> asyncio.Lock:
        return self.admitting.setdefault(workflow, asyncio.Lock())

    async def off_loop(self, fn: Callable[[], T]) -> T:
        return await asyncio.to_thread(fn)

    def load(self, workflow: str) -> Load:
        return self.loads([workflow])[workflow]

    def by_priority(self, workflow: str) -> Mapping[int, int]:
        return self.book.counts(workflow)

    def stage_seconds(self, ticket: Ticket) -> list[float]:
        spec = ticket.sub.spec
        return list(eta.stage_seconds(self.pricer.fits, spec, ticket.sub.params, self.routes.base_latency(spec.name)))

    def entered(self, ticket: Ticket, stage_s: list[float]) -> eta.Estimate:
        """Counted in the drain meter and entered in the book; the estimate it is told now (judged when it
        ends)."""
        self.drain.note_accepted(ticket.sub.spec.name)
        job = self.book.add(ticket.uid, ticket.sub.spec.name, ticket.sub.priority, time.monotonic(), stage_s)
        estimate, job.raw_s = self.estimate(job, None, 0, job.accepted)
        job.p50_s, job.p90_s, job.ahead = estimate.eta_s, estimate.eta_p90_s, estimate.ahead
        return estimate

    async def inject(self, ticket: Ticket) -> str:
        store, uid, name = self.store, ticket.uid, ticket.sub.spec.name
        # where it went is recorded by the injecting thread, right after the send (no second trip)
        target = await self.injector.inject(name, ticket.entry, ticket.message, ticket.entry_cost,
                                            after=lambda r: store.located(uid, r.node, r.instance))
        self.accepted[name] = self.accepted.get(name, 0) + 1
        return target.instance

    def withdrawn(self, ticket: Ticket) -> None:
        self.book.end(ticket.uid)
