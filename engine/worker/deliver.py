"""ResultDeliver: which instance of the next stage gets a finished result.

One small ABC and three policies, chosen per workflow by name
(:func:`make_deliver`). Policies see only what the sender knows locally:
the candidates' routes and, through :class:`Outstanding`, what this sender
has handed to each of them that they have not yet acknowledged (released).
Nothing here asks a central service per request.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence

from engine.worker.routes import Route


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


class ResultDeliver(ABC):
    """Picks the next stage's instance for one result.

    Contract: ``choose`` gets a non-empty list of candidates (sorted by
    instance id) and the request's predicted GPU-seconds on that stage, and
    returns one of the candidates. It must not block or do I/O.
    """

    name: str = ""

    def __init__(self, outstanding: Outstanding) -> None:
        self.outstanding = outstanding

    @abstractmethod
    def choose(self, candidates: Sequence[Route], cost: float) -> Route:
        """The instance to send to."""


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
