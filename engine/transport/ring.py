"""The zero-loss multi-producer, single-consumer double ring buffer.

The protocol is in docs/ring-protocol.md (and, as a Promela model, in
engine/transport/model/ring.pml). In short: producers reserve a slot and a
byte span with one CAS on TAIL, claim the slot with a CAS on its state word,
write header + payload, and commit with a second CAS; the consumer steals a
slot whose producer stalls past the lock timeout, which fences that producer
(its commit CAS fails) and quarantines the span until the producer
acknowledges or dies. Records carry (producer, epoch, seq) and an xxh3
checksum; producers keep messages until the consumer acknowledges them and
resend what was dropped; the consumer drops duplicates.

Everything goes through :class:`~engine.transport.region.MemoryRegion`, so the
same code runs over shared memory, the TCP emulation and RDMA verbs.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import xxhash

from engine import envs
from engine.transport import layout as L
from engine.transport.errors import (
    ConsumerGone,
    MessageTooLarge,
    RecordError,
    RegionMismatch,
    RingFull,
)
from engine.transport.region import MemoryRegion

try:  # native fast paths; absent when the extension was built without xxhash.h
    from engine.transport._atomics import ring_send as _ring_send
    from engine.transport._atomics import ring_take as _ring_take
except ImportError:  # pragma: no cover - depends on the build
    _ring_send = _ring_take = None

Buffer = bytes | bytearray | memoryview
Refill = Callable[[memoryview], None]

_COPY_CHUNK = 256 << 10
LOOKAHEAD = 64  # how far past a stalled slot the consumer looks for committed records
POLL_EVERY = 32  # a producer checks acknowledgements every this many sends (or 1 ms)
FREE_BATCH = 16  # the consumer frees space (and acknowledges) every this many finished slots  # copy and hash in L2-sized chunks: one pass over memory


@dataclass
class RingStats:
    """Counters of one ring end; exported as Prometheus metrics by engine.transport.metrics."""

    sent: int = 0
    cas_attempts: int = 0
    cas_retries: int = 0
    space_waits: int = 0
    fenced: int = 0
    retransmits: int = 0
    delivered: int = 0
    released: int = 0
    steals: int = 0
    quarantined: int = 0
    corrupt: int = 0
    duplicates: int = 0
    out_of_order: int = 0
    stale_epoch: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class RingConfig:
    slots: int = 1024
    buffer_bytes: int = 64 << 20
    max_producers: int = 64
    lock_timeout: float = 0.5  # seconds a slot may stay claimed-but-uncommitted before it is stolen

    def __post_init__(self) -> None:
        if not 2 <= self.slots <= (1 << 22):
            raise ValueError(f"slots must be in [2, 2**22], got {self.slots}")
        if self.buffer_bytes % L.UNIT or not 4 * L.UNIT <= self.buffer_bytes <= (1 << 36):
            raise ValueError(f"buffer_bytes must be a multiple of {L.UNIT} in [256, 2**36], got {self.buffer_bytes}")
        if not 1 <= self.max_producers <= L.MAX_PRODUCERS:
            raise ValueError(f"max_producers must be in [1, {L.MAX_PRODUCERS}], got {self.max_producers}")

    @property
    def region_bytes(self) -> int:
        return L.region_bytes(self.slots, self.buffer_bytes, self.max_producers)

    @property
    def max_message(self) -> int:
        """Largest payload: half the buffer (so a record always fits an empty ring, wrap included)."""
        return min(self.buffer_bytes // 2, L.MAX_UNITS * L.UNIT) - L.RECORD_HEADER


class _RingBase:
    def __init__(self, region: MemoryRegion) -> None:
        self.region = region
        self.stats = RingStats()

    def _read_geometry(self) -> None:
        r = self.region
        if r.size < L.CTRL_BYTES:
            raise RegionMismatch(f"region {r.name!r} is {r.size} bytes: too small to hold a ring")
        magic, version = r.load(L.C_MAGIC), r.load(L.C_VERSION)
        if magic != L.MAGIC:
            raise RegionMismatch(f"region {r.name!r} holds no OnePiece ring (magic {magic:#x})")
        if version != L.VERSION:
            raise RegionMismatch(f"region {r.name!r} holds ring version {version}, this code speaks {L.VERSION}")
        self.slots = r.load(L.C_SLOTS)
        self.buffer_bytes = r.load(L.C_BUF_BYTES)
        self.max_producers = r.load(L.C_MAX_PRODUCERS)
        total = r.load(L.C_TOTAL)
        p_off, s_off, b_off = L.ring_layout(self.slots, self.buffer_bytes, self.max_producers)
        if total != r.size or b_off + self.buffer_bytes != total or r.load(L.C_BUF_OFFSET) != b_off:
            raise RegionMismatch(
                f"region {r.name!r}: header says {total} bytes (buffer at {r.load(L.C_BUF_OFFSET)}), "
                f"region has {r.size}, layout needs {b_off + self.buffer_bytes}"
            )
        self.p_off, self.s_off, self.b_off = p_off, s_off, b_off
        self.max_message = min(self.buffer_bytes // 2, L.MAX_UNITS * L.UNIT) - L.RECORD_HEADER

    def _slot_off(self, slot: int) -> int:
        return self.s_off + (slot % self.slots) * L.SLOT_ENTRY

    def _prod_off(self, producer: int) -> int:
        return self.p_off + producer * L.PRODUCER_ENTRY

    def _data_phys(self, start: int, units: int) -> int:
        """Physical offset (within the buffer) of a record whose span starts at logical ``start``."""
        p = start % self.buffer_bytes
        return 0 if p + units * L.UNIT > self.buffer_bytes else p

    def occupancy(self) -> float:
        _, hb = L.unpack_pos(self.region.load(L.C_HEAD))
        _, tb = L.unpack_pos(self.region.load(L.C_TAIL))
        return ((tb - hb) & L.BYTE_MASK) / self.buffer_bytes


# ----------------------------------------------------------------------------------------------
# producer


@dataclass(slots=True)
class _Outgoing:
    seq: int
    length: int
    data: Buffer | None
    refill: Refill | None
    slot: int | None = None
    flags: int = 0


class Reservation:
    """A writable span of ``size`` bytes in the ring; fill :attr:`view`, then :meth:`commit`."""

    def __init__(self, producer: RingProducer, size: int, view: memoryview, state: tuple) -> None:
        self._producer = producer
        self.size = size
        self.view = view
        self._state = state
        self.done = False

    def commit(self, refill: Refill | None = None) -> int:
        """Publish the bytes; returns the message's sequence number.

        ``refill(view)`` is kept to rewrite the payload if the message must be
        resent (the zero-copy path keeps no copy). Without it, a copy is kept.
        """
        if self.done:
            raise RuntimeError("reservation already committed or aborted")
        self.done = True
        return self._producer._commit_reservation(self, refill)

    def abort(self) -> None:
        """Give the span back without sending (it becomes a skipped record)."""
        if not self.done:
            self.done = True
            self._producer._abort_reservation(self)


class RingProducer(_RingBase):
    """One producer of a ring (not thread-safe: one per thread or process).

    ``producer_id`` identifies the producer across restarts; registering again
    under the same id starts a new epoch, which fences the old incarnation.
    """

    def __init__(
        self,
        region: MemoryRegion,
        producer_id: int | None = None,
        *,
        send_timeout: float = 60.0,
        consumer_timeout: float = 10.0,
    ) -> None:
        super().__init__(region)
        self._read_geometry()
        self.send_timeout = send_timeout
        self.consumer_timeout = consumer_timeout
        self._view = region.local_view()
        self._fast = self._view is not None and _ring_send is not None and hasattr(region, "base")
        self.producer_id, self.epoch = self._register(producer_id)
        self._next_seq = 0
        self._unacked: collections.deque[_Outgoing] = collections.deque()
        self._to_resend = 0  # kept messages whose copy in the ring was dropped
        # send() looks for acknowledgements and losses every POLL_EVERY sends or 1 ms
        self._sends_since_poll = 0
        self._last_poll = 0.0
        self._last_hb = (region.load(L.C_HEARTBEAT), time.monotonic())
        self._closed = False
        # Test hook: called with "reserved", "claimed", "mid_payload" or "before_commit" (fault injection).
        self.fault_hook: Callable[[str], None] | None = None

    # registration ------------------------------------------------------------------------
    def _register(self, producer_id: int | None) -> tuple[int, int]:
        r = self.region
        ids = range(self.max_producers) if producer_id is None else [producer_id]
        if producer_id is not None and not 0 <= producer_id < self.max_producers:
            raise ValueError(f"producer_id must be in [0, {self.max_producers}), got {producer_id}")
        pid, start = r.identity()
        for pidx in ids:
            off = self._prod_off(pidx)
            old = r.load(off + L.P_OWNER)
            if producer_id is None and old & 0xFF == L.OWNER_ALIVE:
                continue
            epoch = (old >> 8) + 1
            r.store(off + L.P_PID, pid)
            r.store(off + L.P_START, start)
            if r.cas(off + L.P_OWNER, old, (epoch << 8) | L.OWNER_ALIVE) == old:
                return pidx, epoch & 0xFFFFFF
        raise RingFull(f"ring {r.name!r}: all {self.max_producers} producer entries are taken")

    # public API -----------------------------------------------------------------------------
    def send(self, data: Buffer, *, timeout: float | None = None) -> int:
        """Copy ``data`` into the ring; returns its sequence number once committed.

        The producer keeps a reference to ``data`` (not a copy) until the consumer
        releases the message, to resend it if it was dropped: do not mutate it.
        If this raises (:class:`RingFull`, :class:`ConsumerGone`), the message was
        not accepted and nothing of it will be delivered.
        """
        size = data.nbytes if isinstance(data, memoryview) else len(data)
        self._check_size(size)
        self._sends_since_poll += 1
        if self._sends_since_poll >= POLL_EVERY or self._to_resend or time.monotonic() - self._last_poll > 0.001:
            self.poll()
        self._resend_pending(timeout)
        out = _Outgoing(self._next_seq, size, data, None)
        self._accept(out)
        try:
            self._transmit(out, timeout)
        except BaseException:
            self._unaccept(out)
            raise
        return out.seq

    def reserve(self, size: int, *, timeout: float | None = None) -> Reservation:
        """Reserve ``size`` payload bytes and return a writable view into the ring (zero-copy)."""
        self._check_size(size)
        self.poll()
        self._resend_pending(timeout)
        out = _Outgoing(self._next_seq, size, None, None)
        self._accept(out)
        try:
            while True:
                got = self._reserve_span(out, timeout)
                if got is not None:
                    break
                self.stats.fenced += 1
        except BaseException:
            self._unaccept(out)
            raise
        slot, units, phys = got
        return Reservation(self, size, self._payload_view(phys, size), (out, slot, units, phys))

    def poll(self) -> int:
        """Drop acknowledged messages, resend dropped ones; returns how many are unacknowledged.

        Never blocks: resends that find the ring full stay pending for the next call.
        """
        r = self.region
        self._sends_since_poll = 0
        self._last_poll = time.monotonic()
        if not self._unacked:
            return 0
        off = self._prod_off(self.producer_id)
        acked = self._seq_for_epoch(r.load(off + L.P_ACKED))
        while self._unacked and self._unacked[0].seq < acked:
            self._unacked.popleft()
        if not self._unacked:
            return 0
        first = next((o for o in self._unacked if o.slot is not None), None)
        if first is not None and L.slot_diff(r.load(L.C_CURSOR), first.slot) > 0:
            delivered = self._seq_for_epoch(r.load(off + L.P_DELIVERED))
            if delivered <= first.seq:
                # the consumer passed it without delivering it: go back N
                for out in self._unacked:
                    if out.seq >= delivered and out.slot is not None:
                        out.slot = None
                        self._to_resend += 1
                        self.stats.retransmits += 1
        if self._to_resend:
            try:
                self._resend_pending(0.0)
            except RingFull:
                pass
        return len(self._unacked)

    def _accept(self, out: _Outgoing) -> None:
        self._next_seq += 1
        self._unacked.append(out)

    def _unaccept(self, out: _Outgoing) -> None:
        # nothing with this sequence number was committed: take it back so the stream has no gap
        if self._unacked and self._unacked[-1] is out:
            self._unacked.pop()
            self._next_seq -= 1

    def _resend_pending(self, timeout: float | None) -> None:
        """Retransmit, in order, every kept message whose copy in the ring was dropped."""
        if not self._to_resend:
            return
        for out in self._unacked:
            if out.slot is None:
                self._transmit(out, timeout)
                self._to_resend -= 1

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the consumer has released every message sent so far (resending as needed)."""
        deadline = time.monotonic() + (self.send_timeout if timeout is None else timeout)
        delay = 1e-5
        while self.poll():
            self._check_consumer()
            if time.monotonic() > deadline:
                raise RingFull(
                    f"ring {self.region.name!r}: {len(self._unacked)} messages not acknowledged within the timeout"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    @property
    def unacked(self) -> int:
        return len(self._unacked)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        off = self._prod_off(self.producer_id)
        old = self.region.load(off + L.P_OWNER)
        if old >> 8 == self.epoch and old & 0xFF == L.OWNER_ALIVE:
            self.region.cas(off + L.P_OWNER, old, (old & ~0xFF) | L.OWNER_CLOSED)

    # internals -------------------------------------------------------------------------------
    def _seq_for_epoch(self, word: int) -> int:
        epoch, seq = L.unpack_epoch_seq(word)
        return seq if epoch == self.epoch else 0

    def _check_size(self, size: int) -> None:
        if size > self.max_message:
            raise MessageTooLarge(size, self.max_message, self.region.name)
        if size < 0:
            raise ValueError("negative size")

    def _payload_view(self, phys: int, size: int) -> memoryview:
        start = self.b_off + phys + L.RECORD_HEADER
        if self._view is not None:
            return self._view[start : start + size]
        return memoryview(bytearray(size))  # remote: staged locally, written on commit

    def _transmit(self, out: _Outgoing, timeout: float | None) -> None:
        if self._fast and out.data is not None and self.fault_hook is None:
            return self._transmit_fast(out, timeout)
        while True:
            got = self._reserve_span(out, timeout)
            if got is None:
                self.stats.fenced += 1
                continue
            slot, units, phys = got
            if out.data is not None:
                checksum = self._write_payload(phys, out.data, slot, out)
            else:
                view = self._payload_view(phys, out.length)
                if out.refill is None:
                    raise RuntimeError("zero-copy message without refill cannot be resent")
                out.refill(view)
                checksum = self._finish_view(phys, view, slot, out)
            if self._commit(slot, units, phys, out, checksum):
                return
            self.stats.fenced += 1

    def _wait_for_space(self, head: int, deadline: float | None, timeout: float | None, units: int) -> float:
        """The ring is full: sleep on the space bell until the consumer frees something.

        Returns the deadline (set on the first call); raises RingFull past it and
        ConsumerGone when the consumer is dead or closed.
        """
        r = self.region
        self.stats.space_waits += 1
        now = time.monotonic()
        limit = self.send_timeout if timeout is None else timeout
        if deadline is None:
            deadline = now + limit
        self._check_consumer()
        if now >= deadline:
            ts, tb = L.unpack_pos(r.load(L.C_TAIL))
            hs, hb = L.unpack_pos(r.load(L.C_HEAD))
            raise RingFull(
                f"ring {r.name!r} full for {limit:.1f}s: {(tb - hb) & L.BYTE_MASK} of {self.buffer_bytes} bytes "
                f"and {(ts - hs) & L.SLOT_MASK} of {self.slots} slots in use, need {units * L.UNIT} bytes; "
                f"the consumer is alive but not draining"
            )
        r.fetch_add(L.C_SPACE_WAITERS, 1)
        try:
            bell = r.load(L.C_SPACE_BELL) & 0xFFFFFFFF
            if r.load(L.C_HEAD) == head:
                r.wait(L.C_SPACE_BELL, bell, min(0.05, deadline - now))
        finally:
            r.fetch_add(L.C_SPACE_WAITERS, (1 << 64) - 1)
        return deadline

    def _transmit_fast(self, out: _Outgoing, timeout: float | None) -> None:
        """Steps 1-7 in one native call (local regions only; same protocol as the Python steps)."""
        r, deadline = self.region, None
        args = (self.region.base, self.b_off, self.s_off, self.p_off, self.slots, self.buffer_bytes,  # type: ignore[attr-defined]
                self.producer_id, self.epoch, out.seq, out.flags)
        data = out.data
        while True:
            self.stats.cas_attempts += 1
            status, slot, units, retries = _ring_send(*args, data)
            self.stats.cas_retries += retries
            if status == 0:
                out.slot = slot
                self.stats.sent += 1
                return
            if status == 1:
                self.stats.cas_retries += 1
                deadline = self._wait_for_space(r.load(L.C_HEAD), deadline, timeout, L.units_for(out.length))
            else:
                self.stats.fenced += 1

    def _reserve_span(self, out: _Outgoing, timeout: float | None) -> tuple[int, int, int] | None:
        """Steps 1-4 of the protocol. Returns (slot, units, data phys offset), or None if fenced."""
        r = self.region
        need = L.units_for(out.length)
        deadline = None
        while True:
            self.stats.cas_attempts += 1
            tail = r.load(L.C_TAIL)
            head = r.load(L.C_HEAD)
            ts, tb = L.unpack_pos(tail)
            hs, hb = L.unpack_pos(head)
            p = tb % self.buffer_bytes
            units = need if p + need * L.UNIT <= self.buffer_bytes else need + (self.buffer_bytes - p) // L.UNIT
            used = (tb - hb) & L.BYTE_MASK
            if (ts - hs) & L.SLOT_MASK < self.slots and used + units * L.UNIT <= self.buffer_bytes:
                new = L.pack_pos(ts + 1, tb + units * L.UNIT)
                if r.cas(L.C_TAIL, tail, new) == tail:
                    if self.fault_hook is not None:
                        self.fault_hook("reserved")
                    break
                self.stats.cas_retries += 1
                continue
            self.stats.cas_retries += 1
            deadline = self._wait_for_space(head, deadline, timeout, units)
        slot, start = ts, tb
        s_off = self._slot_off(slot)
        # step 3: publish the span's start, unless a later lap already owns the entry
        w1 = r.load(s_off + L.S_W1)
        while True:
            if L.slot_diff(w1 >> L.BYTE_BITS, slot) > 0:
                return None  # we are a zombie from an older lap
            prev = r.cas(s_off + L.S_W1, w1, L.pack_w1(slot, start))
            if prev == w1:
                break
            w1 = prev
        # step 4: claim the slot; failure means the consumer stole it while we were slow
        free = L.pack_w0(slot, L.FREE)
        claimed = L.pack_w0(slot, L.RESERVED, self.producer_id, units)
        if r.cas(s_off + L.S_W0, free, claimed) != free:
            return None
        out.slot = slot
        if self.fault_hook is not None:
            self.fault_hook("claimed")
        return slot, units, self._data_phys(start, units)

    def _header(self, out: _Outgoing, slot: int, checksum: int = 0) -> bytes:
        return L.RECORD.pack(
            L.RECORD_MAGIC, self.producer_id, out.flags, self.epoch, 1, out.seq, out.length,
            slot & L.SLOT_MASK, checksum,
        )

    def _write_payload(self, phys: int, data: Buffer, slot: int, out: _Outgoing) -> int:
        header = self._header(out, slot)
        h = xxhash.xxh3_64()
        h.update(header[: L.CHECKSUM_COVERS])
        src = data if isinstance(data, memoryview) else memoryview(data)
        if src.ndim != 1 or src.itemsize != 1:
            src = src.cast("B")
        n = len(src)
        base = self.b_off + phys + L.RECORD_HEADER
        if self._view is not None:
            view = self._view
            # copy and hash chunk by chunk while the chunk is in cache: one pass over memory
            hook = self.fault_hook
            for a in range(0, n, _COPY_CHUNK):
                b = min(a + _COPY_CHUNK, n)
                if hook is not None and a <= n // 2 < b:
                    half = n // 2
                    view[base + a : base + half] = src[a:half]
                    hook("mid_payload")
                view[base + a : base + b] = src[a:b]
                h.update(src[a:b])
        else:
            h.update(src)
            self.region.write(base, src)
        return h.intdigest()

    def _finish_view(self, phys: int, view: memoryview, slot: int, out: _Outgoing) -> int:
        header = self._header(out, slot)
        h = xxhash.xxh3_64()
        h.update(header[: L.CHECKSUM_COVERS])
        h.update(view)
        if self._view is None:
            self.region.write(self.b_off + phys + L.RECORD_HEADER, view)
        return h.intdigest()

    def _commit(self, slot: int, units: int, phys: int, out: _Outgoing, checksum: int) -> bool:
        """Steps 5 (header) to 7. False when fenced (the message is then resent by the caller)."""
        r = self.region
        r.write(self.b_off + phys, self._header(out, slot, checksum))
        if self.fault_hook is not None:
            self.fault_hook("before_commit")
        s_off = self._slot_off(slot)
        claimed = L.pack_w0(slot, L.RESERVED, self.producer_id, units)
        if r.cas(s_off + L.S_W0, claimed, L.pack_w0(slot, L.COMMITTED, self.producer_id, units)) != claimed:
            # fenced while writing: tell the consumer we are done with the span, then resend
            stolen = L.pack_w0(slot, L.ABANDONED, self.producer_id, units)
            r.cas(s_off + L.S_W0, stolen, L.pack_w0(slot, L.ABANDON_ACKED, self.producer_id, units))
            out.slot = None
            return False
        self.stats.sent += 1
        if r.load(L.C_CONSUMER_WAITING):
            r.notify(L.C_DOORBELL)
        return True

    def _commit_reservation(self, res: Reservation, refill: Refill | None) -> int:
        out, slot, units, phys = res._state
        if refill is not None:
            out.refill = refill
        else:
            out.data = bytes(res.view)  # keep a copy so the message can be resent
        checksum = self._finish_view(phys, res.view, slot, out)
        if not self._commit(slot, units, phys, out, checksum):
            self.stats.fenced += 1
            self._transmit(out, None)
        return out.seq

    def _abort_reservation(self, res: Reservation) -> None:
        # An aborted span is committed as a skip record: the consumer consumes its
        # sequence number without delivering it, so the stream has no gap.
        out, slot, units, phys = res._state
        out.data, out.length, out.flags = b"", 0, L.FLAG_SKIP
        checksum = self._finish_view(phys, memoryview(b""), slot, out)
        if not self._commit(slot, units, phys, out, checksum):
            self._transmit(out, None)

    def _check_consumer(self) -> None:
        r = self.region
        if r.load(L.C_CLOSED):
            raise ConsumerGone(f"ring {r.name!r}: the consumer closed the ring")
        pid, start = r.load(L.C_CONSUMER_PID), r.load(L.C_CONSUMER_START)
        if self._view is not None and pid and not r.peer_alive(pid, start):
            raise ConsumerGone(f"ring {r.name!r}: consumer process {pid} is gone")
        hb = r.load(L.C_HEARTBEAT)
        now = time.monotonic()
        if hb != self._last_hb[0]:
            self._last_hb = (hb, now)
        elif now - self._last_hb[1] > self.consumer_timeout:
            raise ConsumerGone(
                f"ring {r.name!r}: consumer (pid {pid}) has not heartbeated for {now - self._last_hb[1]:.1f}s"
            )


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
        from engine.transport.region import attach_region

        region = attach_region(address)
        region.owner = True  # type: ignore[attr-defined] - we now destroy it on close
        return cls(region, config, recover=True)

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


def create_ring(address: str, config: RingConfig | None = None) -> RingConsumer:
    """Create a ring at ``address`` (``shm://NAME`` or ``tcp://HOST:PORT/NAME``) and return its consumer."""
    return RingConsumer.create(address, config)


def attach_producer(address: str, producer_id: int | None = None, **kwargs: float) -> RingProducer:
    """Attach to the ring at ``address`` as a producer."""
    from engine.transport.region import attach_region

    return RingProducer(attach_region(address), producer_id, **kwargs)
