"""The Proxy's background loops: drain sampling, stage prices, endings, the ETA book, retransmission,
the orphan sweep and its registration for the Node Manager.

Each loop keeps going through an outage of what it reads (it logs the failure
and tries again on its next round); :func:`background` starts them with the
Proxy's application and cancels them when it stops.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.coord.proxies import register_proxy
from engine.proxy.injector import Injector
from engine.proxy.recovery import OrphanSweeper
from engine.proxy.state import DRAIN_SAMPLE_S, ProxyState
from engine.store import JobStore, keys
from engine.workflow import workflows
from engine.workflow.pricing import Fit

log = logging.getLogger("onepiece.proxy")

PRICE_REFRESH_S = 2.0
BOOK_PRUNE_S = 5.0  # how often the book drops jobs whose end it missed (one store read per workflow)


async def sample_drain(state: ProxyState) -> None:
    """Feed the drain meter: every workflow's in-flight and finished counts, a few times a second."""
    names = sorted(workflows())
    while True:
        try:
            counts = await asyncio.to_thread(state.store.drain_sample, names)
            now = time.monotonic()
            for name, (inflight, finished) in counts.items():
                state.drain.record(name, now, inflight, finished, state.instances(name)[0])
        except Exception as exc:  # Redis unreachable: decisions fall back to reading the store
            log.warning("drain sample failed: %s", exc)
        await asyncio.sleep(DRAIN_SAMPLE_S)


def published_fits(state: ProxyState) -> dict[tuple[str, str], list[Fit]]:
    """(workflow, stage) -> the pricing fits its routed instances published (blocking: one Redis round trip)."""
    routes = state.routes
    where = {(r.instance, name): stage for name, spec in workflows().items() for stage in spec.route()
             for r in routes.candidates(name, stage)}
    out: dict[tuple[str, str], list[Fit]] = {}
    for (instance, name), raw in state.store.instances.price_fits(where).items():
        fit = Fit.from_json(raw)
        if fit is not None:
            out.setdefault((name, where[instance, name]), []).append(fit)
    return out


async def refresh_prices(state: ProxyState) -> None:
    """Keep the pricer current with what the instances measured (every couple of seconds)."""
    while True:
        try:
            state.pricer.update(await asyncio.to_thread(published_fits, state))
        except Exception as exc:  # Redis away: the last fits are kept
            log.warning("reading the stage fits failed: %s", exc)
        await asyncio.sleep(PRICE_REFRESH_S)


async def watch_endings(state: ProxyState) -> None:
    """Tail the stream of terminal events (keys.ENDINGS: one entry per finished job, not the dozen events
    each job writes) and wake the long polls of jobs that just ended."""
    after = "$"
    while True:
        try:
            after, events = await asyncio.to_thread(state.store.read_events, after, 1000, 1000, keys.ENDINGS)
            now = time.monotonic()
            for e in events:
                if e.get("type") in keys.TERMINAL:
                    if entry := state.endings.get(e.get("uid", "")):
                        entry[0].set()
                    state.ended(e.get("uid", ""), e.get("type", ""), now)
        except Exception as exc:  # Redis unreachable: the waiters read the status every second meanwhile
            log.warning("reading the event stream failed: %s", exc)
            after = "$"
            await asyncio.sleep(1.0)


def inflight_uids(store: JobStore, names: list[str]) -> set[str]:
    """Every UID the store has in flight for these workflows (one round trip)."""
    pipe = store.r.pipeline(transaction=False)
    for name in names:
        pipe.zrange(keys.inflight_key(name), 0, -1)
    return {u.decode() for members in pipe.execute() for u in members}


async def prune_book(state: ProxyState) -> None:
    """Drop from the book the jobs whose end the endings stream did not show (a Redis restart, a trimmed
    stream): what the store no longer has in flight."""
    names = sorted(workflows())
    while True:
        await asyncio.sleep(BOOK_PRUNE_S)
        try:
            before = time.monotonic()
            uids = await asyncio.to_thread(inflight_uids, state.store, names)
            state.book.keep(uids, before)
        except Exception as exc:  # Redis away: pruned on a later round
            log.warning("pruning the ETA book failed: %s", exc)


async def poll_producers(injector: Injector) -> None:
    """Let the ring producers retransmit what a recovering consumer dropped, twice a second."""
    while True:
        await asyncio.sleep(0.5)
        try:
            await injector.poll()
        except Exception as exc:  # retried on the next round
            log.debug("producer poll failed: %s", exc)


async def sweep_orphans(sweeper: OrphanSweeper, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        try:
            await sweeper.sweep()
        except Exception:  # Redis or etcd down: retried on the next round
            log.exception("orphan sweep failed")


async def register(state: ProxyState, workflow_set: str, name: str, url: str, interval: float = 1.0) -> None:
    """Keep this Proxy registered in its Workflow Set with what it accepts per second (the Node Manager's
    measure of the set's load); the registration goes with the lease when the Proxy does."""
    client, lease, rates = state.routes.client, None, {}
    last, t_last = dict(state.accepted), time.monotonic()
    ttl = max(3, int(4 * interval))
    published: dict[str, float] | None = None  # the rates last written, and when; the lease's last refresh
    t_put = t_refresh = 0.0
    while True:
        try:
            if lease is None:
                lease, published = await asyncio.to_thread(client.lease, ttl), None
                t_refresh = time.monotonic()
            now, counts = time.monotonic(), dict(state.accepted)
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


def background(state: ProxyState, sweep_interval: float, max_attempts: int,
               registration: tuple[str, str, str] | None) -> Callable[[Any], AsyncIterator[None]]:
    """The application's cleanup context that runs every loop while the Proxy serves: the sweep restarts
    jobs lost with a dead node every ``sweep_interval`` seconds (at most ``max_attempts`` starts a job);
    with ``registration`` (Workflow Set, name, URL) the Proxy registers itself."""
    sweeper = OrphanSweeper(state.store, state.routes.client, state.injector, max_attempts)

    async def run(app: Any) -> AsyncIterator[None]:
        loops = [poll_producers(state.injector), sweep_orphans(sweeper, sweep_interval), sample_drain(state),
                 refresh_prices(state), watch_endings(state), prune_book(state)]
        if registration is not None:
            loops.append(register(state, *registration))
        tasks = [asyncio.create_task(loop) for loop in loops]
        yield
        for task in tasks:
            task.cancel()

    return run
