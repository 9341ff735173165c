"""The ring between processes, under stress and faults: nothing lost, corrupt or duplicated.

Each producer child sends messages whose bytes derive from (seed, producer, index), so
the consumer checks every byte. Faults are injected at named points of a producer's
write (engine.transport.ring.RingProducer.fault_hook): after reservation, after the
claim, mid-payload and before commit.
"""

from __future__ import annotations

import os
import signal
import time
from collections import defaultdict

import pytest

from engine.transport.ring import RingConfig, RingConsumer, attach_producer
from tests.engine.transport.ring_child import check

SEED = 7


def consume_until(c: RingConsumer, done, seen: dict[int, list[int]], maxsize: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out; seen so far: { {p: len(v) for p, v in seen.items()} }"
        d = c.recv(0.05)
        if d is None:
            continue
        with d:
            producer, index = check(SEED, d.view, maxsize)
            seen[producer].append(index)


def assert_exact(seen: dict[int, list[int]], expected: dict[int, int]) -> None:
    for producer, count in expected.items():
        got = seen.get(producer, [])
        assert got == list(range(count)), (
            f"producer {producer}: expected indices 0..{count - 1} once each, in order; "
            f"got {len(got)} (dups: {len(got) - len(set(got))}, first bad: "
            f"{next((i for i, v in enumerate(got) if v != i), None)})"
        )


def test_stress_more_producers_than_cores_random_sizes(children, ring_name) -> None:
    cfg = RingConfig(slots=32, buffer_bytes=1 << 18, max_producers=8, lock_timeout=0.5)
    maxsize = cfg.max_message
    count, nprod = 150, max(4, (os.cpu_count() or 2) * 2 + 1)
    with RingConsumer.create(f"shm://{ring_name}", cfg) as c:
        procs = [children.start("produce", f"shm://{ring_name}", i, count, SEED, maxsize) for i in range(nprod)]
        seen: dict[int, list[int]] = defaultdict(list)
        consume_until(c, lambda: sum(map(len, seen.values())) >= nprod * count, seen, maxsize, timeout=120)
        for p in procs:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
        assert_exact(seen, {i: count for i in range(nprod)})
        assert c.stats.corrupt == 0
        assert c.stats.delivered == nprod * count


@pytest.mark.parametrize("point", ["reserved", "claimed", "mid_payload", "before_commit"])
def test_sigkill_of_a_producer_at_each_point_of_its_write(children, ring_name, point) -> None:
    cfg = RingConfig(slots=16, buffer_bytes=1 << 16, max_producers=4, lock_timeout=0.2)
    maxsize, count, kill_at = cfg.max_message, 40, 20
    with RingConsumer.create(f"shm://{ring_name}", cfg) as c:
        victim = children.start("produce", f"shm://{ring_name}", 0, count, SEED, maxsize, f"{point}:{kill_at}:kill")
        other = children.start("produce", f"shm://{ring_name}", 1, count, SEED, maxsize)
        seen: dict[int, list[int]] = defaultdict(list)
        consume_until(c, lambda: len(seen[1]) >= count and victim.poll() is not None
                      and len(seen[0]) >= kill_at, seen, maxsize)
        # drain anything still in flight, then check exact counts
        consume_until(c, lambda: c.recv(0.3) is None, seen, maxsize, timeout=10)
        assert victim.returncode == -signal.SIGKILL
        assert other.wait(30) == 0
        # every message the victim had sent before dying arrives once; the one it died in never does
        assert_exact(seen, {0: kill_at, 1: count})
        assert c.stats.corrupt == 0
        assert c.stats.steals == 1  # the dead producer's reservation was stolen and its span freed
        assert c.held == 0, "a dead producer's quarantined span was never released"


def test_sigstop_past_the_lock_timeout_then_sigcont(children, ring_name) -> None:
    """The paper's loss case: a producer stalls mid-write past its lock timeout, then wakes up."""
    cfg = RingConfig(slots=64, buffer_bytes=1 << 20, max_producers=4, lock_timeout=0.2)
    maxsize, count, stop_at = 4096, 60, 10
    with RingConsumer.create(f"shm://{ring_name}", cfg) as c:
        staller = children.start("produce", f"shm://{ring_name}", 0, count, SEED, maxsize, f"mid_payload:{stop_at}:stop")
        seen: dict[int, list[int]] = defaultdict(list)
        assert staller.stdout.readline().startswith("fault mid_payload")
        other = children.start("produce", f"shm://{ring_name}", 1, count, SEED, maxsize)
        # while it is stopped, the others are delivered past its slot, and after the lock
        # timeout the consumer steals the slot (the paper's loss case)
        consume_until(c, lambda: len(seen[1]) >= count and c.stats.steals >= 1, seen, maxsize, timeout=60)
        assert c.stats.quarantined >= 1
        os.kill(staller.pid, signal.SIGCONT)
        consume_until(c, lambda: len(seen[0]) >= count, seen, maxsize, timeout=60)
        out, err = staller.communicate(timeout=30)
        assert staller.returncode == 0, err
        assert "fenced=1" in out  # its commit was refused and the message resent
        assert other.wait(30) == 0
        assert_exact(seen, {0: count, 1: count})
        assert c.stats.corrupt == 0


@pytest.mark.parametrize("scheme", ["shm", "tcp"])
def test_sigkill_of_the_consumer_mid_read_then_recovery(children, ring_name, scheme) -> None:
    """Over tcp too: the region is a named segment on the owner's host, so it outlives the owner, and the
    restarted owner serves it again at the same address (what a restarted cross-host worker does)."""
    from engine.embedded.services import free_port

    cfg = RingConfig(slots=64, buffer_bytes=1 << 20, max_producers=4)
    address = f"shm://{ring_name}" if scheme == "shm" else f"tcp://127.0.0.1:{free_port()}/{ring_name}"
    consumer = children.start("consume", address, cfg.slots, cfg.buffer_bytes, 15)
    assert consumer.stdout.readline().strip() == "ready"
    p = attach_producer(address, 0, send_timeout=30)
    sent = [f"message {i}".encode() for i in range(40)]
    for m in sent:
        p.send(m)
    released, holding = [], None
    for line in consumer.stdout:
        kind, _producer, seq = line.split()
        if kind == "holding":
            holding = int(seq)
            break
        released.append(int(seq))
    consumer.kill()  # SIGKILL while it holds a view of message `holding`
    consumer.wait(10)
    assert released == list(range(15)) and holding == 15
    with RingConsumer.recover(address, cfg) as c:
        after = []
        while len(after) < 25:
            d = c.recv(5)
            assert d is not None, f"lost messages after recovery; got {after}"
            with d:
                assert bytes(d.view) == sent[d.seq]
                after.append(d.seq)
        assert after == list(range(15, 40))  # the held one again, no released one twice
        if scheme == "shm":
            p.flush(10)
        else:  # the old agent's connection died with it; a producer reattaches to the same address
            p.region.close()
            p = attach_producer(address, None, send_timeout=30)
            p.send(b"after the restart")
            d = c.recv(5)
            assert d is not None and bytes(d.view) == b"after the restart"
            d.release()
        p.region.close()
    assert not os.path.exists(f"/dev/shm/onepiece-{ring_name}")


def test_sigkill_of_a_batch_consumer_then_recovery(children, ring_name) -> None:
    """Batches released whole are never delivered again after the consumer dies; the batch it held is."""
    cfg = RingConfig(slots=64, buffer_bytes=1 << 20, max_producers=4)
    address = f"shm://{ring_name}"
    consumer = children.start("consume-batch", address, cfg.slots, cfg.buffer_bytes, 10)
    assert consumer.stdout.readline().strip() == "ready"
    p = attach_producer(address, 0, send_timeout=30)
    sent = [f"message {i}".encode() for i in range(40)]
    for m in sent:
        p.send(m)
    released, holding = [], []
    for line in consumer.stdout:
        kind, *rest = line.split()
        if kind == "holding":
            holding = [int(x.split(":")[1]) for x in rest]
            break
        released.append(int(rest[1]))
    consumer.kill()  # SIGKILL while it holds a batch
    consumer.wait(10)
    assert released == list(range(len(released))) and len(released) >= 10
    assert holding == list(range(len(released), len(released) + len(holding))) and holding
    with RingConsumer.recover(address, cfg) as c:
        after = []
        while len(after) < 40 - len(released):
            b = c.recv_many(8, 5)
            assert b, f"lost messages after recovery; got {after}"
            for d in b:
                assert bytes(d.view) == sent[d.seq]
                after.append(d.seq)
            b.release()
        assert after == list(range(len(released), 40))  # the held batch again, no released one twice
        p.flush(10)
        p.region.close()
    assert not os.path.exists(f"/dev/shm/onepiece-{ring_name}")
