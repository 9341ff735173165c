"""The producer side of the ring (docs/ring-protocol.md, steps 1-7, retention and go-back-N)."""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from engine.transport import layout as L
from engine.transport.errors import (
    ConsumerGone,
    MessageTooLarge,
    RingFull,
    TransportError,
)
from engine.transport.region import MemoryRegion
from engine.transport.ring.base import (
    _COPY_CHUNK,
    POLL_EVERY,
    Buffer,
    Refill,
    _ring_send,
    _ring_send_many,
    _RingBase,
)

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
        # records of a ring created with verify_payload=False carry a checksum over their header only
        self._hdr_flag = L.FLAG_HEADER_ONLY if self.header_only else 0
        self.producer_id, self.epoch = self._register(producer_id)
        if self._fast:
            self._geom = (region.base, self.b_off, self.s_off, self.p_off, self.slots, self.buffer_bytes,  # type: ignore[attr-defined]
                          self.producer_id, self.epoch)
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
            if producer_id is None and not self._reusable(pidx, old):
                continue
            epoch = (old >> 8) + 1
            r.store(off + L.P_PID, pid)
            r.store(off + L.P_START, start)
            if r.cas(off + L.P_OWNER, old, (epoch << 8) | L.OWNER_ALIVE) == old:
                return pidx, epoch & 0xFFFFFF
        raise RingFull(
            f"ring {r.name!r}: all {self.max_producers} producer entries are taken (by live producers, or by "
            f"dead or closed ones whose messages are still in the ring)"
        )

    def _reusable(self, pidx: int, owner: int) -> bool:
        """Whether an automatic registration may take producer entry ``pidx``.

        A never-used entry, yes. One whose producer is alive (or remote, so unknown), no. One
        whose producer closed or died only once none of its records is left where the consumer
        still needs the entry: a new epoch would fence (drop) its not-yet-examined records, and a
        quarantined span of its would wait on the new owner's pid instead of the dead one's.
        """
        r = self.region
        state, off = owner & 0xFF, self._prod_off(pidx)
        if owner == 0:
            return True
        if state == L.OWNER_ALIVE:
            pid, start = r.load(off + L.P_PID), r.load(off + L.P_START)
            if not pid or pid & L.REMOTE or r.peer_alive(pid, start):
                return False
        hs, _ = L.unpack_pos(r.load(L.C_HEAD))
        ts, _ = L.unpack_pos(r.load(L.C_TAIL))
        cursor = r.load(L.C_CURSOR)
        for i in range((ts - hs) & L.SLOT_MASK):
            c = (hs + i) & L.SLOT_MASK
            slot, st, producer, _units = L.unpack_w0(r.load(self._slot_off(c) + L.S_W0))
            if slot != c or producer != pidx:
                continue
            examined = L.slot_diff(cursor, c) > 0
            if st == L.ABANDONED or (not examined and st in (L.RESERVED, L.COMMITTED)):
                return False
        return True

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
        if self.region.load(L.C_CLOSED):
            raise ConsumerGone(f"ring {self.region.name!r}: the consumer closed the ring")
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

    def send_many(self, messages: Sequence[Buffer], *, timeout: float | None = None) -> list[int]:
        """Send each message in order, as :meth:`send` would; returns their (consecutive) sequence numbers.

        On a local region one native call commits as many as fit. ``timeout`` bounds each wait for
        space, as in :meth:`send`. If this raises (:class:`RingFull`, :class:`ConsumerGone`), the
        exception's ``accepted`` attribute says how many messages, from the first, were accepted
        (they will be delivered); the others were not.
        """
        msgs = messages if isinstance(messages, list | tuple) else list(messages)
        sizes = [m.nbytes if isinstance(m, memoryview) else len(m) for m in msgs]
        if sizes:
            self._check_size(max(sizes))
        first = self._next_seq
        try:
            if self.region.load(L.C_CLOSED):
                raise ConsumerGone(f"ring {self.region.name!r}: the consumer closed the ring")
            if not (self._fast and self.fault_hook is None):
                for m in msgs:
                    self.send(m, timeout=timeout)
            else:
                self.poll()
                self._resend_pending(timeout)
                self._send_many_fast(msgs, sizes, timeout)
        except TransportError as exc:
            exc.accepted = self._next_seq - first  # type: ignore[attr-defined]
            raise
        return list(range(first, first + len(msgs)))

    def _send_many_fast(self, msgs: Sequence[Buffer], sizes: list[int], timeout: float | None) -> None:
        r, deadline, unacked, stats = self.region, None, self._unacked, self.stats
        i, n = 0, len(msgs)
        while i < n:
            status, k, slots, retries = _ring_send_many(*self._geom, self._next_seq, self._hdr_flag, msgs, i)
            stats.cas_attempts += k + (status != 0)
            stats.cas_retries += retries
            if k:
                seq = self._next_seq  # kept until acknowledged, as send() keeps each message
                unacked.extend(map(_Outgoing, range(seq, seq + k), sizes[i : i + k], msgs[i : i + k],
                                   itertools.repeat(None, k), slots))
                self._next_seq += k
                stats.sent += k
                i += k
                self._sends_since_poll += k
            if status == 1:
                stats.cas_retries += 1
                self.poll()  # acknowledgements free our kept copies; losses are resent first
                deadline = self._wait_for_space(r.load(L.C_HEAD), deadline, timeout, L.units_for(sizes[i]))
            elif status == 2:
                stats.fenced += 1
        if self._sends_since_poll >= POLL_EVERY:
            self.poll()

    def reserve(self, size: int, *, timeout: float | None = None) -> Reservation:
        """Reserve ``size`` payload bytes and return a writable view into the ring (zero-copy)."""
        self._check_size(size)
        if self.region.load(L.C_CLOSED):
            raise ConsumerGone(f"ring {self.region.name!r}: the consumer closed the ring")
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
        args = (*self._geom, out.seq, out.flags | self._hdr_flag)
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
            L.RECORD_MAGIC, self.producer_id, out.flags | self._hdr_flag, self.epoch, 1, out.seq, out.length,
            slot & L.SLOT_MASK, checksum,
        )

    def _write_payload(self, phys: int, data: Buffer, slot: int, out: _Outgoing) -> int:
        header = self._header(out, slot)
        h = xxhash.xxh3_64()
        h.update(header[: L.CHECKSUM_COVERS])
        if self._hdr_flag:
            h = _NoPayloadHash(h)
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
        if not self._hdr_flag:
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


class _NoPayloadHash:
    """The checksum of a header-only record (FLAG_HEADER_ONLY): payload updates are ignored."""

    __slots__ = ("_h",)

    def __init__(self, h: xxhash.xxh3_64) -> None:
        self._h = h

    def update(self, _data: object) -> None:
        pass

    def intdigest(self) -> int:
        return self._h.intdigest()
