"""Step-level batching: the requests a stage instance holds share one model call per step.

A :class:`engine.stages.base.SteppedStage` (SD's denoise) advances requests one
step at a time. This loop holds a set of active requests: between two steps it
takes what the inbox ring has, lets compatible requests (the stage's
``batch_key``) join, steps a group of the active requests in one call, and hands
on each request as soon as its own steps are done. So requests with different
step counts share a batch, a late arrival joins at the next step boundary (then
steps, or pauses behind a higher level: below), and each request keeps its own
seed, scheduler, progress, cancel, deadline and error:

* a cancelled or expired request leaves the active set at the next step
  boundary (paused ones included);
* a batched step that raises starts every request of the batch again from its
  first step (a request's output depends only on its own inputs), and each
  steps alone to its end (an error that only a batch meets, such as running out
  of device memory, must not recur), so a failing request fails alone and the
  others complete, none lost or repeated;
* a request that cannot share (``batch_key`` None, or another key while a
  batch runs) waits in line; while one waits no request behind it joins,
  so it starts when the active set, at most ``max_held`` requests, has
  ended (its bound);
* the line is ordered by priority with aging (:mod:`engine.dispatch.order`):
  a higher-priority arrival goes ahead of waiting lower ones, so it joins at
  the next step boundary before them, and a batch still forming (``wait_s``)
  starts at once when one comes.

Priorities inside the active set. Each step runs only the group of the highest
effective priority present (:func:`engine.dispatch.order.effective`), at most
``max_batch`` of it in the order taken; the lower ones pause between steps,
keeping their state (nothing restarts: a request's output depends only on its
own inputs and step count, so a paused one ends with the bytes of an unpaused
run). So a high request no longer pays for a batch of lower ones: it steps in a
group of its own level. A joiner fills a free slot (fewer than ``max_batch``
active) as before, and one of a level that has fewer than ``max_batch`` active
requests at or above it joins even when the set is full, up to ``max_held``
active requests in all (default ``2 * max_batch``: the hard cap on what the
set holds, paused ones holding only their state and their input's ring slot);
at the cap a higher arrival waits for the next request to leave.

The starvation bound: a request's wait at this stage counts toward aging,
its time in line plus its time paused in the active set (not the steps it takes
part in). Once that reaches ``order.AGING_S`` it counts as high for good, and
ties go to the one taken first, so from then on it waits only for requests
taken before it (fewer than ``max_held`` active ones and those ahead of it in
line, each stepping to its end): no later arrival pauses it again. With fewer
than ``max_batch`` top-level requests taken before it active, a paused request
steps again at the first step after its wait reaches ``order.AGING_S``.

Every delivery is released last, after its request was handed on or ended, as
:meth:`engine.worker.taskworker.TaskWorker.handle` does. A request's service
time (what the Node Manager and pricing see) is its share of the time of each
step it took part in (paused, it costs nothing).

:func:`joiners` is the batch-forming decision, pure.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.dispatch import order
from engine.stages.base import Cancelled, DeadlineExceeded, SteppedStage
from engine.transport.ring import Delivery
from engine.workflow import message as wm
from engine.workflow.options import Options

log = logging.getLogger("onepiece.worker")


class StageHost(Protocol):
    """Everything a :class:`StepBatcher` asks of the worker it serves for (the TaskWorker is the one
    implementation): its inbox, and the life of one request's stage run. Nothing else of the worker is
    touched (``tests/engine/worker/test_stage_host.py`` holds the batcher to it)."""

    # the inbox
    def receive(self, n: int, timeout: float) -> list[Delivery]: ...
    def undecodable(self, d: Delivery, exc: wm.MessageError) -> None: ...  # failed and released
    def admit(self, h: wm.Header, start: bool = True) -> bool: ...  # False: not to run (released by the caller)
    def idle(self) -> None: ...
    def busy(self) -> None: ...
    def handled_one(self) -> None: ...  # a message done with and released

    # one request's stage run
    def open_run(self, h: wm.Header) -> Any: ...
    def values_of(self, msg: wm.Message) -> dict[str, Any]: ...
    def inputs_of(self, h: wm.Header, values: dict[str, Any]) -> dict[str, Any]: ...
    def finish_run(self, h: wm.Header, run: Any, values: dict[str, Any], out: dict[str, Any], share_s: float,
                   batch: int, wall_s: float) -> None: ...
    def run_alone(self, h: wm.Header, msg: wm.Message) -> bool: ...  # the plain path
    def stopped(self, h: wm.Header, run: Any, exc: Exception) -> None: ...  # a cancel or the deadline
    def errored(self, h: wm.Header, exc: Exception) -> None: ...
    def fail(self, h: wm.Header, exc: Exception) -> bool: ...  # False: the store is away (keep the input)


@dataclass
class Waiting:
    """A decoded, admitted request not yet begun."""

    d: Delivery
    msg: wm.Message
    key: Hashable | None
    arrived: float = field(default_factory=time.monotonic)
    seq: int = 0  # the order it was taken in (ties of priority go to the first taken)

    @property
    def priority(self) -> int:
        return self.msg.header.priority


@dataclass
class Active:
    w: Waiting
    run: Any  # engine.worker.taskworker.Run
    values: dict[str, Any]
    state: Any
    began: float
    share_s: float = 0.0  # this request's share of the steps' time
    widest: int = 1  # the largest batch it stepped in
    alone: bool = False  # a batch it was in failed: it starts again and steps alone to its end
    queued_s: float = 0.0  # how long it waited in line before it began
    paused_s: float = 0.0  # how long it sat paused in the active set, up to its last step
    paused_at: float | None = None  # paused since (time.monotonic); None: it took part in the last step

    def waited(self, now: float) -> float:
        """Its wait at this stage (what aging counts): in line, then paused."""
        return self.queued_s + self.paused_s + (now - self.paused_at if self.paused_at is not None else 0.0)

    def level(self, now: float) -> int:
        """Its effective priority now (``order.AGING_S`` read at the call)."""
        return order.effective(self.w.priority, self.waited(now))


def joiners(active_key: Hashable | None, active: int, waiting: list[Hashable | None], max_batch: int) -> int:
    """How many of the waiting requests (their keys, oldest first) join now: the oldest run of requests
    with the batch's key (or, with no batch, the first request's key; a None key runs alone), up to
    ``max_batch`` in all, stopping at the first one that cannot share (it keeps its place in line)."""
    n = 0
    key = active_key
    for k in waiting:
        if active + n >= max_batch:
            break
        if active + n == 0:
            key = k
            n += 1
            if k is None:
                break
            continue
        if k is None or k != key:
            break
        n += 1
    return n


class StepBatcher:
    """Serves a TaskWorker whose executor is a :class:`SteppedStage` (see the module docstring)."""

    def __init__(self, worker: StageHost, executor: SteppedStage, max_batch: int, wait_s: float = 0.0,
                 recv_batch: int = 8, max_held: int | None = None,
                 key_of: Callable[[Any], Hashable | None] | None = None) -> None:
        self.w, self.ex = worker, executor
        # a request's batch key from its header (default: the executor's from its params; None: alone)
        self.key_of = key_of or (lambda h: executor.batch_key(h.params, Options.from_json(h.options)))
        self.max_batch, self.wait_s, self.recv_batch = max(1, max_batch), max(0.0, wait_s), recv_batch
        # the hard cap on active requests, paused ones included (a higher level joins a full batch of lower)
        self.max_held = max(self.max_batch, 2 * self.max_batch if max_held is None else max_held)
        self.waiting: deque[Waiting] = deque()
        self.active: list[Active] = []
        self.sizes: deque[int] = deque(maxlen=1024)  # the batch sizes of the last steps taken (tests, debugging)
        self._seq = 0

    # -- the loop ---------------------------------------------------------------------------------
    def serve(self, should_stop: Callable[[], bool]) -> None:
        """Serve until ``should_stop()``; then the requests already stepping are finished (as the plain path
        finishes the request at hand) and those not begun stay unreleased, like messages not yet taken."""
        while not should_stop():
            idle = not self.active and not self.waiting
            self.take(0.1 if idle else 0.0)
            if not self.active and not self.waiting:
                self.w.idle()
                continue
            self.admit_joiners()
            if self.active:
                self.step()
            self.w.busy()
        while self.active:
            self.step()

    def take(self, timeout: float) -> None:
        """Decode and admit what the inbox holds (waiting up to ``timeout`` for a first message): all that is
        ready, so the line is ordered among everything the instance holds."""
        batch = self.w.receive(self.recv_batch, timeout)
        while batch:
            for d in batch:
                self._take_one(d)
            batch = self.w.receive(self.recv_batch, 0.0)  # a batch may stop short of the rest

    def _take_one(self, d: Delivery) -> None:
        try:
            msg = wm.decode(d.view)
        except wm.MessageError as exc:
            self.w.undecodable(d, exc)
            return
        try:
            admitted = self.w.admit(msg.header, start=False)  # started when it begins stepping
        except Exception as exc:  # a misrouted message: failed like any bad request
            self._fail(Waiting(d, msg, None), exc)
            return
        if not admitted:
            d.release()
            self.w.handled_one()
            return
        self._seq += 1
        self.waiting.append(Waiting(d, msg, self.key_of(msg.header), seq=self._seq))

    def order(self) -> None:
        """The line in serving order: effective priority first (aging included), then the order taken."""
        now = time.monotonic()
        if len(self.waiting) > 1:
            self.waiting = deque(sorted(self.waiting, key=lambda w: order.rank(w.priority, w.arrived, w.seq, now)))

    def admit_joiners(self) -> None:
        self.order()
        key = self.active[0].w.key if self.active else None
        if not self.active and self.waiting and self.waiting[0].key is None:
            self._alone(self.waiting.popleft())  # cannot share: served as the plain path serves it
            return
        n = joiners(key, len(self.active), [w.key for w in self.waiting], self.max_batch)
        if not self.active and 0 < n < self.max_batch and self.wait_s > 0:
            n = self._wait_for_more(n)
        for _ in range(n):
            self._begin(self.waiting.popleft())
        self._admit_above()

    def _admit_above(self) -> None:
        """Beyond ``max_batch``: the head of the line joins a full set while fewer than ``max_batch`` active
        requests are at or above its effective level (it steps in their group; lower ones pause), up to
        ``max_held`` in all. It must share the set's key, as any joiner."""
        now = time.monotonic()
        while self.waiting and self.active and len(self.active) < self.max_held:
            w = self.waiting[0]
            if w.key is None or w.key != self.active[0].w.key:
                return
            lvl = order.effective(w.priority, now - w.arrived)
            if sum(1 for a in self.active if a.level(now) >= lvl) >= self.max_batch:
                return
            self._begin(self.waiting.popleft())

    def _wait_for_more(self, n: int) -> int:
        """A batch about to start with room left waits up to ``wait_s`` after its oldest request arrived
        (never past a deadline) for compatible ones; a started batch takes joiners at step boundaries."""
        first = self.waiting[0]
        until = first.arrived + self.wait_s
        deadlines = [w.msg.header.deadline for w in list(self.waiting)[:n] if w.msg.header.deadline]
        top = max(w.priority for w in list(self.waiting)[:n])
        while n < self.max_batch and time.monotonic() < until and not any(time.time() >= d for d in deadlines):
            self.take(min(0.005, max(0.0, until - time.monotonic())))
            self.order()
            n = joiners(None, 0, [w.key for w in self.waiting], self.max_batch)
            if self.waiting[0].priority > top:  # a higher-priority arrival does not wait for a forming batch
                break
        return n

    # -- one request's life ---------------------------------------------------------------------------
    def _begin(self, w: Waiting) -> None:
        h = w.msg.header
        try:
            run = self.w.open_run(h)
            values = self.w.values_of(w.msg)
            inputs = self.w.inputs_of(h, values)
            state = self.ex.begin(inputs, h.params, run.ctx.options)
            self.active.append(Active(w, run, values, state, time.perf_counter(),
                                      queued_s=max(0.0, time.monotonic() - w.arrived)))
        except Exception as exc:
            self.w.errored(h, exc)
            self._fail(w, exc)

    def _alone(self, w: Waiting) -> None:
        """A request that shares with nothing: the TaskWorker's plain path, released last."""
        release = True
        try:
            self.w.run_alone(w.msg.header, w.msg)
        except Exception as exc:
            release = self.w.fail(w.msg.header, exc)
            if not release:
                raise
        finally:
            if release:
                w.d.release()
            self.w.handled_one()

    def _fail(self, w: Waiting, exc: Exception) -> None:
        if not self.w.fail(w.msg.header, exc):
            raise exc  # the store is away: keep the input, let the process die (see TaskWorker.handle)
        w.d.release()
        self.w.handled_one()

    def _leave(self, a: Active) -> None:
        self.active.remove(a)
        a.w.d.release()
        self.w.handled_one()

    # -- a step -------------------------------------------------------------------------------------
    def step(self) -> None:
        for a in list(self.active):  # cancel and deadline, between steps, each on its own
            try:
                a.run.ctx.check()
            except (Cancelled, DeadlineExceeded) as exc:
                self.w.stopped(a.w.msg.header, a.run, exc)
                self._leave(a)
        now = time.monotonic()
        group = self._group(now)
        if not group:
            return
        self._pause_others(group, now)
        t0 = time.perf_counter()
        try:
            self.ex.step([a.state for a in group])
        except Exception as exc:
            self._step_failed(group, exc)
            return
        spent = time.perf_counter() - t0
        self.sizes.append(len(group))
        for a in group:
            a.share_s += spent / len(group)
            a.widest = max(a.widest, len(group))
            done, total = self.ex.progress(a.state)
            # each item its own preview, of its own latents, numbered as the stage numbers it (asked for only
            # where the request wants previews); a one-call stage's single step is its end: stage_finished says
            # it (no progress event), as does a stage with no step of this request to take (a Wan2.2 expert)
            if getattr(self.ex, "reports_steps", True) and total > 0:
                a.run.ctx.step_done(done, total)
                if a.run.ctx.preview is not None:
                    a.run.ctx.offer_preview(*self.ex.preview(a.state))
            if done >= total:
                self._finish(a)

    def _group(self, now: float) -> list[Active]:
        """Who steps now: the active requests of the highest effective level, in the order taken; the first of
        them alone when it must step alone (after a failed batch), else up to ``max_batch`` of those that may
        share (one that must step alone waits until it is the first: nobody taken before it waits for it)."""
        if not self.active:
            return []
        levels = {id(a): a.level(now) for a in self.active}
        top = max(levels.values())
        group = sorted((a for a in self.active if levels[id(a)] == top), key=lambda a: a.w.seq)
        if group[0].alone:
            return group[:1]
        return [a for a in group if not a.alone][:self.max_batch]

    def _pause_others(self, group: list[Active], now: float) -> None:
        """The requests left out of this step are paused from ``now`` (the clock the group was chosen by: their
        wait counts toward aging); those in it end their pause."""
        stepping = {id(a) for a in group}
        for a in self.active:
            if id(a) not in stepping:
                a.paused_at = now if a.paused_at is None else a.paused_at
            elif a.paused_at is not None:
                a.paused_s += now - a.paused_at
                a.paused_at = None

    def _step_failed(self, group: list[Active], exc: Exception) -> None:
        if len(group) > 1:  # which request broke it is unknown: each starts again, alone
            log.warning("a batched step of %d requests failed (%s); running each alone", len(group), exc)
            for a in group:
                inputs = self.w.inputs_of(a.w.msg.header, a.values)
                try:
                    a.state, a.alone = self.ex.begin(inputs, a.w.msg.header.params, a.run.ctx.options), True
                except Exception as again:
                    self._drop(a, again)
            return
        self._drop(group[0], exc)

    def _drop(self, a: Active, exc: Exception) -> None:
        self.w.errored(a.w.msg.header, exc)
        self.active.remove(a)
        self._fail(a.w, exc)

    def _finish(self, a: Active) -> None:
        h = a.w.msg.header
        try:
            out = self.ex.end(a.state)
            stats = getattr(self.ex, "stats", None)  # a SteppedStage's; a duck-typed stepper may lack it
            if a.run.ctx is not None and stats is not None:
                a.run.ctx.stats.update(stats(a.state))
            # its share of the steps is what it cost the instance (pricing, the deadline check, Theorem 1);
            # the wall time since it began (others' shares included) is only reported
            self.w.finish_run(h, a.run, a.values, out, a.share_s, a.widest, time.perf_counter() - a.began)
        except Exception as exc:
            self.w.errored(h, exc)
            self.active.remove(a)
            self._fail(a.w, exc)
            return
        self._leave(a)
