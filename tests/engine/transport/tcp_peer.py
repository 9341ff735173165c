"""The far end of the cross-host TCP test: a ring consumer (run inside a network namespace)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from engine.transport.ring import RingConfig, RingConsumer


def main(bind: str, count: int) -> None:
    name = f"test-{os.getppid()}-xhost"  # a segment on this host: named for the test run's leak check
    c = RingConsumer.create(f"tcp://{bind}:0/{name}", RingConfig(slots=64, buffer_bytes=1 << 20, max_producers=4))
    print(c.region.address, flush=True)
    for i in range(count):
        item = c.recv_bytes(30)
        assert item is not None, f"timed out waiting for message {i}"
        _p, seq, data = item
        assert seq == i and data == bytes([i % 251]) * (1000 + 37 * i), f"bad message {i}"
    print(f"received {count}", flush=True)
    sys.stdin.read()  # stay up until the producer has seen its acknowledgements
    c.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
