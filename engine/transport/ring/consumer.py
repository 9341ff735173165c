"""The consumer side of the ring: examine, steal, look ahead, quarantine, free, recover."""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

import xxhash

from engine import envs
from engine.transport import layout as L
from engine.transport.errors import (
    RecordError,
    RegionMismatch,
)
from engine.transport.region import MemoryRegion, create_region, reopen_region
from engine.transport.ring.base import (
    FREE_BATCH,
    LOOKAHEAD,
    SPIN_YIELD_NS,
    RingConfig,
    _ring_run_free,
    _ring_run_mark,
    _ring_spin,
    _ring_take,
    _ring_take_many,
    _RingBase,
)

_T = TypeVar("_T")

# ----------------------------------------------------------------------------------------------
# consumer


@dataclass(slots=True)
class Delivery:
    """A message handed to the consumer: a read-only view valid until :meth:`release`."""

    producer: int
    epoch: int
    seq: int
    view: memoryview
    _consumer: RingConsumer = field(repr=False)
    _entry: _Pending | _Run = field(repr=False)
    _index: int = field(default=-1, repr=False)  # its slot's index in a _Run (recv_many), else -1

    def release(self) -> None:
        """Give the space back (and acknowledge the message to its producer)."""
        self._consumer._release(self)

    def __enter__(self) -> Delivery:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(slots=True)
class _Pending:
    slot: int
    start: int
    units: int
    kind: str  # "delivered" | "skip" | "quarantine"
    producer: int = 0
    epoch: int = 0
    seq: int = 0
    released: bool = False
    view: memoryview | None = None
    sized: bool = True  # False while a stolen, never-published span's size is unknown


class _Run:
    """Consecutive slots [slot, slot + n) taken from the cursor by one native call (recv_many).

    One bookkeeping object for the whole run instead of one per message: ``entries`` is the packed
    per-slot record of the take (layout.RUN_ENTRY), ``released`` a byte per slot (non-zero once the
    slot is finished: released, or dropped / a skip record at take time), ``freed`` how many leading
    slots HEAD has passed and ``head_bytes`` where the first not-yet-freed one starts.
    """

    __slots__ = ("entries", "freed", "head_bytes", "n", "released", "slot", "views")
    kind = "run"

    def __init__(self, slot: int, n: int, start: int, entries: bytes, views: list[memoryview]) -> None:
        self.slot, self.n, self.entries, self.views = slot, n, entries, views
        self.released = bytearray(entries[::L.RUN_ENTRY.size])  # the kind byte: 0 (delivered) is unfinished
        self.freed = 0
        self.head_bytes = start

    def deliveries(self, consumer: RingConsumer) -> Iterator[Delivery]:
        for i in range(self.n):
            kind, _why, producer, epoch, seq, _units, view, _ = L.RUN_ENTRY.unpack_from(self.entries, i * L.RUN_ENTRY.size)
            if kind == L.RUN_DELIVERED:
                yield Delivery(producer, epoch, seq, self.views[view], consumer, self, i)


class Batch:
    """Messages taken together by :meth:`RingConsumer.recv_many`, in ring order.

    :attr:`views` are their payloads (read-only, valid until released). Iterating yields a
    :class:`Delivery` per message, which can be released on its own; :meth:`release` gives
    back every message of the batch not yet released, in one call. An empty batch is false.
    """

    __slots__ = ("_consumer", "_parts", "views")

    def __init__(self, consumer: RingConsumer, parts: list[_Run | Delivery], views: list[memoryview]) -> None:
        self._consumer, self._parts, self.views = consumer, parts, views

    def __len__(self) -> int:
        return len(self.views)

    def __iter__(self) -> Iterator[Delivery]:
        for part in self._parts:
            if type(part) is _Run:
                yield from part.deliveries(self._consumer)
            else:
                yield part  # type: ignore[misc]

    def release(self) -> None:
        """Give back every message of the batch (those released one by one already are skipped)."""
        if self._parts:
            self._consumer._release_batch(self._parts)

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class RingConsumer(_RingBase):
    """The single consumer; it owns the region (creates it, or re-attaches after a crash)."""

    def __init__(self, region: MemoryRegion, config: RingConfig | None = None, *, recover: bool = False) -> None:
        super().__init__(region)
        self._lock = threading.Lock()
        if recover:
            self._read_geometry()
            self.config = RingConfig(self.slots, self.buffer_bytes, self.max_producers,
                                     (config or RingConfig()).lock_timeout, verify_payload=not self.header_only)
        else:
            self.config = config or RingConfig()
            if not self.config.verify_payload and not region.payload_integrity:
                region.close()
                raise ValueError(
                    f"region {region.name!r} ({type(region).__name__}): its transport does not guarantee the "
                    f"integrity of what producers write, so the ring must verify payloads (verify_payload=True)"
                )
            self._format()
            self._read_geometry()
        view = region.local_view()
        if view is None:
            raise RegionMismatch("the consumer must own its region (local view required)")
        self._view = view
        self._ro = view.toreadonly()
        self.lock_timeout = self.config.lock_timeout
        # Seconds recv() polls before sleeping on the doorbell. Short on purpose: on a
        # loaded host a long spin steals the very core the producer needs.
        self.spin = envs.RING_SPIN_US / 1e6
        head = region.load(L.C_HEAD)
        self._head_slot, self._head_bytes = L.unpack_pos(head)
        self._cursor, self._cursor_bytes = self._head_slot, self._head_bytes
        self._pending: collections.deque[_Pending] = collections.deque()
        self._ahead: dict[int, _Pending] = {}  # slots past the cursor already taken (see _look_ahead)
        self._unsized: list[_Pending] = []  # stolen never-published slots whose span end is not yet known
        self._unfreed = 0  # finished slots not yet freed (freeing is batched)
        self._free_batch = max(1, min(FREE_BATCH, self.slots // 4))
        self._fast = _ring_take is not None and hasattr(region, "base")
        if self._fast:
            self._geom = (region.base, self.b_off, self.s_off, self.p_off, self.slots, self.buffer_bytes)  # type: ignore[attr-defined]
            self._run_geom = (region.base, self.s_off, self.slots)  # type: ignore[attr-defined]
        if recover:
            self._recover()
        self._stalled_since: tuple[int, float] | None = None
        from engine.transport.shm import process_start_time

        region.store(L.C_CONSUMER_PID, os.getpid())
        region.store(L.C_CONSUMER_START, process_start_time(os.getpid()))
        region.store(L.C_CLOSED, 0)
        self._stop = threading.Event()
        self._closed = False
        self._hb = threading.Thread(target=self._heartbeat, name=f"onepiece-ring-hb-{region.name}", daemon=True)
        self._hb.start()

    def _format(self) -> None:
        c, r = self.config, self.region
        need = c.region_bytes
        if r.size != need:
            raise RegionMismatch(f"region {r.name!r} has {r.size} bytes; this ring config needs {need}")
        p_off, s_off, b_off = L.ring_layout(c.slots, c.buffer_bytes, c.max_producers)
        view = r.local_view()
        assert view is not None
        view[: b_off] = bytes(b_off)
        for i in range(c.slots):
            r.store(s_off + i * L.SLOT_ENTRY + L.S_W0, L.pack_w0(i, L.FREE))
            r.store(s_off + i * L.SLOT_ENTRY + L.S_W1, L.pack_w1((i - c.slots) & L.SLOT_MASK, 0))
        options = 0 if c.verify_payload else L.OPT_HEADER_ONLY
        for k, v in ((L.C_VERSION, L.VERSION), (L.C_SLOTS, c.slots), (L.C_BUF_BYTES, c.buffer_bytes),
                     (L.C_MAX_PRODUCERS, c.max_producers), (L.C_TOTAL, need), (L.C_BUF_OFFSET, b_off),
                     (L.C_OPTIONS, options)):
            r.store(k, v)
        r.store(L.C_MAGIC, L.MAGIC)  # last: an attacher sees a complete header or none

    def _recover(self) -> None:
        """Resume after a consumer crash: skip what the dead consumer released, redeliver the rest."""
        r = self.region
        for p in range(self.max_producers):
            r.store(self._prod_off(p) + L.P_DELIVERED, r.load(self._prod_off(p) + L.P_ACKED))
        ts, _ = L.unpack_pos(r.load(L.C_TAIL))
        c = self._cursor
        while c != ts:
            s_off = self._slot_off(c)
            slot, state, producer, units = L.unpack_w0(r.load(s_off + L.S_W0))
            if slot != c or state != L.COMMITTED or r.load(s_off + L.S_W2) != L.pack_w1(c, 1):
                break
            rec = L.parse_record(self._view, self.b_off + self._data_phys(self._cursor_bytes, units), units * L.UNIT)
            r.store(self._prod_off(producer) + L.P_DELIVERED, L.pack_epoch_seq(rec.epoch, rec.seq + 1))
            self._pending.append(_Pending(c, self._cursor_bytes, units, "delivered", producer, rec.epoch, rec.seq,
                                          released=True))
            c = self._advance_cursor(c, units)
        r.store(L.C_CURSOR, self._cursor)
        self._advance_head()

    def _heartbeat(self) -> None:
        n = 0
        while not self._stop.wait(0.2):
            n += 1
            self.region.store(L.C_HEARTBEAT, n)

    @classmethod
    def recover(cls, address: str, config: RingConfig | None = None) -> RingConsumer:
        """Re-attach to the ring of a consumer that died, taking over ownership of the region.

        Messages the dead consumer delivered but did not release are delivered again.
        """
        return cls(reopen_region(address), config, recover=True)

    @classmethod
    def create(cls, address: str, config: RingConfig | None = None) -> RingConsumer:
        config = config or RingConfig()
        return cls(create_region(address, config.region_bytes), config)

    # public API ---------------------------------------------------------------------------------
    def recv(self, timeout: float | None = None) -> Delivery | None:
        """The next message, or None when ``timeout`` passes first (None waits forever)."""
        return self._wait(self._step, timeout)

    def recv_many(self, max_n: int = 64, timeout: float | None = None) -> Batch:
        """Up to ``max_n`` messages that are ready, in ring order, as one :class:`Batch`.

        Waits (like :meth:`recv`) only while none is ready; an empty batch when ``timeout``
        passes first. Runs of committed records at the cursor are taken, verified and turned
        into views by one native call each; stalled, stolen and quarantined slots are handled
        exactly as by :meth:`recv`, so a batch may hold messages from before and after them.
        """
        if max_n < 1:
            raise ValueError(f"max_n must be at least 1, got {max_n}")
        batch = self._wait(lambda: self._collect(max_n), timeout)
        return batch if batch is not None else Batch(self, [], [])

    def _wait(self, attempt: Callable[[], _T | None], timeout: float | None) -> _T | None:
        """Call ``attempt`` until it returns something, spinning briefly, then sleeping on the doorbell."""
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        spin_until = now + self.spin
        r = self.region
        while True:
            got = attempt()
            if got is not None:
                return got
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return None
            if now < spin_until:
                # A short spin catches back-to-back messages without a sleep and a wake-up. Natively it
                # waits for the cursor's slot to commit (or TAIL to move) and yields the core every few
                # microseconds, so a producer that shares it runs at once instead of after our spin.
                if self._fast:
                    _ring_spin(*self._run_geom, self._cursor, int((spin_until - now) * 1e9), SPIN_YIELD_NS)
                continue
            # going idle: free what was released, then sleep on the doorbell; wake at least
            # every 50 ms to steal from stalled producers and re-check quarantined spans
            if self._pending:
                self._advance_head()
            bell = r.load(L.C_DOORBELL) & 0xFFFFFFFF
            r.fetch_add(L.C_CONSUMER_WAITING, 1)
            try:
                if L.unpack_pos(r.load(L.C_TAIL))[0] == self._cursor and not self._quarantine_waiting():
                    wait = 0.05 if deadline is None else min(0.05, max(deadline - now, 0))
                    r.wait(L.C_DOORBELL, bell, wait)
                elif self._stalled_since is not None or self._quarantine_waiting():
                    r.wait(L.C_DOORBELL, bell, 0.001)
            finally:
                r.fetch_add(L.C_CONSUMER_WAITING, (1 << 64) - 1)

    def recv_bytes(self, timeout: float | None = None) -> tuple[int, int, bytes] | None:
        """Copying convenience: (producer, seq, payload) with the space already released."""
        d = self.recv(timeout)
        if d is None:
            return None
        with d:
            return d.producer, d.seq, bytes(d.view)

    def close(self) -> None:
        """Idempotent: a second call does nothing (it used to write into the region the first had unmapped,
        a segfault)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._hb.is_alive():
            self._hb.join()
        try:
            self.region.store(L.C_CLOSED, 1)
            self.region.notify(L.C_SPACE_BELL)
        except Exception:
            pass
        self._ro.release()
        for p in [*self._pending, *self._ahead.values()]:
            if type(p) is _Run:
                for v in p.views:
                    v.release()
            elif p.view is not None:
                p.view.release()
        self._pending.clear()
        self._ahead.clear()
        self.region.close()

    def __enter__(self) -> RingConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def held(self) -> int:
        """Slots between HEAD and the cursor (delivered-unreleased, quarantined or finished-not-freed)."""
        return sum(e.n - e.freed if type(e) is _Run else 1 for e in self._pending) + len(self._ahead)

    # the step: examine the slot at the cursor ----------------------------------------------------
    def _quarantine_waiting(self) -> bool:
        return bool(self._pending) and self._pending[0].kind == "quarantine"

    def _collect(self, max_n: int) -> Batch | None:
        """What recv_many hands out now: up to max_n ready messages, or None when none is ready."""
        parts: list[_Run | Delivery] = []
        views: list[memoryview] = []
        r = self.region
        while len(views) < max_n:
            if self._fast and not self._unsized:
                if self._pending and (self._unfreed >= self._free_batch or r.load(L.C_SPACE_WAITERS)):
                    self._advance_head()
                c = self._cursor
                while self._ahead and c in self._ahead:  # taken out of order earlier: walk over it
                    e = self._ahead.pop(c)
                    self._pending.append(e)
                    c = self._advance_cursor(c, e.units)
                limit = max_n - len(views)
                if self._ahead:  # the run must stop before a slot look-ahead already took
                    limit = min(limit, min(L.slot_diff(k, c) for k in self._ahead))
                n, stop, end, entries, vs, counts = _ring_take_many(
                    *self._geom, c, self._cursor_bytes, limit, self.header_only, self._ro)
                if n:
                    run = _Run(c, n, self._cursor_bytes, entries, vs)
                    self._pending.append(run)
                    self._cursor, self._cursor_bytes = (c + n) & L.SLOT_MASK, end
                    self._stalled_since = None
                    self._unfreed += n - counts[0]  # dropped slots and skip records are finished already
                    st = self.stats
                    st.delivered += counts[0]
                    st.corrupt += counts[2]
                    st.stale_epoch += counts[3]
                    st.duplicates += counts[4]
                    st.out_of_order += counts[5]
                    if vs:
                        parts.append(run)
                        views += vs
                if stop == 0:
                    continue
                if stop == 1:
                    break
            # a slot that is not committed (or stolen spans to size): the Python step decides
            # whether to wait, look ahead or steal
            before = (self._cursor, len(self._ahead))
            d = self._step()
            if d is not None:
                parts.append(d)
                views.append(d.view)
            elif (self._cursor, len(self._ahead)) == before:
                break
        return Batch(self, parts, views) if views else None

    def _step(self) -> Delivery | None:
        """One step at the cursor: the next message, or None (waiting, looked past, stolen or skipped)."""
        r = self.region
        if self._pending and (self._unfreed >= self._free_batch or r.load(L.C_SPACE_WAITERS)):
            self._advance_head()
        c = self._cursor
        while self._ahead and c in self._ahead:  # taken out of order earlier: the cursor just walks over it
            e = self._ahead.pop(c)
            self._pending.append(e)
            c = self._advance_cursor(c, e.units)
        if self._unsized and not self._resolve_unsized(c):
            return self._step_unsized(c)
        if self._fast:
            status, producer, epoch, seq, flags, off, length, units = _ring_take(
                *self._geom, c, self._cursor_bytes, self.header_only)
            if status == 0:  # the common case, verified and ordered natively (CURSOR already published)
                self._stalled_since = None
                start = self._cursor_bytes
                self._cursor = (c + 1) & L.SLOT_MASK
                self._cursor_bytes = (start + units * L.UNIT) & L.BYTE_MASK
                skip = bool(flags & L.FLAG_SKIP)
                payload = None if skip else self._ro[off : off + length]
                entry = _Pending(c, start, units, "delivered", producer, epoch, seq, released=skip, view=payload)
                self._pending.append(entry)
                if skip:
                    self._unfreed += 1
                    return None
                self.stats.delivered += 1
                return Delivery(producer, epoch, seq, payload, self, entry)  # type: ignore[arg-type]
            if status == 1:
                return None
            if status >= 3:
                self._stalled_since = None
                self._count_skip(status)
                self._finish_slot(c, units, "skip")
                return None
        return self._examine(c)

    def _examine(self, c: int) -> Delivery | None:
        """The slot at the cursor by its words, where the native take could not decide (or is not built):
        take it, wait for it, look past it, steal it, or finish what a previous consumer stole."""
        r = self.region
        ts, tb = L.unpack_pos(r.load(L.C_TAIL))
        if ts == c:
            return None
        w0 = r.load(self._slot_off(c) + L.S_W0)
        slot, state, producer, units = L.unpack_w0(w0)
        if slot != c & L.SLOT_MASK:
            slot, state = c, L.FREE  # still last lap's FREE word: reserved, not yet claimed
            w0 = None
        if state == L.COMMITTED:
            self._stalled_since = None
            return self._take(c, self._cursor_bytes, producer, units, ahead=False)
        if state in (L.FREE, L.RESERVED):
            now = time.monotonic()
            if self._stalled_since is None or self._stalled_since[0] != c:
                self._stalled_since = (c, now)
            elif now - self._stalled_since[1] >= self.lock_timeout:
                return self._steal(c, w0, state, producer, units, ts, tb)
            return self._look_ahead(c, ts)
        # ABANDONED / ABANDON_ACKED at the cursor: a previous consumer stole it before a crash
        self._stalled_since = None
        if state == L.ABANDONED and producer == L.NOBODY:
            self._unsized_slot(c)
        elif state == L.ABANDONED:
            self._finish_slot(c, units, "quarantine", producer)
        else:
            self._finish_slot(c, units, "skip")
        return None

    def _step_unsized(self, c: int) -> Delivery | None:
        """The cursor's slot follows stolen slots of unknown size and has not published its start."""
        r = self.region
        ts, _tb = L.unpack_pos(r.load(L.C_TAIL))
        w0 = r.load(self._slot_off(c) + L.S_W0)
        slot, state, _producer, _units = L.unpack_w0(w0)
        if slot != c or state != L.FREE:
            return None  # it published and claimed meanwhile: the next step sizes the run
        now = time.monotonic()
        if self._stalled_since is None or self._stalled_since[0] != c:
            self._stalled_since = (c, now)
        elif now - self._stalled_since[1] >= self.lock_timeout:
            return self._steal(c, w0, state, 0, 0, ts, 0)
        return self._look_ahead(c, ts)

    def _look_ahead(self, c: int, ts: int) -> Delivery | None:
        """Deliver a committed record past the stalled slot at the cursor.

        Safe for per-producer order: a producer has at most one reservation open,
        so the stalled slot's producer has no later slot, and every other
        producer's later records come after its earlier ones in slot order.
        This is what keeps one descheduled producer from stalling all the others.
        """
        r = self.region
        end = min(L.slot_diff(ts, c), LOOKAHEAD)
        for i in range(1, end):
            k = (c + i) & L.SLOT_MASK
            if k in self._ahead:
                continue
            slot, state, producer, units = L.unpack_w0(r.load(self._slot_off(k) + L.S_W0))
            if slot != k or state != L.COMMITTED:
                continue
            w1 = r.load(self._slot_off(k) + L.S_W1)
            if w1 >> L.BYTE_BITS != k:
                continue
            if self._fast:
                return self._take_ahead_fast(k, w1 & L.BYTE_MASK)
            return self._take(k, w1 & L.BYTE_MASK, producer, units, ahead=True)
        return None

    def _take_ahead_fast(self, k: int, start: int) -> Delivery | None:
        """_take(ahead=True) in one native call: verified and ordered as at the cursor, CURSOR left alone."""
        status, producer, epoch, seq, flags, off, length, units = _ring_take(
            *self._geom, k, start, self.header_only, 0)
        if status == 2:
            return None  # changed under us (it cannot while COMMITTED: only we reset it)
        if status >= 3:
            self._count_skip(status)
            self._ahead[k] = _Pending(k, start, units, "skip", released=True)
            return None
        skip = bool(flags & L.FLAG_SKIP)
        payload = None if skip else self._ro[off : off + length]
        entry = _Pending(k, start, units, "delivered", producer, epoch, seq, released=skip, view=payload)
        self._ahead[k] = entry
        if skip:
            return None
        self.stats.delivered += 1
        return Delivery(producer, epoch, seq, payload, self, entry)  # type: ignore[arg-type]

    def _advance_cursor(self, c: int, units: int) -> int:
        self._cursor = c = (c + 1) & L.SLOT_MASK
        self._cursor_bytes = (self._cursor_bytes + units * L.UNIT) & L.BYTE_MASK
        self.region.store(L.C_CURSOR, c)
        return c

    def _steal(self, c: int, w0: int | None, state: int, producer: int, units: int, ts: int, tb: int) -> None:
        r = self.region
        s_off = self._slot_off(c)
        expected = w0 if w0 is not None else L.pack_w0(c, L.FREE)
        if state == L.FREE:
            # A span nobody has written (its producer's claim CAS will now fail). Its size is
            # not known yet: it ends where the next published slot starts, or at TAIL. The
            # cursor moves on; _resolve_unsized settles the bytes (waiting on nothing).
            if r.cas(s_off + L.S_W0, expected, L.pack_w0(c, L.ABANDONED, L.NOBODY, 0)) != expected:
                return None  # it changed under us: examine it again
            self.stats.steals += 1
            self._stalled_since = None
            self._unsized_slot(c)
            return None
        stolen = L.pack_w0(c, L.ABANDONED, producer, units)
        if r.cas(s_off + L.S_W0, expected, stolen) != expected:
            return None  # committed at the last moment: take it on the next step
        self.stats.steals += 1
        self.stats.quarantined += 1
        self._stalled_since = None
        self._finish_slot(c, units, "quarantine", producer)
        return None

    def _unsized_slot(self, c: int) -> None:
        start = self._cursor_bytes if not self._unsized else self._unsized[0].start
        entry = _Pending(c, start, 0, "skip", released=True, sized=False)
        self._pending.append(entry)
        self._unsized.append(entry)
        self._unfreed += 1
        self._cursor = (c + 1) & L.SLOT_MASK
        self.region.store(L.C_CURSOR, self._cursor)

    def _resolve_unsized(self, ts: int) -> bool:
        """Size the run of stolen, never-published slots behind the cursor, if its end is known."""
        r = self.region
        c = self._cursor
        tail = r.load(L.C_TAIL)
        if tail >> L.BYTE_BITS == c:
            end = tail & L.BYTE_MASK  # TAIL packs (slot, bytes): its bytes are where slot c starts
        else:
            w1 = r.load(self._slot_off(c) + L.S_W1)
            if w1 >> L.BYTE_BITS != c:
                return False
            end = w1 & L.BYTE_MASK
        first = self._unsized[0]
        first.units = ((end - first.start) & L.BYTE_MASK) // L.UNIT
        for e in self._unsized:
            e.sized = True
        self._unsized.clear()
        self._cursor_bytes = end
        return True

    def _finish_slot(self, c: int, units: int, kind: str, producer: int = 0) -> None:
        entry = _Pending(c, self._cursor_bytes, units, kind, producer)
        entry.released = kind == "skip"
        self._unfreed += 1
        self._pending.append(entry)
        self._advance_cursor(c, units)

    def _count_skip(self, status: int) -> None:
        if status == 3:
            self.stats.corrupt += 1
        elif status == 4:
            self.stats.stale_epoch += 1
        elif status == 5:
            self.stats.duplicates += 1
        else:
            self.stats.out_of_order += 1

    def _settle(self, entry: _Pending, ahead: bool) -> None:
        if ahead:
            self._ahead[entry.slot] = entry
        else:
            self._pending.append(entry)
            self._advance_cursor(entry.slot, entry.units)

    def _take(self, c: int, start: int, producer: int, units: int, ahead: bool) -> Delivery | None:
        base = self.b_off + self._data_phys(start, units)
        view = self._ro
        ok = False
        try:
            rec = L.parse_record(view, base, units * L.UNIT)
            header_only = bool(rec.flags & L.FLAG_HEADER_ONLY)
            if rec.producer == producer and rec.slot == c & L.SLOT_MASK and (self.header_only or not header_only):
                payload = view[base + L.RECORD_HEADER : base + L.RECORD_HEADER + rec.length]
                h = xxhash.xxh3_64(view[base : base + L.CHECKSUM_COVERS])
                if not header_only:
                    h.update(payload)
                ok = h.intdigest() == rec.checksum
        except RecordError:
            ok = False
        skip = _Pending(c, start, units, "skip", released=True)
        if not ok:
            self.stats.corrupt += 1
            self._settle(skip, ahead)
            return None
        flags, epoch, seq = rec.flags, rec.epoch, rec.seq
        # ordering and de-duplication per (producer, epoch)
        known = L.unpack_epoch_seq(self.region.load(self._prod_off(producer) + L.P_DELIVERED))
        owner_epoch = (self.region.load(self._prod_off(producer) + L.P_OWNER) >> 8) & 0xFFFFFF
        if epoch != owner_epoch:
            self.stats.stale_epoch += 1  # an older incarnation of a re-registered producer: fenced
            self._settle(skip, ahead)
            return None
        nxt = known[1] if known[0] == epoch else 0
        if seq != nxt:
            if seq < nxt:
                self.stats.duplicates += 1
            else:
                self.stats.out_of_order += 1
            self._settle(skip, ahead)
            return None
        self.region.store(self._prod_off(producer) + L.P_DELIVERED, L.pack_epoch_seq(epoch, seq + 1))
        is_skip = bool(flags & L.FLAG_SKIP)
        entry = _Pending(c, start, units, "delivered", producer, epoch, seq,
                         released=is_skip, view=None if is_skip else payload)
        self._settle(entry, ahead)
        if is_skip:
            payload.release()
            return None
        self.stats.delivered += 1
        return Delivery(producer, epoch, seq, payload, self, entry)

    # freeing space ---------------------------------------------------------------------------------
    def _release(self, d: Delivery) -> None:
        if self._mark_released(d):
            self._unfreed += 1
            self._maybe_free()

    def _mark_released(self, d: Delivery) -> bool:
        """Mark one delivered message released; False if it already was."""
        e = d._entry
        if type(e) is _Run:
            i = d._index
            if e.released[i]:
                return False
            e.released[i] = 1
            slot = (e.slot + i) & L.SLOT_MASK
            d.view.release()
        else:
            if e.released:
                return False
            e.released = True
            slot = e.slot
            if e.view is not None:
                e.view.release()
                e.view = None
        self.stats.released += 1
        # mark it in the slot, so a consumer that recovers after our crash never delivers it again
        self.region.store(self._slot_off(slot) + L.S_W2, L.pack_w1(slot, 1))
        return True

    def _release_batch(self, parts: list[_Run | Delivery]) -> None:
        """Release every message of a batch: per run, one native call marks them all (W2)."""
        n = 0
        for part in parts:
            if type(part) is _Run:
                left = part.released.count(0)
                if not left:
                    continue
                _ring_run_mark(*self._run_geom, part.entries, part.slot, 0, part.n)
                part.released[:] = b"\x01" * part.n
                for v in part.views:
                    v.release()
                self.stats.released += left
                n += left
            elif self._mark_released(part):  # type: ignore[arg-type]
                n += 1
        if n:
            self._unfreed += n
            self._maybe_free()

    def _maybe_free(self) -> None:
        # Freeing is batched while more messages are already waiting for us (a burst):
        # producers learn of free space and acknowledgements every FREE_BATCH releases, at
        # once when one of them waits for space, and immediately when we are caught up.
        r = self.region
        if (
            self._unfreed >= self._free_batch
            or r.load(L.C_SPACE_WAITERS)
            or L.unpack_pos(r.load(L.C_TAIL))[0] == self._cursor
        ):
            self._advance_head()

    def _quarantine_cleared(self, e: _Pending) -> bool:
        r = self.region
        w0 = r.load(self._slot_off(e.slot) + L.S_W0)
        if L.unpack_w0(w0)[1] == L.ABANDON_ACKED:
            return True
        off = self._prod_off(e.producer)
        pid, start = r.load(off + L.P_PID), r.load(off + L.P_START)
        # the stalled producer is dead (process gone, connection closed): it can write no more
        return bool(pid) and not r.peer_alive(pid, start)

    def _advance_head(self) -> None:
        r = self.region
        moved = False
        acked: dict[int, tuple[int, int]] = {}
        while self._pending:
            e = self._pending[0]
            if type(e) is _Run:
                j = e.released.find(0, e.freed)  # the run is finished up to its first unreleased slot
                if j < 0:
                    j = e.n
                if j > e.freed:
                    nbytes, run_acks = _ring_run_free(*self._run_geom, e.entries, e.slot, e.freed, j)
                    acked.update(run_acks)
                    e.freed = j
                    e.head_bytes = (e.head_bytes + nbytes) & L.BYTE_MASK
                    self._head_slot = (e.slot + j) & L.SLOT_MASK
                    self._head_bytes = e.head_bytes
                    moved = True
                if j < e.n:
                    break
                self._pending.popleft()
                continue
            if not e.sized:
                break
            if e.kind == "quarantine":
                if not self._quarantine_cleared(e):
                    break
            elif not e.released:
                break
            self._pending.popleft()
            r.store(self._slot_off(e.slot) + L.S_W0, L.pack_w0(e.slot + self.slots, L.FREE))
            if e.kind == "delivered":
                acked[e.producer] = (e.epoch, e.seq + 1)
            self._head_slot = (e.slot + 1) & L.SLOT_MASK
            self._head_bytes = (e.start + e.units * L.UNIT) & L.BYTE_MASK
            moved = True
        self._unfreed = 0
        if not moved:
            return
        for p, (epoch, seq) in acked.items():
            r.store(self._prod_off(p) + L.P_ACKED, L.pack_epoch_seq(epoch, seq))
        r.store(L.C_HEAD, L.pack_pos(self._head_slot, self._head_bytes))
        if r.load(L.C_SPACE_WAITERS):
            r.notify(L.C_SPACE_BELL)


