"""Batched delivery (recv_many, send_many) and header-only rings.

Each test fails without the feature it names: a batch comes in ring order and its release frees
exactly its slots; a stolen slot inside a batch stays quarantined while the rest is delivered
once; a run never takes a slot twice; send_many commits in order and reports what it got
accepted; a corrupt payload is caught unless the ring was created to check headers only.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from engine.transport import layout as L
from engine.transport.errors import RingFull
from engine.transport.ring import Batch, RingConfig, RingConsumer, attach_producer
from engine.transport.ring.base import _ring_take_many

SMALL = RingConfig(slots=16, buffer_bytes=1 << 14, max_producers=4, lock_timeout=0.05)


@pytest.fixture(params=["native", "python"])
def consumer(request, ring_name):
    """A consumer over shared memory, taking runs natively or with the Python steps (the reference)."""
    c = RingConsumer.create(f"shm://{ring_name}", SMALL)
    if request.param == "python":
        c._fast = False
    elif _ring_take_many is None:
        pytest.skip("the native fast paths are not built for this CPU")
    yield c
    c.close()


def _attach(c: RingConsumer, pid: int, **kw):
    return attach_producer(f"shm://{c.region.name}", pid, **kw)


def _slot_state(c: RingConsumer, slot: int) -> tuple[int, int]:
    lap, state, _p, _u = L.unpack_w0(c.region.load(c._slot_off(slot) + L.S_W0))
    return lap, state


def _acked(c: RingConsumer, producer: int) -> int:
    return L.unpack_epoch_seq(c.region.load(c._prod_off(producer) + L.P_ACKED))[1]


def test_recv_many_returns_a_batch_in_order_and_its_release_frees_exactly_those_slots(consumer) -> None:
    c = consumer
    a, b = _attach(c, 0), _attach(c, 1)
    sent = []
    for i in range(5):  # slots 0..9, alternating producers
        for p in (a, b):
            m = f"{p.producer_id}:{i}".encode() * (i + 1)
            p.send(m)
            sent.append((p.producer_id, m))
    batch = c.recv_many(4, timeout=1)
    assert isinstance(batch, Batch) and len(batch) == 4
    assert [(d.producer, d.seq, bytes(d.view)) for d in batch] == [
        (pid, i // 2, m) for i, (pid, m) in enumerate(sent[:4])
    ]
    assert [bytes(v) for v in batch.views] == [m for _, m in sent[:4]]
    assert all(v.readonly for v in batch.views)
    assert c.held == 4
    # releasing one message of the batch alone frees nothing: slot 0 before it is still held
    list(batch)[2].release()
    c._advance_head()
    assert L.unpack_pos(c.region.load(L.C_HEAD))[0] == 0
    batch.release()  # the rest, in one call
    c._advance_head()
    assert L.unpack_pos(c.region.load(L.C_HEAD))[0] == 4, "HEAD must pass exactly the batch's slots"
    assert c.held == 0
    assert [_slot_state(c, s) for s in range(4)] == [(s + SMALL.slots, L.FREE) for s in range(4)]
    assert [_slot_state(c, s)[1] for s in range(4, 10)] == [L.COMMITTED] * 6
    assert (_acked(c, 0), _acked(c, 1)) == (2, 2)
    for v in batch.views:
        with pytest.raises(ValueError):
            bytes(v)  # released: the views are no longer usable
    batch.release()  # idempotent
    rest = c.recv_many(64, timeout=1)
    assert [bytes(v) for v in rest.views] == [m for _, m in sent[4:]]
    rest.release()
    assert not c.recv_many(8, timeout=0.01)  # empty and false once nothing is left
    for p in (a, b):
        p.flush(2)
        p.close()
        p.region.close()
    assert c.stats.delivered == c.stats.released == 10


def test_a_stolen_slot_inside_a_batch_is_quarantined_and_the_others_delivered_once(consumer) -> None:
    """Messages before and after a stalled producer's slot come in one batch, and its slot is
    stolen in that same call. Releasing the whole batch must not free the stolen span: HEAD stops
    there until the stalled producer acknowledges the fence (its late write lands in space nobody
    else owns); its message is then resent and delivered once."""
    c = consumer
    c.lock_timeout = 0.0  # steal at the second look (the test decides when producers stall)
    slow, fast = _attach(c, 0), _attach(c, 1, send_timeout=0.2)
    stalled, resume = threading.Event(), threading.Event()

    def stall(where: str) -> None:
        if where == "mid_payload" and not stalled.is_set():
            stalled.set()
            resume.wait(10)

    fast.send(b"F0" * 500)  # slot 0
    slow.fault_hook = stall
    t = threading.Thread(target=slow.send, args=(b"S" * 3000,), name="onepiece-test-slow")
    t.start()  # slot 1: claimed, half written, stalled
    assert stalled.wait(5)
    fast.send(b"F1" * 500)  # slot 2
    fast.send(b"F2" * 500)  # slot 3
    batch = c.recv_many(8, timeout=1)
    assert [(d.producer, d.seq, bytes(d.view)) for d in batch] == [
        (1, 0, b"F0" * 500), (1, 1, b"F1" * 500), (1, 2, b"F2" * 500)]
    assert c.stats.steals == 1 and c.stats.quarantined == 1
    assert _slot_state(c, 1) == (1, L.ABANDONED)
    batch.release()
    c._advance_head()
    assert L.unpack_pos(c.region.load(L.C_HEAD))[0] == 1, "the batch's release freed the quarantined slot"
    assert _acked(c, 1) == 1  # F0 only: F1 and F2 are acknowledged once HEAD passes them
    resume.set()
    t.join(5)  # the late write lands in the quarantined span; the commit is fenced; it resends
    assert slow.stats.fenced == 1 and _slot_state(c, 1) == (1, L.ABANDON_ACKED)
    got = []
    deadline = time.monotonic() + 5
    while not got:
        b = c.recv_many(8, timeout=0.05)
        got += [(d.producer, d.seq, bytes(d.view)) for d in b]
        b.release()
        assert time.monotonic() < deadline
    assert got == [(0, 0, b"S" * 3000)]
    for p in (slow, fast):
        p.flush(2)
        p.close()
        p.region.close()
    assert c.stats.delivered == 4 and c.stats.corrupt == 0 and c.held == 0
    assert L.unpack_pos(c.region.load(L.C_HEAD))[0] == 5


def test_a_run_stops_before_a_slot_that_look_ahead_already_delivered(consumer) -> None:
    c = consumer
    c.lock_timeout = 30.0  # a stall, never a steal
    slow, fast = _attach(c, 0), _attach(c, 1)
    stalled, resume = threading.Event(), threading.Event()

    def stall(where: str) -> None:
        if where == "mid_payload" and not stalled.is_set():
            stalled.set()
            resume.wait(10)

    fast.send(b"F0")  # slot 0
    slow.fault_hook = stall
    t = threading.Thread(target=slow.send, args=(b"S" * 3000,), name="onepiece-test-slow")
    t.start()  # slot 1 stalls
    assert stalled.wait(5)
    fast.send(b"F1")  # slot 2: delivered past the stalled slot (look-ahead)
    first = c.recv_many(8, timeout=0.2)
    assert [bytes(v) for v in first.views] == [b"F0", b"F1"]
    resume.set()
    t.join(5)  # slot 1 commits now
    fast.send(b"F2")  # slot 3
    second = c.recv_many(8, timeout=1)
    assert [bytes(v) for v in second.views] == [b"S" * 3000, b"F2"]  # slot 2 is not taken again
    assert c.stats.duplicates == 0 and c.stats.steals == 0
    first.release()
    second.release()
    for p in (slow, fast):
        p.flush(2)
        p.close()
        p.region.close()
    assert c.held == 0 and c.stats.delivered == 4


def test_a_corrupt_record_inside_a_run_is_dropped_and_the_others_delivered_exactly_once(consumer) -> None:
    c = consumer
    a, b = _attach(c, 0), _attach(c, 1)
    for i in range(3):
        a.send(b"a%d" % i * 100)
        b.send(b"b%d" % i * 100)
    # flip a payload bit of a1 (slot 2) before the consumer reads it
    span = L.units_for(300) * L.UNIT
    c.region.local_view()[c.b_off + 2 * span + L.RECORD_HEADER + 7] ^= 0x04
    first = c.recv_many(16, timeout=1)
    # a1 is corrupt, a2 after it out of order: both dropped in place, the others delivered
    assert [bytes(v)[:2] for v in first.views] == [b"a0", b"b0", b"b1", b"b2"]
    assert (c.stats.corrupt, c.stats.out_of_order) == (1, 1)
    first.release()
    a.poll()  # go-back-N: a1 and a2 are resent
    again = c.recv_many(16, timeout=1)
    assert [(d.producer, d.seq, bytes(d.view)[:2]) for d in again] == [(0, 1, b"a1"), (0, 2, b"a2")]
    again.release()
    for p in (a, b):
        p.flush(2)
        p.close()
        p.region.close()
    assert c.stats.delivered == 6 and c.held == 0


def test_send_many_commits_in_order_across_wraps_and_reports_what_was_accepted(consumer) -> None:
    c = consumer
    p = _attach(c, 0, send_timeout=5)
    rng = random.Random(7)
    msgs = [rng.randbytes(rng.randint(0, 3000)) for _ in range(120)]  # ~10 times the ring
    got: list[bytes] = []

    def drain() -> None:
        while len(got) < len(msgs):
            b = c.recv_many(16, timeout=0.05)
            got.extend(bytes(v) for v in b.views)
            b.release()

    t = threading.Thread(target=drain, name="onepiece-test-drain")
    t.start()
    seqs = p.send_many([*msgs[:40], bytearray(msgs[40]), memoryview(msgs[41]), *msgs[42:]])
    t.join(10)
    assert seqs == list(range(120))
    assert got == msgs
    p.flush(2)
    # nobody drains now: what fits is accepted, the rest refused, and the exception says how many
    with pytest.raises(RingFull) as info:
        p.send_many([b"x" * 2000] * 20, timeout=0.1)
    accepted = info.value.accepted
    assert 0 < accepted < 20
    assert p.unacked == accepted
    b = c.recv_many(64, timeout=1)
    assert [d.seq for d in b] == list(range(120, 120 + accepted))
    b.release()
    p.flush(2)
    assert p.send_many([b"after"]) == [120 + accepted]  # no gap in the sequence numbers
    assert c.recv_bytes(1) == (0, 120 + accepted, b"after")
    p.close()
    p.region.close()


def _flip_payload_of_next_record(c: RingConsumer) -> None:
    c.region.local_view()[c.b_off + c._data_phys(c._cursor_bytes, 1) + L.RECORD_HEADER + 3] ^= 0x80


@pytest.mark.parametrize("verify_payload", [True, False])
@pytest.mark.parametrize("consumer_side", ["native", "python"])
def test_payload_corruption_is_caught_unless_the_ring_checks_headers_only(
    ring_name, verify_payload, consumer_side
) -> None:
    if consumer_side == "native" and _ring_take_many is None:
        pytest.skip("the native fast paths are not built for this CPU")
    cfg = RingConfig(slots=16, buffer_bytes=1 << 14, verify_payload=verify_payload)
    assert RingConfig().verify_payload, "payloads are verified unless a ring opts out"
    c = RingConsumer.create(f"shm://{ring_name}", cfg)
    c._fast = consumer_side == "native"
    p = attach_producer(f"shm://{ring_name}", 0)
    try:
        assert p.header_only is (not verify_payload)
        p.send(b"payload" * 10)
        _flip_payload_of_next_record(c)
        got = c.recv_bytes(0.05)
        if verify_payload:
            assert got is None and c.stats.corrupt == 1  # caught, and resent by go-back-N
            p.poll()
            assert c.recv_bytes(1) == (0, 0, b"payload" * 10)
        else:
            # the documented risk: a flipped payload bit is delivered as is
            assert got is not None and got[2] != b"payload" * 10 and c.stats.corrupt == 0
        # the header stays checked either way
        p.send(b"second")
        c.region.local_view()[c.b_off + c._data_phys(c._cursor_bytes, 1) + 24] ^= 0x01  # its seq
        assert c.recv_bytes(0.05) is None and c.stats.corrupt == (2 if verify_payload else 1)
        p.poll()
        assert c.recv_bytes(1) == (0, 1, b"second")
        p.flush(2)
    finally:
        p.close()
        p.region.close()
        c.close()


def test_a_header_only_record_is_refused_by_a_ring_that_verifies_payloads(ring_name) -> None:
    c = RingConsumer.create(f"shm://{ring_name}", SMALL)
    p = attach_producer(f"shm://{ring_name}", 0)
    try:
        p._hdr_flag = L.FLAG_HEADER_ONLY  # a producer that would skip the payload checksum
        p.send(b"unchecked")
        assert c.recv_bytes(0.05) is None and c.stats.corrupt == 1
    finally:
        p.close()
        p.region.close()
        c.close()


def test_header_only_is_refused_over_tcp_and_kept_across_recovery(ring_name) -> None:
    header_only = RingConfig(slots=16, buffer_bytes=1 << 14, verify_payload=False)
    with pytest.raises(ValueError, match="verify_payload=True"):
        RingConsumer.create(f"tcp://127.0.0.1:0/{ring_name}-tcp", header_only)
    c = RingConsumer.create(f"shm://{ring_name}", header_only)
    c._stop.set()  # as if it died: stop its heartbeat
    c2 = RingConsumer.recover(f"shm://{ring_name}")  # its successor reads the option from the ring
    try:
        assert c2.header_only and not c2.config.verify_payload
    finally:
        c2.close()
        c.close()
