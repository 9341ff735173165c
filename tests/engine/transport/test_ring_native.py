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


def test_native_primitives_refuse_a_wrong_argument_count_with_their_signature() -> None:
    """Every native call checks its argument count before it touches an address (a short call
    would otherwise read past the argument array) and says what it takes."""
    import mmap

    from engine.transport import _atomics as a

    cases = [
        (a.cas64, (1, 2), r"cas64\(addr, expected, desired\) takes 3 arguments, got 2"),
        (a.faa64, (1,), r"faa64\(addr, delta\) takes 2 arguments, got 1"),
        (a.store64, (1, 2, 3), r"store64\(addr, value\) takes 2 arguments, got 3"),
        (a.futex_wait, (0, 0), r"futex_wait\(addr, expected, timeout_s\) takes 3 arguments, got 2"),
        (a.copy, (), r"copy\(dst, src, n\) takes 3 arguments, got 0"),
        (a.ring_send, (1,), r"ring_send takes 11 arguments, got 1"),
        (a.ring_spin, (1, 2), r"ring_spin\(base, s_off, slots, cursor, max_ns, yield_ns\) takes 6 arguments, got 2"),
        (a.ring_run_mark, (1, 2, 3), r"ring_run_mark takes 7 arguments, got 3"),
        (a.ring_run_free, (1,) * 8, r"ring_run_free takes 7 arguments, got 8"),
    ]
    for fn, args, message in cases:
        with pytest.raises(TypeError, match=message):
            fn(*args)
    # and with the right count they act on the address they were given
    import ctypes

    buf = mmap.mmap(-1, 4096)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert a.cas64(addr, 0, 7) == 0 and a.load64(addr) == 7
    assert a.cas64(addr, 0, 9) == 7 and a.load64(addr) == 7  # a failed CAS leaves the word alone
    assert a.faa64(addr, 5) == 7 and a.load64(addr) == 12
    a.store64(addr + 8, 2**64 - 1)
    assert a.load64(addr + 8) == 2**64 - 1
    assert a.faa32(addr + 16, 3) == 0 and a.load32(addr + 16) == 3
    assert a.futex_wait(addr + 16, 4, 0.001) is True  # the word is not 4: returns at once
    assert a.futex_wait(addr + 16, 3, 0.001) is False  # nobody wakes it: times out
    a.copy(addr + 64, addr, 24)
    assert bytes(buf[64:88]) == bytes(buf[0:24])
    del addr
    buf.close()
