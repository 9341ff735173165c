"""A worker's preview publisher: the pictures of :mod:`engine.stages.preview`, made and stored off the step loop.

Encoding and the store write are made by one thread per worker (``onepiece-preview``), jobs in the order
offered and each job's previews in step order, so a preview never waits on Redis inside the loop. A job
holds at most :data:`PER_JOB` previews not yet made; a newer one then replaces its oldest (the user sees the
latest), and no job's backlog costs another job its previews.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.stages.preview import FORMATS, Renderer, check_format, snapshot

log = logging.getLogger(__name__)

#: one job's previews waiting for the thread; a newer one replaces the oldest (logged): the loop never waits
PER_JOB = 4
#: every job's waiting previews together (a stalled store, many jobs): past it the oldest of all is dropped
MAX_WAITING = 64


@dataclass
class _Item:
    uid: str
    stage: str
    step: int
    total: int
    estimate: Any  # snapshot(): the loop's latents copied at the step (None: ``pixels`` made already)
    grid: tuple[int, int] | None
    pixels: Any = None  # Renderer.keep's uint8 picture
    dropped: bool = field(default=False, compare=False)


class Previews:
    """A worker's preview publisher: :meth:`attach` turns a request's ``preview_every`` into its context's
    hook; one thread renders and writes (``store.preview.add``), jobs in the order offered, each job's
    previews in step order, at most :data:`PER_JOB` of a job waiting (a newer one replaces its oldest)."""

    def __init__(self, store: Any, executor: Any, method: str = "linear", fmt: str = "jpeg") -> None:
        check_format(fmt)
        self.store, self.executor, self.method, self.fmt = store, executor, method, fmt
        self.renderer: Renderer | None = None
        self.order: deque[_Item | None] = deque()  # every waiting item, as offered (None: stop)
        self.waiting: dict[str, deque[_Item]] = {}  # job -> its waiting items, oldest first
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None
        self.skipped = 0  # previews replaced by a newer one of their job before the thread made them (logged)
        #: the linear picture made on the loop from CPU latents (Renderer.keep); False: always a snapshot
        self.project_on_loop = True

    def attach(self, ctx: Any, uid: str, stage: str, params: Mapping[str, Any]) -> None:
        """Give ``ctx`` the hook when the request asks for previews (its ``ctx.options.preview_every``) and
        this executor can make them (``params``: its model parameters, which size the picture)."""
        every = ctx.options.preview_every
        family = getattr(self.executor, "preview_family", None)
        if every <= 0 or family is None:
            return
        grid_of: Callable[[Mapping[str, Any]], Any] | None = getattr(self.executor, "preview_grid", None)
        grid = grid_of(params) if grid_of is not None else None
        last = [0]

        def hook(step: int, total: int, estimate: Any) -> None:
            if step <= last[0]:  # a step that did not advance (a batch member waiting for its adapter)
                return
            last[0] = step
            r = self.renderer  # made (and fitted) by the thread; until then the loop hands over a snapshot
            try:
                if r is not None and r.method == "linear" and self.project_on_loop:
                    z, px = r.keep(estimate, grid)
                else:
                    z, px = snapshot(estimate), None
            except Exception:  # a preview is never worth a job
                log.exception("preview of %s step %d not taken", uid, step)
                return
            self.offer(_Item(uid, stage, step, total, z, grid, px))

        ctx.preview_every, ctx.preview = every, hook

    def offer(self, item: _Item) -> None:
        """Queue ``item`` for the thread (started on first use); when its job already has PER_JOB waiting,
        the oldest of them is dropped (logged): the loop never waits, the user gets the latest."""
        with self.cond:
            if self.thread is None:
                self.thread = threading.Thread(target=self._serve, name="onepiece-preview", daemon=True)
                self.thread.start()
            mine = self.waiting.setdefault(item.uid, deque())
            if len(mine) >= PER_JOB:
                self._drop(mine, item)
            elif sum(len(q) for q in self.waiting.values()) >= MAX_WAITING:
                oldest = next(i for i in self.order if i is not None and not i.dropped)
                self._drop(self.waiting[oldest.uid], item)
                mine = self.waiting.setdefault(item.uid, deque())  # this job's queue, when it emptied it
            mine.append(item)
            self.order.append(item)
            if len(self.order) > 4 * MAX_WAITING:  # dropped items leave the order only when the thread reaches them
                self.order = deque(i for i in self.order if i is None or not i.dropped)
            self.cond.notify()

    def _drop(self, queue: deque[_Item], newer: _Item) -> None:
        """Drop the oldest waiting item of ``queue`` (one job's, under the lock) for ``newer``; logged."""
        old = queue.popleft()
        if not queue:
            self.waiting.pop(old.uid, None)
        old.dropped, old.estimate, old.pixels = True, None, None
        self.skipped += 1
        log.info("preview of %s step %d dropped for %s step %d: the thread is behind", old.uid, old.step,
                 newer.uid, newer.step)

    def _next(self) -> _Item | None:
        """The next item to make (None: stop), waiting for one."""
        with self.cond:
            while True:
                while not self.order:
                    self.cond.wait()
                item = self.order.popleft()
                if item is None or not item.dropped:
                    break
            if item is not None:
                mine = self.waiting[item.uid]
                mine.popleft()  # the job's oldest waiting item is this one: both queues keep offer order
                if not mine:
                    del self.waiting[item.uid]
            return item

    def _serve(self) -> None:
        while (item := self._next()) is not None:
            try:
                image = self._render(item)
                self.store.preview.add(item.uid, item.stage, item.step, item.total, image, FORMATS[self.fmt][2])
            except Exception:  # a preview is never worth a job: log it and go on with the next
                log.exception("preview of %s step %d failed", item.uid, item.step)

    def _render(self, item: _Item) -> bytes:
        if self.renderer is None:
            ex = self.executor
            self.renderer = Renderer(ex.model_dir, ex.preview_family, getattr(ex, "device", "cpu"), self.method,
                                     self.fmt)
        return self.renderer.picture(item.estimate, item.grid, item.pixels)

    def close(self, timeout: float = 5.0) -> None:
        """Let the thread write what is waiting, then stop it."""
        with self.cond:
            thread, self.thread = self.thread, None
            if thread is not None:
                self.order.append(None)
                self.cond.notify()
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                log.warning("preview thread still busy after %.0f s at close; leaving it (a daemon)", timeout)
