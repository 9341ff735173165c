"""Which request a stage serves next: higher priority first, with aging so that none starves.

A request's ``priority`` (``low``, ``normal``, ``high``; the API's names) travels in the Workflow
Message header as an integer (:data:`LEVELS`: -1, 0, 1). Every stage orders what it holds (the
TaskWorker's taken messages, the StepBatcher's waiting requests) by :func:`rank`: the effective
priority first, then the order the stage took them in.

The bound (aging): a request that has waited :data:`AGING_S` seconds at a stage since the stage took it
is served as if it were ``high``. Ties go to the request taken first, so from then on no request the
stage took after it is served before it. In other words, a request is passed over by later arrivals
only during its first :data:`AGING_S` seconds at each stage; after that it waits only for requests
taken before it (first come, first served among them), of which a stage holds a finite number. A stage
takes everything its inbox ring holds between two requests, so "since the stage took it" is at most one
service time (the request being run when it arrived) after it reached the stage.

The clock is the stage's own (``time.monotonic``), never the header's timestamps: stages on other hosts
have other clocks, and a skewed one must not make a request look old or new.

Pure: no clock of its own (callers pass ``now``, :func:`time.monotonic` in the engine), no I/O.
"""

from __future__ import annotations

from typing import Any

from engine.workflow.options import Priority

LEVELS: dict[str, int] = {p.value: p.level for p in Priority}  # low -1, normal 0, high 1
NAMES: dict[int, str] = {v: k for k, v in LEVELS.items()}
DEFAULT = Priority.NORMAL.value
HIGH = LEVELS["high"]
AGING_S = 10.0  # a request waiting this long at a stage is served as if high (the starvation bound)


def level(name: object) -> int:
    """The header integer of a priority name; ``ValueError`` for anything but the three names."""
    if not isinstance(name, str) or name not in LEVELS:
        raise ValueError(f"priority must be one of {', '.join(LEVELS)}")
    return LEVELS[name]


def name_of(value: int) -> str:
    """The API name of a header priority (clamped to the three levels)."""
    return NAMES[max(-1, min(1, int(value)))]


def effective(priority: int, waited_s: float, aging_s: float | None = None) -> int:
    """The priority a request is served at after waiting ``waited_s``: ``high`` once it waited ``aging_s``
    (None: :data:`AGING_S`, read at the call)."""
    return HIGH if waited_s >= (AGING_S if aging_s is None else aging_s) else max(-1, min(HIGH, int(priority)))


def rank(priority: int, taken: float, seq: int, now: float, aging_s: float | None = None) -> tuple[int, int]:
    """The sort key of a held request (smallest first): effective priority descending, then taken order."""
    return -effective(priority, now - taken, aging_s), seq


def pick(held: list[Any], now: float, aging_s: float | None = None) -> int:
    """The index in ``held`` of the request to serve next; each item has ``priority``, ``taken`` and ``seq``."""
    return min(range(len(held)), key=lambda i: rank(held[i].priority, held[i].taken, held[i].seq, now, aging_s))


class Line:
    """Held requests in serving order, O(1) per choice: one first-in-first-out queue per level, each in the
    order taken. The head of a queue ranks before everything behind it (taken earlier, so it has waited at
    least as long, at the same level), so the best of the heads is the best of all: what :func:`pick`
    would choose over the whole list."""

    def __init__(self) -> None:
        from collections import deque

        self._queues: dict[int, Any] = {lvl: deque() for lvl in sorted(NAMES, reverse=True)}
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def add(self, item: Any) -> None:
        """``item`` has ``priority``, ``taken`` and ``seq`` (taken after everything added before)."""
        self._queues[max(-1, min(HIGH, int(item.priority)))].append(item)
        self._n += 1

    def pop(self, now: float, aging_s: float | None = None) -> Any:
        heads = [q[0] for q in self._queues.values() if q]
        best = min(heads, key=lambda h: rank(h.priority, h.taken, h.seq, now, aging_s))
        self._queues[max(-1, min(HIGH, int(best.priority)))].popleft()
        self._n -= 1
        return best
