"""A producer (or consumer) process for the ring's multi-process tests.

Run as a script: ``python ring_child.py produce ADDRESS PRODUCER COUNT SEED MAXSIZE [FAULT]``
where FAULT is ``POINT:INDEX:ACTION`` (ACTION ``kill`` or ``stop``), or
``python ring_child.py consume ADDRESS SLOTS BUFFER HOLD_AFTER`` (``consume-batch``: the same with
``recv_many`` batches of up to 4, each released at once).
Messages are ``producer:u32, index:u32`` plus bytes derived from (seed, producer, index),
so the receiver can check every byte without a side channel.
"""

from __future__ import annotations

import os
import random
import signal
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from engine.transport.ring import RingConfig, RingConsumer, attach_producer

HEAD = struct.Struct("<II")


def message(seed: int, producer: int, index: int, maxsize: int) -> bytes:
    rng = random.Random(seed * 1_000_003 + producer * 10_007 + index)
    roll = rng.random()
    if roll < 0.1:
        size = maxsize  # the largest message the ring takes
    elif roll < 0.2:
        size = HEAD.size
    else:
        size = rng.randint(HEAD.size, maxsize)
    return HEAD.pack(producer, index) + rng.randbytes(size - HEAD.size)


def check(seed: int, payload: bytes | memoryview, maxsize: int) -> tuple[int, int]:
    producer, index = HEAD.unpack_from(payload, 0)
    if bytes(payload) != message(seed, producer, index, maxsize):
        raise AssertionError(f"corrupt payload delivered for producer {producer} index {index}")
    return producer, index


def produce(address: str, producer: int, count: int, seed: int, maxsize: int, fault: str | None) -> None:
    p = attach_producer(address, producer, send_timeout=60.0)
    state = {"index": -1, "fired": False}
    if fault:
        point, at, action = fault.split(":")

        def hook(where: str) -> None:
            if where == point and state["index"] == int(at) and not state["fired"]:
                state["fired"] = True
                print(f"fault {where} {at}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL if action == "kill" else signal.SIGSTOP)

        p.fault_hook = hook
    for i in range(count):
        state["index"] = i
        p.send(message(seed, producer, i, maxsize))
    p.flush(60)
    print(f"done {producer} retransmits={p.stats.retransmits} fenced={p.stats.fenced}", flush=True)
    p.close()
    p.region.close()


def consume(address: str, slots: int, buffer_bytes: int, hold_after: int) -> None:
    """Release ``hold_after`` messages (printing each), then hold the next one and wait to be killed."""
    c = RingConsumer.create(address, RingConfig(slots=slots, buffer_bytes=buffer_bytes, max_producers=8))
    print("ready", flush=True)
    n = 0
    while True:
        d = c.recv(30)
        if d is None:
            return
        if n == hold_after:
            print(f"holding {d.producer} {d.seq}", flush=True)
            time.sleep(600)
        print(f"released {d.producer} {d.seq}", flush=True)
        d.release()
        n += 1


def consume_batches(address: str, slots: int, buffer_bytes: int, hold_after: int) -> None:
    """Take batches with recv_many and release each whole; once ``hold_after`` messages were released,
    hold the next batch (printing its messages) and wait to be killed."""
    c = RingConsumer.create(address, RingConfig(slots=slots, buffer_bytes=buffer_bytes, max_producers=8))
    print("ready", flush=True)
    n = 0
    while True:
        b = c.recv_many(4, 30)
        if not b:
            return
        if n >= hold_after:
            print("holding " + " ".join(f"{d.producer}:{d.seq}" for d in b), flush=True)
            time.sleep(600)
        b.release()
        for d in b:
            print(f"released {d.producer} {d.seq}", flush=True)
        n += len(b)


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "produce":
        produce(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]),
                sys.argv[7] if len(sys.argv) > 7 else None)
    elif mode == "consume-batch":
        consume_batches(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        consume(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
