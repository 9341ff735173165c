"""ResultDeliver: which instance of the next stage gets a finished result.

One small ABC and three policies, chosen per workflow by name
(:func:`make_deliver`). Policies see only what the sender knows locally:
the candidates' routes and, through :class:`Outstanding`, what this sender
has handed to each of them that they have not yet acknowledged (released).
Nothing here asks a central service per request.

Every policy keeps LoRA-adapter affinity (:meth:`ResultDeliver.choose_for`): a
request with adapters goes to a denoise instance this sender last gave those
adapters to (so they are loaded there), unless that instance is busier than the
policy's own choice by more than the cost of a load.
"""

from __future__ import annotations

import itertools
import logging
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from engine import envs
from engine.coord.routes import Route
from engine.transport.errors import TransportError

log = logging.getLogger("onepiece.deliver")


class Outstanding:
    """Per-destination unacknowledged sends of this sender, with their predicted costs.

    ``acked(instance)`` returns how many of the sends to ``instance`` are still
    unacknowledged (the ring producer's ``unacked`` count); sends are
    acknowledged in order, so the last ``unacked`` costs are the outstanding ones.
    """

    def __init__(self, unacked: Callable[[str], int]) -> None:
        self._unacked = unacked
        self._costs: dict[str, deque[float]] = {}

    def sent(self, instance: str, cost: float) -> None:
        self._costs.setdefault(instance, deque()).append(cost)

    def _trim(self, instance: str) -> deque[float]:
        q = self._costs.setdefault(instance, deque())
        n = self._unacked(instance)
        while len(q) > n:
            q.popleft()
        return q

    def count(self, instance: str) -> int:
        return len(self._trim(instance))

    def cost(self, instance: str) -> float:
        return sum(self._trim(instance))


class Producers:
    """This sender's ring producers, one per destination instance, for the TaskWorker and the Proxy.

    A producer is made on first use with a fresh entry in the destination's
    ring (never a dead incarnation's: records it committed stay deliverable),
    remade when the route names a new ring, and dropped when its peer is gone:
    a remote worker that died re-opens the same ring memory when it restarts,
    so what was committed is still there and the next send reconnects.
    Not thread-safe: one thread owns it.
    """

    def __init__(self, send_timeout: float) -> None:
        self.send_timeout = send_timeout
        self._by_instance: dict[str, tuple[str, Any]] = {}

    def get(self, route: Route) -> Any:
        got = self._by_instance.get(route.instance)
        if got is not None and got[0] == route.ring_id:
            return got[1]
        self.drop(route.instance)
        from engine.transport.ring import attach_producer

        p = attach_producer(route.address, None, send_timeout=self.send_timeout)
        self._by_instance[route.instance] = (route.ring_id, p)
        return p

    def poll(self, instance: str) -> int:
        """Unacknowledged sends to ``instance`` (0 if none or its peer is gone); resends what it dropped."""
        got = self._by_instance.get(instance)
        if got is None:
            return 0
        try:
            return int(got[1].poll())
        except TransportError as exc:
            log.warning("lost the ring of %s (%s); reconnecting on the next send", instance, exc)
            self.drop(instance)
            return 0

    def poll_all(self) -> None:
        for instance in list(self._by_instance):
            self.poll(instance)

    def drop(self, instance: str) -> None:
        got = self._by_instance.pop(instance, None)
        if got is not None:
            try:
                got[1].close()
            except Exception:  # the region may already be gone
                pass

    def close(self) -> None:
        for instance in list(self._by_instance):
            self.drop(instance)


class ResultDeliver(ABC):
    """Picks the next stage's instance for one result.

    Contract: ``choose`` gets a non-empty list of candidates (sorted by
    instance id) and the request's predicted GPU-seconds on that stage, and
    returns one of the candidates. It must not block or do I/O.
    """

    name: str = ""
    #: what loading an adapter costs an instance, in the units of ``cost`` (predicted GPU-seconds): affinity
    #: gives way when the instance holding a request's adapters has more than this outstanding beyond the
    #: policy's own choice
    adapter_load_s: float = 1.0
    def __init__(self, outstanding: Outstanding) -> None:
        self.outstanding = outstanding
        #: how many adapters this sender remembers per instance: what an instance keeps loaded (its LRU,
        #: ``onepiece node --max-adapters``, which sets ONEPIECE_MAX_ADAPTERS for the node's workers)
        self.adapter_memory = max(1, envs.MAX_ADAPTERS)
        self._adapters: dict[str, OrderedDict[str, None]] = {}  # instance -> digests this sender sent it (LRU)

    @abstractmethod
    def choose(self, candidates: Sequence[Route], cost: float) -> Route:
        """The instance to send to."""

    def choose_for(self, candidates: Sequence[Route], cost: float, lora: Sequence[Mapping[str, Any]] = (),
                   stage: str = "") -> Route:
        """:meth:`choose`, with adapter affinity for a request whose options name LoRA adapters (``lora``:
        the resolved entries, engine.adapters.request) on its way to a denoise ``stage``. Only candidates whose
        outstanding cost is within :attr:`adapter_load_s` of the policy's choice are considered (further
        away, the wait costs more than a load); among them, one this sender gave every one of the adapters to
        (the least outstanding), else, as a load is due anyway, the one holding the fewest other adapters (it
        evicts least). Without adapters: :meth:`choose` alone."""
        choice = self.choose(candidates, cost)
        if not lora or not stage.startswith("denoise"):
            return choice
        digests = [e["digest"] for e in lora]
        margin = self.outstanding.cost(choice.instance) + self.adapter_load_s
        near = [r for r in candidates if self.outstanding.cost(r.instance) <= margin]
        warm = [r for r in near if all(d in self._adapters.get(r.instance, ()) for d in digests)]
        if warm:
            choice = min(warm, key=lambda r: (self.outstanding.cost(r.instance), r.instance))
        elif near:  # a load anyway: where it evicts least (the instance holding the fewest other adapters)
            choice = min(near, key=lambda r: (len(self._adapters.get(r.instance, ())),
                                              self.outstanding.cost(r.instance), r.instance))
        held = self._adapters.setdefault(choice.instance, OrderedDict())
        for d in digests:
            held[d] = None
            held.move_to_end(d)
        while len(held) > self.adapter_memory:
            held.popitem(last=False)
        return choice


class RoundRobin(ResultDeliver):
    """Each candidate in turn (the paper's default)."""

    name = "round-robin"

    def __init__(self, outstanding: Outstanding) -> None:
        super().__init__(outstanding)
        self._counter = itertools.count()

    def choose(self, candidates: Sequence[Route], cost: float) -> Route:
        return candidates[next(self._counter) % len(candidates)]


class LeastOutstanding(ResultDeliver):
    """The candidate with the fewest of our sends still unacknowledged (ties: lowest id)."""

    name = "least-outstanding"

    def choose(self, candidates: Sequence[Route], cost: float) -> Route:
        return min(candidates, key=lambda r: (self.outstanding.count(r.instance), r.instance))


class CostAware(ResultDeliver):
    """The candidate with the fewest predicted GPU-seconds outstanding (big requests weigh more)."""

    name = "cost-aware"

    def choose(self, candidates: Sequence[Route], cost: float) -> Route:
        return min(candidates, key=lambda r: (self.outstanding.cost(r.instance), r.instance))


POLICIES: dict[str, type[ResultDeliver]] = {p.name: p for p in (RoundRobin, LeastOutstanding, CostAware)}


def make_deliver(name: str, outstanding: Outstanding) -> ResultDeliver:
    """The policy called ``name``; ``ValueError`` naming the known ones otherwise."""
    try:
        return POLICIES[name](outstanding)
    except KeyError:
        raise ValueError(f"unknown deliver policy {name!r}; known: {', '.join(sorted(POLICIES))}") from None
