"""The consumer side of the ring: examine, steal, look ahead, quarantine, free, recover."""

from __future__ import annotations

import collections
import os
import threading
import time
from dataclasses import dataclass, field

import xxhash

from engine import envs
from engine.transport import layout as L
from engine.transport.errors import (
    RecordError,
    RegionMismatch,
)
from engine.transport.region import MemoryRegion
from engine.transport.ring.base import FREE_BATCH, LOOKAHEAD, RingConfig, _ring_take, _RingBase

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
    _entry: _Pending = field(repr=False)

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


class RingConsumer(_RingBase):
    """The single consumer; it owns the region (creates it, or re-attaches after a crash)."""

    def __init__(self, region: MemoryRegion, config: RingConfig | None = None, *, recover: bool = False) -> None:
        super().__init__(region)
        self._lock = threading.Lock()
        if recover:
            self._read_geometry()
            self.config = RingConfig(self.slots, self.buffer_bytes, self.max_producers,
                                     (config or RingConfig()).lock_timeout)
        else:
            self.config = config or RingConfig()
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
        if recover:
            self._recover()
        self._stalled_since: tuple[int, float] | None = None
        from engine.transport.shm import process_start_time

        region.store(L.C_CONSUMER_PID, os.getpid())
        region.store(L.C_CONSUMER_START, process_start_time(os.getpid()))
        region.store(L.C_CLOSED, 0)
        self._stop = threading.Event()
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
        for k, v in ((L.C_VERSION, L.VERSION), (L.C_SLOTS, c.slots), (L.C_BUF_BYTES, c.buffer_bytes),
                     (L.C_MAX_PRODUCERS, c.max_producers), (L.C_TOTAL, need), (L.C_BUF_OFFSET, b_off)):
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
        from engine.transport.region import reopen_region

        return cls(reopen_region(address), config, recover=True)

    @classmethod
    def create(cls, address: str, config: RingConfig | None = None) -> RingConsumer:
        from engine.transport.region import create_region

        config = config or RingConfig()
        return cls(create_region(address, config.region_bytes), config)

    # public API ---------------------------------------------------------------------------------
    def recv(self, timeout: float | None = None) -> Delivery | None:
        """The next message, or None when ``timeout`` passes first (None waits forever)."""
        now = time.monotonic()
        deadline = None if timeout is None else now + timeout
        spin_until = now + self.spin
        r = self.region
        while True:
            d = self._step()
            if d is not None:
                return d
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return None
            if now < spin_until:
                continue  # a short spin catches back-to-back messages without a syscall
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
            if p.view is not None:
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
        return len(self._pending) + len(self._ahead)

    # the step: examine the slot at the cursor ----------------------------------------------------
    def _quarantine_waiting(self) -> bool:
        return bool(self._pending) and self._pending[0].kind == "quarantine"

    def _step(self) -> Delivery | None:
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
            status, producer, epoch, seq, flags, off, length, units = _ring_take(*self._geom, c, self._cursor_bytes)
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
            return self._take(k, w1 & L.BYTE_MASK, producer, units, ahead=True)
        return None

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
            if rec.producer == producer and rec.slot == c & L.SLOT_MASK:
                payload = view[base + L.RECORD_HEADER : base + L.RECORD_HEADER + rec.length]
                h = xxhash.xxh3_64(view[base : base + L.CHECKSUM_COVERS])
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
        e = d._entry
        if e.released:
            return
        e.released = True
        self.stats.released += 1
        # mark it in the slot, so a consumer that recovers after our crash never delivers it again
        self.region.store(self._slot_off(e.slot) + L.S_W2, L.pack_w1(e.slot, 1))
        if e.view is not None:
            e.view.release()
            e.view = None
        # Freeing is batched while more messages are already waiting for us (a burst):
        # producers learn of free space and acknowledgements every FREE_BATCH releases, at
        # once when one of them waits for space, and immediately when we are caught up.
        self._unfreed += 1
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


