"""The ring in one process: delivery, wrap, zero-copy, limits, bit flips, steals, and typed errors."""

from __future__ import annotations

import os
import random
import time

import pytest

from engine.transport import layout as L
from engine.transport.errors import ConsumerGone, MessageTooLarge, RingFull
from engine.transport.ring import RingConfig, RingConsumer, attach_producer

SMALL = RingConfig(slots=16, buffer_bytes=1 << 14, max_producers=4, lock_timeout=0.05)


@pytest.fixture(params=["shm", "shm-python", "shm-mixed", "tcp"])
def ring(request, ring_name):
    """A small ring and a producer factory.

    ``shm`` uses the native fast paths on both ends, ``shm-python`` the Python steps on
    both, ``shm-mixed`` native producers with a Python consumer (records written by one
    implementation are checked by the other), ``tcp`` remote Python producers.
    """
    addr = f"tcp://127.0.0.1:0/{ring_name}" if request.param == "tcp" else f"shm://{ring_name}"
    c = RingConsumer.create(addr, SMALL)
    if request.param in ("shm-python", "shm-mixed"):
        c._fast = False
    address = getattr(c.region, "address", addr)
    producers = []

    def producer(pid: int | None = None, **kw):
        p = attach_producer(address, pid, **kw)
        if request.param == "shm-python":
            p._fast = False
        producers.append(p)
        return p

    yield c, producer
    for p in producers:
        p.close()
        p.region.close()
    c.close()


def drain(c: RingConsumer, n: int, timeout: float = 5.0) -> list[tuple[int, int, bytes]]:
    got = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        item = c.recv_bytes(0.05)
        if item is not None:
            got.append(item)
    return got


def test_messages_arrive_in_order_across_many_wraps(ring) -> None:
    c, producer = ring
    p = producer()
    rng = random.Random(1)
    sent = [rng.randbytes(rng.randint(0, SMALL.max_message)) for _ in range(300)]
    for i, m in enumerate(sent):
        p.send(m)
        _pid, seq, data = c.recv_bytes(2)
        assert (seq, data) == (i, m)
    p.flush(2)
    assert p.unacked == 0
    assert c.stats.delivered == 300 and c.stats.corrupt == 0


def test_largest_message_fits_and_one_byte_more_is_refused(ring) -> None:
    c, producer = ring
    p = producer()
    assert p.max_message == SMALL.buffer_bytes // 2 - L.RECORD_HEADER
    big = os.urandom(p.max_message)
    for _ in range(5):  # at every wrap offset the largest record still fits
        p.send(big)
        assert c.recv_bytes(2)[2] == big
    with pytest.raises(MessageTooLarge, match=f"{p.max_message + 1} bytes"):
        p.send(b"x" * (p.max_message + 1))


@pytest.mark.filterwarnings("ignore:The given buffer is not writable")
def test_zero_copy_reserve_commit_and_release(ring) -> None:
    import torch

    c, producer = ring
    p = producer()
    t = torch.arange(100, dtype=torch.float32)
    res = p.reserve(t.numel() * 4)
    res.view[:] = t.numpy().tobytes()
    seq = res.commit(refill=lambda v: v.__setitem__(slice(None), t.numpy().tobytes()))
    d = c.recv(2)
    assert d is not None and d.seq == seq
    back = torch.frombuffer(d.view, dtype=torch.float32)  # wraps the ring's bytes, no copy
    assert torch.equal(back, t)
    assert d.view.readonly
    del back
    d.release()
    p.flush(2)


def test_aborted_reservation_is_skipped_without_a_gap(ring) -> None:
    c, producer = ring
    p = producer()
    p.reserve(10).abort()
    p.send(b"after")
    pid, seq, data = c.recv_bytes(2)
    assert (seq, data) == (1, b"after")
    p.flush(2)


def test_many_producers_interleave_without_loss(ring) -> None:
    c, producer = ring
    ps = [producer(i, send_timeout=5) for i in range(4)]
    got = []
    for round_ in range(20):
        for i, p in enumerate(ps):
            p.send(f"{i}:{round_}".encode())
        got += drain(c, 4)
    for i in range(4):
        mine = [d for pid, _, d in got if pid == i]
        assert mine == [f"{i}:{r}".encode() for r in range(20)]


@pytest.mark.parametrize("where", ["header", "payload"])
def test_bit_flip_is_never_delivered_and_the_message_is_resent(ring, where) -> None:
    c, producer = ring
    p = producer()
    p.send(b"A" * 200)
    # flip one bit of the committed record before the consumer reads it
    view = c.region.local_view()
    off = c.b_off + (0 if where == "header" else L.RECORD_HEADER + 50)
    if where == "header":
        off += 24  # inside the sequence number
    view[off] ^= 0x10
    assert c.recv(0.05) is None  # the corrupt record is skipped
    assert c.stats.corrupt == 1
    p.poll()  # the producer sees it was passed over and resends
    assert p.stats.retransmits == 1
    pid, seq, data = c.recv_bytes(2)
    assert (seq, data) == (0, b"A" * 200)
    p.flush(2)
    assert c.stats.delivered == 1


def test_stalled_claim_is_stolen_fenced_and_resent(ring) -> None:
    c, producer = ring
    slow, fast = producer(0), producer(1)
    state = {"armed": True}

    def stall(where: str) -> None:
        if where == "before_commit" and state["armed"]:
            state["armed"] = False
            # while we 'sleep' here, other producers' records are delivered past our slot...
            fast.send(b"fast")
            state["got"] = c.recv_bytes(2)
            assert c.stats.steals == 0
            # ...and once we pass the lock timeout, the consumer steals our slot
            deadline = time.monotonic() + 2
            while c.stats.steals == 0 and time.monotonic() < deadline:
                assert c.recv_bytes(0.02) is None

    slow.fault_hook = stall
    slow.send(b"slow")  # commit is fenced inside; the producer resends by itself
    assert state["got"][2] == b"fast"
    assert c.stats.steals == 1 and c.stats.quarantined == 1
    assert slow.stats.fenced == 1
    assert c.recv_bytes(2)[2] == b"slow"
    slow.flush(2)
    fast.flush(2)
    assert c.stats.delivered == 2


def test_full_ring_times_out_with_sizes_in_the_message(ring) -> None:
    c, producer = ring
    p = producer(send_timeout=0.2)
    with pytest.raises(RingFull, match="full"):
        for _ in range(100):
            p.send(b"x" * 2000)
    assert c.occupancy() > 0.5


def test_closed_consumer_is_reported(ring) -> None:
    c, producer = ring
    p = producer(send_timeout=5)
    while True:
        try:
            p.send(b"y" * 3000, timeout=0.05)
        except RingFull:
            break
    c.region.store(L.C_CLOSED, 1)
    with pytest.raises(ConsumerGone, match="closed"):
        p.send(b"y" * 3000)
    c.region.store(L.C_CLOSED, 0)


def test_dead_consumer_is_reported_by_name(ring_name) -> None:
    c = RingConsumer.create(f"shm://{ring_name}", SMALL)
    try:
        p = attach_producer(f"shm://{ring_name}", send_timeout=5)
        c.region.store(L.C_CONSUMER_PID, 2**22 + 12345)  # a pid that does not exist
        with pytest.raises(ConsumerGone, match=r"consumer process \d+ is gone"):
            while True:
                p.send(b"z" * 3000)
        p.region.close()
    finally:
        c.close()


def test_re_registered_producer_fences_the_old_incarnation(ring) -> None:
    c, producer = ring
    old = producer(2)
    old.send(b"old-0")
    assert c.recv_bytes(2)[2] == b"old-0"
    new = producer(2)
    assert new.epoch == old.epoch + 1
    old.send(b"old-1")  # a zombie of the previous incarnation
    new.send(b"new-0")
    got = drain(c, 1)
    assert [d for _, _, d in got] == [b"new-0"]
    assert c.stats.stale_epoch == 1


def test_late_write_of_a_fenced_producer_never_touches_a_delivered_record(ring_name) -> None:
    """The paper's hole: a stalled producer wakes up and finishes writing into reused space.

    Here the stolen span is quarantined, so the ring cannot hand it to anyone else
    while the stalled producer may still write: the fast producer gets back-pressure
    instead, and every delivered view stays exactly as verified.
    """
    import threading

    cfg = RingConfig(slots=64, buffer_bytes=1 << 14, max_producers=4, lock_timeout=0.02)
    c = RingConsumer.create(f"shm://{ring_name}", cfg)
    slow = attach_producer(f"shm://{ring_name}", 0)
    fast = attach_producer(f"shm://{ring_name}", 1, send_timeout=0.2)
    stalled, resume, landed = threading.Event(), threading.Event(), threading.Event()

    def stall(where: str) -> None:
        if where == "mid_payload" and not stalled.is_set():
            stalled.set()
            resume.wait(10)  # then finish writing the second half of the payload
        elif where == "before_commit" and stalled.is_set():
            landed.set()  # the payload's second half and the header are written: the late write has landed

    slow.fault_hook = stall
    t = threading.Thread(target=slow.send, args=(b"S" * 3000,), name="onepiece-test-slow")
    t.start()
    assert stalled.wait(5)
    time.sleep(0.05)  # past the lock timeout
    assert c.recv(0.05) is None  # the consumer steals the slow producer's slot
    assert c.stats.steals == 1
    held: list = []
    blocked = False
    for i in range(200):  # the fast producer keeps the ring busy; we hold the last views
        try:
            fast.send(bytes([i]) * 1500, timeout=0.2)
        except RingFull:
            blocked = True
            break
        d = c.recv(1)
        held.append((d, bytes(d.view)))
        if len(held) > 3:
            held.pop(0)[0].release()
    resume.set()
    assert landed.wait(5), "the stalled producer never finished its late write"
    for d, verified in held:
        assert bytes(d.view) == verified, "a late write changed a delivered record"
    assert blocked, "the quarantined span was handed to another producer"
    for d, _ in held:
        d.release()
    got = []
    deadline = time.monotonic() + 5
    while t.is_alive() or len(got) < 1:
        item = c.recv_bytes(0.05)
        if item is not None:
            got.append(item)
        assert time.monotonic() < deadline
    t.join()
    assert [d for p, _, d in got if p == 0] == [b"S" * 3000]
    assert slow.stats.fenced == 1 and c.stats.corrupt == 0
    slow.flush(2)
    for p in (fast, slow):
        p.close()
        p.region.close()
    c.close()


class _Died(Exception):
    pass


@pytest.mark.parametrize("later_traffic", [False, True])
def test_two_producers_dying_between_reservation_and_publication(ring_name, later_traffic) -> None:
    """Found by the model checker: two adjacent slots reserved, neither publishes its start.

    The consumer cannot know where the first span ends until it steals the second
    too; it must neither wait forever nor mis-size the spans.
    """
    cfg = RingConfig(slots=8, buffer_bytes=1 << 13, max_producers=4, lock_timeout=0.02)
    c = RingConsumer.create(f"shm://{ring_name}", cfg)
    ps = [attach_producer(f"shm://{ring_name}", i, send_timeout=2) for i in range(3)]

    def die(where: str) -> None:
        if where == "reserved":
            raise _Died

    try:
        for p in ps[:2]:
            p.fault_hook = die
            with pytest.raises(_Died):
                p.send(b"lost" * 100)
        if later_traffic:
            ps[2].send(b"after")
            assert c.recv_bytes(1)[2] == b"after"  # delivered past the stalled slots
        deadline = time.monotonic() + 2
        while c.stats.steals < 2:
            assert c.recv(0.01) is None
            assert time.monotonic() < deadline, "the consumer is stuck behind unpublished slots"
        for i in range(30):  # the ring keeps working across many wraps afterwards
            ps[2].send(bytes([i]) * 700)
            assert c.recv_bytes(1)[2] == bytes([i]) * 700
        ps[2].flush(2)
        assert c.held == 0
    finally:
        for p in ps:
            p.close()
            p.region.close()
        c.close()


def test_sending_into_a_closed_ring_is_refused(ring_name) -> None:
    c = RingConsumer.create(f"shm://{ring_name}", SMALL)
    p = attach_producer(f"shm://{ring_name}")
    try:
        c.region.store(L.C_CLOSED, 1)
        with pytest.raises(ConsumerGone, match="closed"):
            p.send(b"lost?")
        with pytest.raises(ConsumerGone, match="closed"):
            p.reserve(10)
        assert p.unacked == 0
    finally:
        c.region.store(L.C_CLOSED, 0)
        p.close()
        p.region.close()
        c.close()


def test_auto_registration_reuses_a_dead_producers_entry_only_once_its_messages_are_consumed(ring_name) -> None:
    import subprocess
    import sys

    cfg = RingConfig(slots=8, buffer_bytes=1 << 13, max_producers=1)
    c = RingConsumer.create(f"shm://{ring_name}", cfg)
    try:
        root = str(__import__("pathlib").Path(__file__).resolve().parents[3])
        code = (
            f"import os, sys; sys.path.insert(0, {root!r});"
            "from engine.transport.ring import attach_producer;"
            f"p = attach_producer({'shm://' + ring_name!r}); p.send(b'from the dead'); os._exit(0)"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
        # its message is still in the ring: taking its entry would fence (drop) it
        with pytest.raises(RingFull, match="producer entries are taken"):
            attach_producer(f"shm://{ring_name}")
        pid, seq, data = c.recv_bytes(2)
        assert (pid, seq, data) == (0, 0, b"from the dead")
        p = attach_producer(f"shm://{ring_name}")  # now its entry is free to take
        assert p.producer_id == 0 and p.epoch == 2
        p.send(b"new life")
        assert c.recv_bytes(2)[1:] == (0, b"new life")
        p.close()
        p.region.close()
    finally:
        c.close()


def test_local_backlog_reads_a_rings_fill_from_its_memory(ring_name) -> None:
    """What a TaskManager reports per instance: messages in the ring and how full its buffer is."""
    from engine.transport.ring import RingConfig, RingConsumer, attach_producer
    from engine.transport.ring.base import local_backlog

    assert local_backlog(f"shm://{ring_name}") is None  # no ring (yet)
    with RingConsumer.create(f"shm://{ring_name}", RingConfig(slots=16, buffer_bytes=1 << 16)) as c:
        p = attach_producer(f"shm://{ring_name}")
        for _ in range(3):
            p.send(b"x" * 1000)
        got = local_backlog(f"tcp://127.0.0.1:1/{ring_name}")  # any transport: the segment is named by the path
        assert got is not None and got["messages"] == 3 and 0 < got["bytes"] < 1
        for _ in range(3):
            d = c.recv(5)
            assert d is not None
            d.release()
        assert c.recv(0.05) is None  # the consumer reclaims released space as it goes
        assert local_backlog(f"shm://{ring_name}") == {"bytes": 0.0, "messages": 0.0}
        p.close()
        p.region.close()


def test_closing_a_consumer_twice_is_harmless(ring_name) -> None:
    """A second close (a worker's shutdown after a test's, or a finally after an explicit close) used to
    write into the region the first had unmapped: a segfault. In a child, so that a crash fails this test
    and not the run."""
    import subprocess
    import sys

    code = ("from engine.transport.ring import RingConfig, RingConsumer\n"
            f"c = RingConsumer.create('shm://{ring_name}', RingConfig(slots=16, buffer_bytes=1 << 14))\n"
            "c.close()\nc.close()\nprint('closed twice')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "closed twice" in done.stdout, (done.returncode, done.stderr[-2000:])
