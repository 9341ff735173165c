"""The Workflow Message codec: round trips, zero-copy views, typed errors, fuzzing."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.workflow import message as m

UID = "0123456789abcdef0123456789abcdef"


def _header(**kw: object) -> m.Header:
    base = dict(uid=UID, workflow="wan2.1-i2v", stage="denoise", route=["text_encode", "denoise"],
                deadline=1.7e9, priority=3, attempt=1, timestamps={"text_encode": 1.5e9}, params={"seed": 7})
    base.update(kw)
    return m.Header(**base)  # type: ignore[arg-type]


def _sample() -> bytes:
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    b = np.arange(7, dtype=np.uint8)
    return m.encode(_header(params={"note": "x" * 100}), {"a": m.from_numpy(a), "b": m.from_numpy(b)}, {"video": b"\x00mp4data"})


def test_round_trip_header_tensors_and_blobs() -> None:
    msg = m.decode(_sample())
    assert msg.header == _header(params={"note": "x" * 100})
    assert msg.tensors["a"].shape == (2, 3, 4) and msg.tensors["a"].dtype == "float32"
    np.testing.assert_array_equal(m.to_numpy(msg.tensors["a"]), np.arange(24, dtype=np.float32).reshape(2, 3, 4))
    np.testing.assert_array_equal(m.to_numpy(msg.tensors["b"]), np.arange(7, dtype=np.uint8))
    assert bytes(msg.blobs["video"]) == b"\x00mp4data"
    assert msg.payload_bytes() == 96 + 7 + 8


def test_payloads_are_64_byte_aligned_views_into_the_buffer() -> None:
    buf = bytearray(_sample())
    msg = m.decode(buf)
    for t in msg.tensors.values():
        off = np.frombuffer(t.data, np.uint8).ctypes.data - np.frombuffer(buf, np.uint8).ctypes.data
        assert off % m.ALIGN == 0
    # Zero copy: writing the buffer shows through the decoded view.
    arr = m.to_numpy(msg.tensors["b"])
    first = np.frombuffer(buf, np.uint8).ctypes.data
    buf[arr.ctypes.data - first] = 99
    assert arr[0] == 99


def test_encode_into_a_larger_reserved_view_matches_encode() -> None:
    hdr, tensors = _header(), {"x": m.from_numpy(np.ones((3, 5), np.float32))}
    n = m.encoded_size(hdr, tensors)
    ring = bytearray(n + 100)
    assert m.encode_into(memoryview(ring)[:n + 50], hdr, tensors) == n
    assert bytes(ring[:n]) == m.encode(hdr, tensors)
    assert m.decode(ring).header.uid == UID  # trailing slot bytes are ignored
    with pytest.raises(m.BufferTooSmall):
        m.encode_into(bytearray(n - 1), hdr, tensors)


def test_bfloat16_entries_carry_their_dtype() -> None:
    raw = m.encode(_header(), {"e": m.TensorData("bfloat16", (2, 2), bytes(8))})
    t = m.decode(raw).tensors["e"]
    assert (t.dtype, t.shape, t.nbytes) == ("bfloat16", (2, 2), 8)
    with pytest.raises(m.UnknownDtype):
        m.to_numpy(t)


def _patch_header(raw: bytes, change: object) -> bytes:
    hlen = struct.unpack_from("<I", raw, 8)[0]
    obj = json.loads(raw[m.PREFIX_SIZE:m.PREFIX_SIZE + hlen])
    obj["params"] = {}  # frees room so the edited header still ends before the first payload
    change(obj)  # type: ignore[operator]
    new = json.dumps(obj, separators=(",", ":")).encode()
    assert len(new) <= hlen
    new = new + b" " * (hlen - len(new))  # JSON tolerates trailing spaces; offsets stay valid
    return raw[:m.PREFIX_SIZE] + new + raw[m.PREFIX_SIZE + hlen:]


@pytest.mark.parametrize(
    ("mutate", "error"),
    [
        (lambda r: b"XXXX" + r[4:], m.BadMagic),
        (lambda r: r[:4] + struct.pack("<H", 99) + r[6:], m.UnsupportedVersion),
        (lambda r: r[:10], m.TruncatedMessage),
        (lambda r: r[:-1], m.TruncatedMessage),
        (lambda r: r[:8] + struct.pack("<I", 5) + r[12:], m.BadHeader),
        (lambda r: r[:8] + struct.pack("<I", 1 << 30) + r[12:], m.BadHeader),
        (lambda r: _patch_header(r, lambda o: o.pop("uid")), m.BadHeader),
        (lambda r: _patch_header(r, lambda o: o.update(uid="xyz")), m.BadHeader),
        (lambda r: _patch_header(r, lambda o: o.update(priority="high")), m.BadHeader),
        (lambda r: _patch_header(r, lambda o: o.update(route=[1])), m.BadHeader),
        (lambda r: _patch_header(r, lambda o: o["entries"][0].update(dtype="complex7")), m.UnknownDtype),
        (lambda r: _patch_header(r, lambda o: o["entries"][0].update(shape=[9, 9])), m.TensorSizeMismatch),
        (lambda r: _patch_header(r, lambda o: o["entries"][0].update(offset=1 << 40)), m.TensorOutOfBounds),
        (lambda r: _patch_header(r, lambda o: o["entries"][0].update(offset=o["entries"][0]["offset"] + 1)),
         m.TensorOutOfBounds),
        (lambda r: _patch_header(r, lambda o: o["entries"][1].update(offset=o["entries"][0]["offset"])),
         m.OverlappingPayloads),
        (lambda r: _patch_header(r, lambda o: o["entries"][1].update(name="a")), m.BadHeader),
        (lambda r: _patch_header(r, lambda o: o["entries"][2].update(kind="weird")), m.BadHeader),
    ],
)
def test_malformed_messages_raise_typed_errors(mutate: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        m.decode(mutate(_sample()))  # type: ignore[operator]


def test_encoder_refuses_inconsistent_tensors() -> None:
    with pytest.raises(m.TensorSizeMismatch):
        m.encode(_header(), {"a": m.TensorData("float32", (3,), bytes(8))})
    with pytest.raises(m.UnknownDtype):
        m.encode(_header(), {"a": m.TensorData("float8", (1,), bytes(1))})


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_fuzz_garbage_raises_only_message_errors(data: bytes) -> None:
    with pytest.raises(m.MessageError):
        m.decode(m.MAGIC + struct.pack("<H", m.VERSION) + data)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_fuzz_mutated_valid_messages_never_over_read(data: st.DataObject) -> None:
    raw = bytearray(_sample())
    for _ in range(data.draw(st.integers(1, 8))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    buf = bytes(raw[:cut])
    try:
        msg = m.decode(buf)
    except m.MessageError:
        return
    for t in msg.tensors.values():  # whatever decoded lies inside the buffer
        assert t.data.obj is not None and t.data.nbytes == t.nbytes <= len(buf)
    for b in msg.blobs.values():
        assert b.nbytes <= len(buf)
