"""The native fast paths' one pass over the bytes: the fused copy-and-checksum.

The producer hashes while it copies and the consumer verifies with the same loop (engine/transport/
_atomics.c); both must compute exactly xxh3-64 of the 40 covered header bytes and the payload, as
the Python steps do, at every size and alignment, with ordinary or non-temporal stores.
"""

from __future__ import annotations

import os
import random

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.transport import layout as L
from engine.transport.ring import RingConfig, RingConsumer, attach_producer
from engine.transport.ring.base import _ring_send

pytestmark = pytest.mark.skipif(_ring_send is None, reason="the native fast paths are not built for this CPU")


@settings(max_examples=150, deadline=None)
@given(
    size=st.one_of(st.integers(0, 2048), st.integers(2048, 300_000), st.sampled_from([1023, 1024, 1025, 1 << 20])),
    src_off=st.integers(0, 63),
    dst_off=st.integers(0, 63),
    stream=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_fused_copy_and_checksum_equals_xxh3_of_header_and_payload(size, src_off, dst_off, stream, seed) -> None:
    from engine.transport._atomics import ring_record_checksum

    rng = random.Random(seed)
    header = rng.randbytes(L.CHECKSUM_COVERS)
    payload = memoryview(rng.randbytes(size + src_off))[src_off:]
    want = xxhash.xxh3_64_intdigest(header + payload)
    assert ring_record_checksum(header, payload) == want  # the consumer's verification (no copy)
    out = bytearray(size + 64)
    dst = memoryview(out)[dst_off : dst_off + size]
    assert ring_record_checksum(header, payload, dst, stream) == want  # the producer's copy
    assert dst == payload
    assert ring_record_checksum(header, payload, None, False, False) == xxhash.xxh3_64_intdigest(header)


def test_large_messages_take_the_streaming_copy_and_arrive_intact(ring_name) -> None:
    from engine.transport._atomics import ring_set_stream_min

    cfg = RingConfig(slots=8, buffer_bytes=8 << 20)
    c = RingConsumer.create(f"shm://{ring_name}", cfg)
    p = attach_producer(f"shm://{ring_name}", 0)
    old = ring_set_stream_min(64 << 10)
    try:
        for seq, size in enumerate((64 << 10, (1 << 20) + 3, (3 << 20) + 61)):
            m = os.urandom(size)
            p.send(m)
            assert c.recv_bytes(2) == (0, seq, m)
    finally:
        ring_set_stream_min(old)
        p.close()
        p.region.close()
        c.close()
