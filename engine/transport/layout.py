"""Byte layout of a ring inside a memory region, and the packing of its words.

Kept apart from the protocol so the model checker's constants, the record
parser and the fuzz tests all read the same numbers.
"""

from __future__ import annotations

import struct

from engine.transport.errors import RecordError

MAGIC = 0x4F50_5249_4E47_3031  # "OPRING01"
VERSION = 1
UNIT = 64  # buffer allocation unit and record alignment (a cache line)
CTRL_BYTES = 4096

# control block: one cache line per word that different parties write
C_MAGIC, C_VERSION, C_SLOTS, C_BUF_BYTES, C_MAX_PRODUCERS, C_TOTAL, C_BUF_OFFSET = 0, 8, 16, 24, 32, 40, 48
C_TAIL = 128
C_HEAD = 192
C_CURSOR = 256
C_DOORBELL = 320  # 32-bit futex word: producers ring it after a commit
C_CONSUMER_WAITING = 384
C_SPACE_BELL = 448  # 32-bit futex word: the consumer rings it after freeing space
C_SPACE_WAITERS = 512
C_CONSUMER_PID = 576
C_CONSUMER_START = 584
C_HEARTBEAT = 640
C_CLOSED = 704
C_OPTIONS = 768  # ring options, set by the consumer when it formats the ring (OPT_*)
OPT_HEADER_ONLY = 1  # records may carry a checksum over the header only (RingConfig.verify_payload=False)

PRODUCER_ENTRY = 64
P_OWNER, P_PID, P_START, P_ACKED, P_DELIVERED = 0, 8, 16, 24, 32
OWNER_FREE, OWNER_ALIVE, OWNER_CLOSED = 0, 1, 2

SLOT_ENTRY = 64
S_W0, S_W1 = 0, 8
S_W2 = 16  # consumer-private: (slot:24 | 1) once the message in the slot was released

# slot states (4 bits of W0)
FREE, RESERVED, COMMITTED, ABANDONED, ABANDON_ACKED = 0, 1, 2, 3, 4
STATE_NAMES = {FREE: "FREE", RESERVED: "RESERVED", COMMITTED: "COMMITTED", ABANDONED: "ABANDONED",
               ABANDON_ACKED: "ABANDON_ACKED"}

SLOT_BITS = 24
SLOT_MASK = (1 << SLOT_BITS) - 1
BYTE_BITS = 40
BYTE_MASK = (1 << BYTE_BITS) - 1
MAX_PRODUCERS = (1 << 12) - 1
NOBODY = 0xFFF  # producer field of a slot stolen before anyone claimed it
FLAG_SKIP = 1  # record flag: consume the sequence number, deliver nothing (aborted reservation)
FLAG_HEADER_ONLY = 2  # record flag: the checksum covers the header only (accepted only by OPT_HEADER_ONLY rings)
KNOWN_FLAGS = FLAG_SKIP | FLAG_HEADER_ONLY
REMOTE = 1 << 63  # pid field flag: a remote producer identified by its connection
MAX_UNITS = (1 << 24) - 1
SEQ_BITS = 40
SEQ_MASK = (1 << SEQ_BITS) - 1

# record header: magic, producer, flags, epoch, header_version, seq, payload length, slot, checksum
RECORD = struct.Struct("<IHHIIQQQQ")
RECORD_MAGIC = 0x3152_504F  # "OPR1"
RECORD_HEADER = UNIT  # header occupies one unit; payload starts 64-byte aligned
CHECKSUM_COVERS = RECORD.size - 8  # checksum covers the header up to (not including) itself

# One slot of a run taken natively by the consumer (engine/transport/_atomics.c, run_entry_t):
# kind, why (take status of a dropped slot), producer, epoch, seq, units, view index, reserved.
RUN_ENTRY = struct.Struct("<BBHIQIIQ")
RUN_DELIVERED, RUN_SKIP_RECORD, RUN_DROPPED = 0, 1, 2


def pack_pos(slot: int, nbytes: int) -> int:
    return ((slot & SLOT_MASK) << BYTE_BITS) | (nbytes & BYTE_MASK)


def unpack_pos(word: int) -> tuple[int, int]:
    return word >> BYTE_BITS, word & BYTE_MASK


def pack_w0(slot: int, state: int, producer: int = 0, units: int = 0) -> int:
    return ((slot & SLOT_MASK) << 40) | (state << 36) | ((producer & 0xFFF) << 24) | (units & MAX_UNITS)


def unpack_w0(word: int) -> tuple[int, int, int, int]:
    return word >> 40, (word >> 36) & 0xF, (word >> 24) & 0xFFF, word & MAX_UNITS


def pack_w1(slot: int, start: int) -> int:
    return ((slot & SLOT_MASK) << BYTE_BITS) | (start & BYTE_MASK)


def pack_epoch_seq(epoch: int, seq: int) -> int:
    return ((epoch & 0xFFFFFF) << SEQ_BITS) | (seq & SEQ_MASK)


def unpack_epoch_seq(word: int) -> tuple[int, int]:
    return word >> SEQ_BITS, word & SEQ_MASK


def slot_diff(a: int, b: int) -> int:
    """a - b on the 24-bit slot circle, as a signed number."""
    d = (a - b) & SLOT_MASK
    return d - (1 << SLOT_BITS) if d >= 1 << (SLOT_BITS - 1) else d


def units_for(payload: int) -> int:
    return (RECORD_HEADER + payload + UNIT - 1) // UNIT


def max_payload(buffer_bytes: int) -> int:
    """Largest payload: half the buffer (so a record always fits an empty ring, wrap included)."""
    return min(buffer_bytes // 2, MAX_UNITS * UNIT) - RECORD_HEADER


def ring_layout(slots: int, buffer_bytes: int, max_producers: int) -> tuple[int, int, int]:
    """(producer table offset, slot table offset, buffer offset); total size = buffer offset + buffer bytes."""
    p_off = CTRL_BYTES
    s_off = p_off + max_producers * PRODUCER_ENTRY
    b_off = (s_off + slots * SLOT_ENTRY + 4095) // 4096 * 4096
    return p_off, s_off, b_off


def region_bytes(slots: int, buffer_bytes: int, max_producers: int) -> int:
    return ring_layout(slots, buffer_bytes, max_producers)[2] + buffer_bytes


class RecordHeader:
    """A parsed, bounds-checked record header (the checksum is verified separately)."""

    __slots__ = ("checksum", "epoch", "flags", "length", "producer", "seq", "slot")

    def __init__(self, producer: int, flags: int, epoch: int, seq: int, length: int, slot: int, checksum: int):
        self.producer, self.flags, self.epoch, self.seq = producer, flags, epoch, seq
        self.length, self.slot, self.checksum = length, slot, checksum


def parse_record(buf: memoryview | bytes, offset: int, span: int) -> RecordHeader:
    """Parse the record header at ``offset`` whose allocated span is ``span`` bytes.

    Raises :class:`~engine.transport.errors.RecordError` on anything malformed;
    never reads outside ``buf[offset : offset + span]``.
    """
    if offset < 0 or span < RECORD_HEADER or offset + span > len(buf):
        raise RecordError(f"record span [{offset}, {offset + span}) does not fit a {len(buf)}-byte buffer")
    magic, producer, flags, epoch, hv, seq, length, slot, checksum = RECORD.unpack_from(buf, offset)
    if magic != RECORD_MAGIC:
        raise RecordError(f"bad record magic {magic:#x}")
    if hv != 1:
        raise RecordError(f"unsupported record header version {hv}")
    if length > span - RECORD_HEADER:
        raise RecordError(f"record claims {length} payload bytes in a {span}-byte span")
    if flags & ~KNOWN_FLAGS:
        raise RecordError(f"unknown record flags {flags:#x}")
    return RecordHeader(producer, flags, epoch, seq, length, slot, checksum)
