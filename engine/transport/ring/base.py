"""Shared pieces of the ring: configuration, counters, geometry, the native fast-path handles."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.transport import layout as L
from engine.transport.errors import (
    RegionError,
    RegionMismatch,
)
from engine.transport.region import MemoryRegion

try:  # native fast paths; absent when the extension was built without xxhash.h (or before batches)
    from engine.transport._atomics import ring_run_free as _ring_run_free
    from engine.transport._atomics import ring_run_mark as _ring_run_mark
    from engine.transport._atomics import ring_send as _ring_send
    from engine.transport._atomics import ring_send_many as _ring_send_many
    from engine.transport._atomics import ring_spin as _ring_spin
    from engine.transport._atomics import ring_take as _ring_take
    from engine.transport._atomics import ring_take_many as _ring_take_many
except ImportError:  # pragma: no cover - depends on the build (all or none: the Python steps run)
    _ring_send = _ring_take = _ring_send_many = _ring_take_many = _ring_run_mark = _ring_run_free = _ring_spin = None

Buffer = bytes | bytearray | memoryview
Refill = Callable[[memoryview], None]

_COPY_CHUNK = 256 << 10  # the Python steps copy and hash in L2-sized chunks: one pass over memory
LOOKAHEAD = 64  # how far past a stalled slot the consumer looks for committed records
POLL_EVERY = 32  # a producer checks acknowledgements every this many sends (or 1 ms)
FREE_BATCH = 16  # the consumer frees space (and acknowledges) every this many finished slots
SPIN_YIELD_NS = 2_000  # a spinning consumer yields its core this often (a producer may share it)


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
    # False: records carry a checksum over their header only and the consumer does not read the payload
    # before delivering it (one pass over the bytes fewer for bulk messages). The payload is then only as
    # intact as the transport keeps it: no check catches a bit flipped in the ring's memory or on the way.
    # Torn and late writes are still excluded (by the commit CAS and quarantine, not by the checksum).
    # Only for regions whose transport guarantees integrity end to end (see docs/ring-protocol.md).
    verify_payload: bool = True

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
        return L.max_payload(self.buffer_bytes)


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
        self.max_message = L.max_payload(self.buffer_bytes)
        self.header_only = bool(r.load(L.C_OPTIONS) & L.OPT_HEADER_ONLY)

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


def local_backlog(address: str) -> dict[str, float] | None:
    """How full the ring at ``address`` is, read from its memory on this host (any transport keeps it in
    a segment named by the address): ``bytes`` (fraction of the buffer in use) and ``messages`` (committed
    and not yet released). For the TaskManager's reports; None when the ring is not there (yet).

    Reads four header words with ``pread`` rather than mapping the segment: mapping populates every page
    of a ring (tens of MiB), too much for a report every two seconds per instance."""
    import os
    import struct

    from engine.transport.shm import shm_path

    scheme, _, rest = address.partition("://")
    name = rest.split("/", 1)[1] if scheme != "shm" and "/" in rest else rest
    try:
        fd = os.open(shm_path(name), os.O_RDONLY)
    except (OSError, RegionError):
        return None
    try:
        def word(off: int) -> int:
            raw = os.pread(fd, 8, off)
            return struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1

        if word(L.C_MAGIC) != L.MAGIC:
            return None
        buffer_bytes = word(L.C_BUF_BYTES)
        head_slot, hb = L.unpack_pos(word(L.C_HEAD))
        tail_slot, tb = L.unpack_pos(word(L.C_TAIL))
        if buffer_bytes <= 0:
            return None
        return {"bytes": round(((tb - hb) & L.BYTE_MASK) / buffer_bytes, 4),
                "messages": float(L.slot_diff(tail_slot, head_slot))}
    finally:
        os.close(fd)
