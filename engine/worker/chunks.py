"""Chunked hand-off between two stages: a stage that yields its output in chunks (``run_chunks``, e.g. Wan's
VAE decode, latent frame by latent frame) sends each as its own message to one instance of the next stage,
which takes them in (``open_chunks``: feed each, then finish) and publishes what it makes of them as it goes
(the mp4 stage's fragments, engine.store.fragments).

Exactly once, in order, through restarts, without new bookkeeping in the store:
  * every chunk message carries its index (``Header.chunk``) and the last one ``final``; a request's chunks
    go to the instance its first chunk went to;
  * the sender releases its input only after the final chunk is sent (as any stage does), so a restarted
    sender runs the request again and sends every chunk again; the receiver drops the chunks it already has
    (index below the next one it expects);
  * the receiver keeps every chunk of a request unreleased in its ring until the final one is handled, so a
    restarted receiver is handed them all again, feeds them again and makes the same fragments again: the
    fragment stream takes each (uid, seq) once (engine.store.fragments), so nothing is published twice;
  * the stage's accounting is once per request: ``stage_started`` with the first chunk (the usual gate),
    ``stage_finished``, the result and the done marker with the final one; a request whose job ends
    meanwhile (cancelled, failed upstream) has its held chunks released by :meth:`Receiver.sweep`.

Bound: a request's frames stay in the receiver's ring until its final chunk, as today's single message did.

With an object store, the last stage's receiver also writes each piece to the job's result object as it
publishes it (:meth:`engine.store.jobs.JobStore.result_writer`: parts uploaded while the video decodes), so
the final chunk leaves only the last part to upload; the job records that object (``uploaded``) instead of
uploading the result again. A request that fails or ends meanwhile has its upload aborted; one whose
receiver restarts starts a new upload from the first piece (the old one, incomplete, is invisible and
removed by the bucket's lifecycle rule). A streamed upload that fails falls back to the ordinary upload at
the end: the stream is an optimisation, never a reason to lose the result.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from engine.store import keys
from engine.store.fragments import Fragments
from engine.store.objects import ObjectStoreError
from engine.transport.ring import Delivery
from engine.workflow import message as wm

log = logging.getLogger("onepiece.worker.chunks")

SWEEP_S = 1.0  # how often the receiver looks for held requests whose job ended


def sends_chunks(executor: Any) -> bool:
    return callable(getattr(executor, "run_chunks", None))


def run_chunked(w: Any, h: wm.Header, msg: wm.Message) -> bool:
    """The sender's run (``w``: its TaskWorker): each chunk but the last sent as it comes, the last through
    the worker's usual end of a run (``close_run``); False when the run stopped (cancel, deadline)."""
    from engine.stages.components import values_to_message

    chain = w.chain(h)
    run = w.open_run(h)
    values = w.values_of(msg)
    carried = chain.spec.carried_after(chain.stage)
    t0 = time.perf_counter()
    inputs = w.inputs_of(h, values)
    # with the count known, each chunk goes out as soon as it exists; else one behind (to know the last)
    count = getattr(w.executor, "chunk_count", lambda *_: None)(inputs, h.params)

    def send_all() -> tuple[dict[str, Any], Any, int]:
        """Every chunk but the last sent; the last, the route the chunks went to and their count."""
        route, index = None, 0
        chunks = w.executor.run_chunks(inputs, h.params, run.ctx)
        last = next(chunks)
        for out in _ahead(chunks, last, count):
            tensors, blobs = values_to_message({k: {**values, **last}[k] for k in carried})
            sent = dataclasses.replace(h, stage=chain.next_stage, chunk=index, final=False,
                                       timestamps=dict(h.timestamps))
            route = w._send(sent, tensors, blobs, 0.0, pinned=route)
            index += 1
            run.ctx.check()  # a cancel or the deadline, between chunks
            last = out if out is not None else next(chunks)
        return last, route, index

    ok, sent_all = w.attempt(h, run, send_all)
    if not ok:
        return False
    last, route, index = sent_all
    h.chunk, h.final = index, True
    w.close_run(h, run, values, last, time.perf_counter() - t0, pinned=route)
    return True


def _ahead(chunks: Any, first: Any, count: int | None) -> Any:
    """What the send loop iterates: with ``count``, None once per chunk but the last (the loop then takes
    the next chunk itself, after sending the one it has); without, the next chunks themselves."""
    if count is None:
        yield from chunks
        return
    for _ in range(count - 1):
        yield None


@dataclass
class Open:
    """One request being received: its stage run, the executor's stream, the chunks held unreleased."""

    header: wm.Header
    run: Any
    stream: Any
    held: list[Delivery] = field(default_factory=list)
    next: int = 0  # the chunk index expected next
    seq: int = 0  # fragments published
    busy_s: float = 0.0  # seconds this instance spent on the request (the stage's service time)
    writer: Any = None  # engine.store.objects.PartWriter of the result object, when streamed there


class Receiver:
    """The receiving side, per TaskWorker ``w``: the requests whose chunks are arriving."""

    def __init__(self, w: Any) -> None:
        self.w = w
        self.open: dict[str, Open] = {}
        self.fragments = Fragments(w.store)
        self._swept = time.monotonic()

    def take(self, d: Delivery, msg: wm.Message) -> None:
        """Handle one chunk message; it is released now (a repeat, a request that will not run) or with its
        request's final chunk."""
        h = msg.header
        o = self.open.get(h.uid)
        try:
            if o is None:
                o = self._start(d, h)
                if o is None:
                    return
            if h.chunk < o.next:  # a restarted sender's repeat of a chunk this instance has
                d.release()
                return
            if h.chunk > o.next:
                raise RuntimeError(f"chunk {h.chunk} arrived while chunk {o.next} was expected")
            o.held.append(d)
            self._feed(o, h, msg)
        except Exception as exc:
            held = o.held if o is not None else []
            if d not in held:
                held = [*held, d]
            recorded = self.w.fail(h, exc)
            self._drop(h.uid, held, recorded)  # unrecorded (the store is down): kept, the restart gets them again
            if not recorded:
                raise

    def _start(self, d: Delivery, h: wm.Header) -> Open | None:
        """The first chunk of a request seen here: the stage's start (the usual admission), or None when it
        does not run (``d`` released)."""
        w = self.w
        if not callable(getattr(w.executor, "open_chunks", None)):
            raise RuntimeError(f"{w.config.stage} does not take its input in chunks")
        if h.chunk > 0:  # not its start: a repeat after the request ended here, or a stream that lost its start
            state, done, _cancel, _started = w.store.gate(h.uid, w.chain(h).stage)
            if state in keys.TERMINAL or done:
                d.release()
                return None
            raise RuntimeError(f"chunk {h.chunk} arrived without the chunks before it")
        if not w.admit(h):
            d.release()
            return None
        run = w.open_run(h)
        o = Open(h, run, w.executor.open_chunks(h.params, run.ctx))
        if w.chain(h).next_stage is None:  # its output is the job's result: streamed to the store as it comes
            o.writer = w.store.result_writer(h.uid)
        self.open[h.uid] = o
        return o

    def _feed(self, o: Open, h: wm.Header, msg: wm.Message) -> None:
        w = self.w
        t0 = time.perf_counter()
        values = w.values_of(msg)
        self._publish(o, o.stream.feed(w.inputs_of(h, values)))
        o.next += 1
        if not h.final:
            o.busy_s += time.perf_counter() - t0
            return
        last, out = o.stream.finish()
        self._publish(o, last)
        self.fragments.end(h.uid, o.seq)  # before the job completes: a reader that sees it has everything
        o.busy_s += time.perf_counter() - t0
        uploaded = self._uploaded(o)  # the last part, as the ordinary upload: not the stage's service time
        w.close_run(h, o.run, values, out, o.busy_s, uploaded=uploaded)
        w.record(o.busy_s, h.workflow)
        self._drop(h.uid, o.held, True)

    def _publish(self, o: Open, pieces: list[bytes]) -> None:
        for piece in pieces:
            self.fragments.append(o.header.uid, o.seq, piece)  # a repeat after a restart is a no-op
            o.seq += 1
            if o.writer is not None:
                try:
                    o.writer.write(piece)
                except ObjectStoreError as exc:  # aborted already; the result goes up at the end instead
                    log.warning("request %s: streaming its result failed (%s); uploading it at the end", o.header.uid, exc)
                    o.writer = None

    def _uploaded(self, o: Open) -> Any:
        """The streamed result object completed (its ObjectRef), or None: not streamed, under one part
        (the ordinary path stores it), or the stream failed (the ordinary upload at the end instead)."""
        writer, o.writer = o.writer, None
        if writer is None:
            return None
        try:
            return writer.finish()
        except ObjectStoreError as exc:
            log.warning("request %s: completing its streamed result failed (%s); uploading it again", o.header.uid, exc)
            return None

    def _drop(self, uid: str, held: list[Delivery], release: bool) -> None:
        o = self.open.pop(uid, None)
        if o is not None and o.writer is not None:  # ended without its final chunk: no object from it
            o.writer.abort()
            o.writer = None
        if release:
            for d in held:
                d.release()

    def sweep(self) -> None:
        """Release the held chunks of requests whose job ended without their final chunk (cancelled,
        expired, failed upstream: nothing will complete them); at most every :data:`SWEEP_S`."""
        now = time.monotonic()
        if not self.open or now - self._swept < SWEEP_S:
            return
        self._swept = now
        for uid in list(self.open):
            if self.w.store.state(uid) in keys.TERMINAL:
                log.info("request %s ended while its chunks were arriving; released %d", uid,
                         len(self.open[uid].held))
                self._drop(uid, self.open[uid].held, True)
