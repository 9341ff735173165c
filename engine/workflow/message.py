"""The Workflow Message: what one stage hands to the next.

Layout (all integers little-endian)::

    0   4s  magic  b"OPWM"
    4   H   version (VERSION)
    6   H   flags (0; reserved)
    8   I   header_len: bytes of UTF-8 JSON header that follow the prefix
    12  I   reserved (0)
    16  Q   total_len: bytes of the whole message, payloads included
    24  ... JSON header
    ...     payloads, each starting at an offset that is a multiple of ALIGN

The JSON header holds the request's routing state (uid, workflow, stage, route,
deadline, priority, attempt, per-stage timestamps), its model parameters
(``params``), its options (``options``: engine.workflow.options, as
``Options.to_json`` writes them; ``{}`` for a plain request) and a table of
entries ``{"name", "kind": "tensor"|"blob", "dtype", "shape", "offset",
"nbytes"}``. Offsets count from the start of the message, so a receiver that
places the message at a 64-byte aligned address (the ring does) gets payloads
it can wrap with ``numpy.frombuffer`` / ``torch.frombuffer`` without a copy.

The codec is pure Python (struct + memoryview) because the Proxy and the rings
use it without torch. ``decode`` never reads outside the buffer it is given:
every malformed input raises a subclass of :class:`MessageError`.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.workflow.errors import InvalidRequest
from engine.workflow.options import PARAM_OPTIONS, Options

MAGIC = b"OPWM"
#: 2: the request's options in the header's ``options``, apart from its ``params`` (engine.workflow.options).
#: A codec that writes 1 (options among the params) would forward a 2's message without its options, so it
#: refuses a 2 (UnsupportedVersion: the job fails, loudly) instead of serving it without its adapters or its
#: quality; this one reads a 1 (a message kept for a retry across an upgrade) by taking its options out of
#: its params.
VERSION = 2
READS = (1, 2)
ALIGN = 64
_PREFIX = struct.Struct("<4sHHIIQ")
PREFIX_SIZE = _PREFIX.size  # 24
# A header larger than this is refused before parsing: it bounds the work a
# corrupt length field can cause.
MAX_HEADER_BYTES = 1 << 20

# dtype name -> item size. Names are torch's (``str(torch.float32)[6:]``);
# numpy has no bfloat16, so bf16 payloads are wrapped with torch only.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "bool": 1,
}


class MessageError(ValueError):
    """Base class of every error raised while decoding or encoding a message."""


class BadMagic(MessageError):
    """The buffer does not start with the message magic."""


class UnsupportedVersion(MessageError):
    """The message was written by a codec version this one cannot read."""


class TruncatedMessage(MessageError):
    """The buffer is shorter than the lengths the message declares."""


class BadHeader(MessageError):
    """The JSON header is not valid JSON or misses / mistypes a field."""


class UnknownDtype(BadHeader):
    """A tensor declares a dtype outside :data:`DTYPE_SIZES`."""


class TensorSizeMismatch(BadHeader):
    """A tensor's nbytes does not equal its shape times its item size."""


class TensorOutOfBounds(MessageError):
    """A payload's offset or extent lies outside the message or is misaligned."""


class OverlappingPayloads(MessageError):
    """Two payloads share bytes (a receiver could be tricked into aliasing)."""


class BufferTooSmall(MessageError):
    """``encode_into`` was given a buffer smaller than ``encoded_size``."""


@dataclass(frozen=True)
class TensorData:
    """A tensor to encode, or one decoded: a dtype name, a shape and its bytes.

    ``data`` is any C-contiguous buffer (bytes, memoryview, numpy array); on
    decode it is a zero-copy ``memoryview`` of the received buffer.
    """

    dtype: str
    shape: tuple[int, ...]
    data: Any

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


@dataclass
class Header:
    """Routing state of one request as it travels its route."""

    uid: str
    workflow: str
    stage: str
    route: list[str]
    deadline: float | None = None
    priority: int = 0
    attempt: int = 0
    timestamps: dict[str, float] = field(default_factory=dict)
    params: dict[str, Any] = field(default_factory=dict)
    #: the request's options, whole (engine.workflow.options.Options.to_json), checked when decoded: read
    #: them with Options.from_json (a version 1 message's, among its params, are moved here when decoded)
    options: dict[str, Any] = field(default_factory=dict)
    # a chunked hand-off (engine.worker.chunks): this message's index among its request's chunks to the same
    # stage, and whether it is the last; -1: the request's one message (the header then carries neither field)
    chunk: int = -1
    final: bool = True

    def to_json(self) -> dict[str, Any]:
        out = {
            "uid": self.uid, "workflow": self.workflow, "stage": self.stage, "route": list(self.route),
            "deadline": self.deadline, "priority": self.priority, "attempt": self.attempt,
            "timestamps": dict(self.timestamps), "params": dict(self.params), "options": dict(self.options),
        }
        if self.chunk >= 0:
            out["chunk"], out["final"] = self.chunk, self.final
        return out


@dataclass
class Message:
    """A decoded message: its header and zero-copy views of its payloads."""

    header: Header
    tensors: dict[str, TensorData]
    blobs: dict[str, memoryview]

    def payload_bytes(self) -> int:
        """Bytes of tensor and blob payloads (what the stage hands on, minus framing)."""
        return sum(t.nbytes for t in self.tensors.values()) + sum(len(b) for b in self.blobs.values())


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _byte_view(data: Any) -> memoryview:
    mv = memoryview(data)
    if not mv.c_contiguous:
        raise MessageError("payload buffers must be C-contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def _plan(
    header: Header, tensors: Mapping[str, TensorData], blobs: Mapping[str, Any]
) -> tuple[bytes, list[tuple[int, memoryview]], int]:
    """Lay the message out: (header JSON, [(offset, payload)], total length).

    The header's offsets depend on its own length, so the layout is computed
    with a fixed-point iteration (lengths of decimal offsets can only grow, so
    it converges in a few rounds).
    """
    items: list[tuple[str, str, str | None, list[int] | None, memoryview]] = []
    for name, t in tensors.items():
        if t.dtype not in DTYPE_SIZES:
            raise UnknownDtype(f"tensor {name!r}: unknown dtype {t.dtype!r}")
        mv = _byte_view(t.data)
        if mv.nbytes != t.nbytes:
            raise TensorSizeMismatch(f"tensor {name!r}: {mv.nbytes} bytes for shape {t.shape} {t.dtype}")
        items.append((name, "tensor", t.dtype, [int(d) for d in t.shape], mv))
    for name, b in blobs.items():
        if name in tensors:
            raise BadHeader(f"name {name!r} used for both a tensor and a blob")
        items.append((name, "blob", None, None, _byte_view(b)))
    base = header.to_json()
    offsets = [0] * len(items)
    for _ in range(16):
        table = [
            {"name": n, "kind": k, "dtype": d, "shape": s, "offset": o, "nbytes": mv.nbytes}
            for (n, k, d, s, mv), o in zip(items, offsets, strict=True)
        ]
        raw = json.dumps({**base, "entries": table}, separators=(",", ":")).encode()
        pos = _align(PREFIX_SIZE + len(raw))
        new_offsets = []
        for *_, mv in items:
            new_offsets.append(pos)
            pos = _align(pos + mv.nbytes)
        if new_offsets == offsets:
            total = offsets[-1] + items[-1][4].nbytes if items else PREFIX_SIZE + len(raw)
            return raw, [(o, it[4]) for o, it in zip(offsets, items, strict=True)], total
        offsets = new_offsets
    raise MessageError("message layout did not converge")  # pragma: no cover - lengths only grow


def encoded_size(header: Header, tensors: Mapping[str, TensorData] = {}, blobs: Mapping[str, Any] = {}) -> int:
    """Exact number of bytes :func:`encode_into` will write for these arguments."""
    return _plan(header, tensors, blobs)[2]


def encode_into(
    buf: Any, header: Header, tensors: Mapping[str, TensorData] = {}, blobs: Mapping[str, Any] = {}
) -> int:
    """Write the message into the writable buffer ``buf`` (e.g. a ring's reserved view).

    Returns the number of bytes written. Padding between payloads is zeroed so
    the bytes are a pure function of the arguments (checksums stay stable).
    Raises :class:`BufferTooSmall` when ``buf`` cannot hold it.
    """
    raw, payloads, total = _plan(header, tensors, blobs)
    out = memoryview(buf).cast("B")
    if out.readonly:
        raise MessageError("encode_into needs a writable buffer")
    if len(out) < total:
        raise BufferTooSmall(f"message needs {total} bytes, buffer has {len(out)}")
    _PREFIX.pack_into(out, 0, MAGIC, VERSION, 0, len(raw), 0, total)
    out[PREFIX_SIZE:PREFIX_SIZE + len(raw)] = raw
    pos = PREFIX_SIZE + len(raw)
    for off, mv in payloads:
        out[pos:off] = bytes(off - pos)
        out[off:off + mv.nbytes] = mv
        pos = off + mv.nbytes
    return total


def encode(header: Header, tensors: Mapping[str, TensorData] = {}, blobs: Mapping[str, Any] = {}) -> bytes:
    """Encode to a new ``bytes`` object (convenience over :func:`encode_into`)."""
    buf = bytearray(encoded_size(header, tensors, blobs))
    encode_into(buf, header, tensors, blobs)
    return bytes(buf)


def _field(obj: Mapping[str, Any], name: str, types: type | tuple[type, ...], optional: bool = False) -> Any:
    if name not in obj:
        raise BadHeader(f"header misses field {name!r}")
    value = obj[name]
    if value is None and optional:
        return None
    # bool is an int subclass; a bool where a number belongs is a malformed header.
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
        raise BadHeader(f"header field {name!r} has type {type(value).__name__}")
    return value


def _as_tuple(types: type | tuple[type, ...]) -> tuple[type, ...]:
    return types if isinstance(types, tuple) else (types,)


def _options(obj: dict[str, Any], version: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(params, options) of a header: a version 1 header's options are among its params (moved out, their
    defaults dropped); either way checked as :class:`Options` (BadHeader naming the field, never a worker's
    crash on a bad option later)."""
    params = _field(obj, "params", dict)
    if version == 1:
        found = {k: params[k] for k in PARAM_OPTIONS if k in params}
        params = {k: v for k, v in params.items() if k not in PARAM_OPTIONS}
        options = Options.of(found).to_json() if found else {}
    else:
        options = _field(obj, "options", dict)
    try:
        Options.from_json(options)
    except InvalidRequest as exc:
        raise BadHeader(f"header field options: {exc}") from None
    return params, options


def _parse_header(obj: Any, version: int = VERSION) -> Header:
    if not isinstance(obj, dict):
        raise BadHeader("header is not a JSON object")
    route = _field(obj, "route", list)
    if not all(isinstance(s, str) for s in route):
        raise BadHeader("route must be a list of stage names")
    timestamps = _field(obj, "timestamps", dict)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in timestamps.values()):
        raise BadHeader("timestamps must map stage names to numbers")
    deadline = _field(obj, "deadline", (int, float), optional=True)
    uid = _field(obj, "uid", str)
    if len(uid) != 32 or any(c not in "0123456789abcdef" for c in uid):
        raise BadHeader("uid must be 32 lowercase hex digits (128 bits)")
    params, options = _options(obj, version)
    return Header(
        uid=uid, workflow=_field(obj, "workflow", str), stage=_field(obj, "stage", str), route=route,
        deadline=None if deadline is None else float(deadline), priority=_field(obj, "priority", int),
        attempt=_field(obj, "attempt", int), timestamps={str(k): float(v) for k, v in timestamps.items()},
        params=params, options=options,
        chunk=_field(obj, "chunk", int) if "chunk" in obj else -1,
        final=_field(obj, "final", bool) if "chunk" in obj else True,
    )


def _prefix(mv: memoryview) -> tuple[int, int, int]:
    """(header length, total length, version) from a message's fixed prefix, checked against each other and
    ``mv``."""
    if len(mv) < PREFIX_SIZE:
        raise TruncatedMessage(f"{len(mv)} bytes is shorter than the {PREFIX_SIZE}-byte prefix")
    magic, version, _flags, header_len, _reserved, total = _PREFIX.unpack_from(mv, 0)
    if magic != MAGIC:
        raise BadMagic(f"bad magic {bytes(magic)!r}")
    if version not in READS:
        raise UnsupportedVersion(f"message version {version}, this codec reads {', '.join(map(str, READS))}")
    if header_len > MAX_HEADER_BYTES:
        raise BadHeader(f"header length {header_len} exceeds {MAX_HEADER_BYTES}")
    if total < PREFIX_SIZE + header_len:
        raise BadHeader(f"total length {total} is smaller than prefix + header")
    if total > len(mv):
        raise TruncatedMessage(f"message declares {total} bytes, buffer has {len(mv)}")
    return header_len, total, version


def _tensor(e: dict[str, Any], name: str, view: memoryview, nbytes: int) -> TensorData:
    """A tensor entry's dtype and shape, checked to fill exactly its ``nbytes``, over its bytes ``view``."""
    dtype = _field(e, "dtype", str)
    if dtype not in DTYPE_SIZES:
        raise UnknownDtype(f"tensor {name!r}: unknown dtype {dtype!r}")
    shape = _field(e, "shape", list)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise BadHeader(f"tensor {name!r}: shape must be non-negative integers")
    if len(shape) > 16 or math.prod(shape) * DTYPE_SIZES[dtype] != nbytes:
        raise TensorSizeMismatch(f"tensor {name!r}: shape {shape} {dtype} does not fill {nbytes} bytes")
    return TensorData(dtype, tuple(shape), view)


def decode(buffer: Any) -> Message:
    """Decode a message; payloads are zero-copy views into ``buffer``.

    The caller must keep ``buffer`` alive (and unchanged) while it uses the
    views. Bytes after ``total_len`` are ignored, so a ring slot larger than
    the message is fine. Raises a :class:`MessageError` subclass on any
    malformed input and never reads past the buffer's end.
    """
    try:
        mv = memoryview(buffer).cast("B")
    except TypeError as exc:
        raise MessageError(f"not a buffer: {type(buffer).__name__}") from exc
    header_len, total, version = _prefix(mv)
    try:
        obj = json.loads(bytes(mv[PREFIX_SIZE:PREFIX_SIZE + header_len]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise BadHeader(f"header is not valid JSON: {exc}") from exc
    header = _parse_header(obj, version)
    entries = _field(obj, "entries", list)
    data_start = PREFIX_SIZE + header_len
    tensors: dict[str, TensorData] = {}
    blobs: dict[str, memoryview] = {}
    spans: list[tuple[int, int, str]] = []
    for e in entries:
        if not isinstance(e, dict):
            raise BadHeader("entry is not an object")
        name = _field(e, "name", str)
        kind = _field(e, "kind", str)
        offset = _field(e, "offset", int)
        nbytes = _field(e, "nbytes", int)
        if name in tensors or name in blobs:
            raise BadHeader(f"duplicate payload name {name!r}")
        if offset < data_start or offset % ALIGN or nbytes < 0 or offset + nbytes > total:
            raise TensorOutOfBounds(
                f"{name!r}: offset {offset} nbytes {nbytes} outside [{data_start}, {total}) or not {ALIGN}-aligned"
            )
        spans.append((offset, offset + nbytes, name))
        view = mv[offset:offset + nbytes]
        if kind == "blob":
            blobs[name] = view
        elif kind == "tensor":
            tensors[name] = _tensor(e, name, view, nbytes)
        else:
            raise BadHeader(f"entry {name!r}: unknown kind {kind!r}")
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:], strict=False):
        if start < end:
            raise OverlappingPayloads(f"payloads {a!r} and {b!r} overlap")
    return Message(header, tensors, blobs)


_UID = re.compile(rb'"uid"\s*:\s*"([0-9a-f]{32})"')


def peek_uid(buffer: Any) -> str | None:
    """The UID of a message that may not decode (a header over the limit, a bad field), read from the
    start of its header without parsing it; None when there is none. Lets a receiver fail the job with
    the reason instead of dropping it unnamed."""
    try:
        mv = memoryview(buffer).cast("B")
    except TypeError:
        return None
    if len(mv) < PREFIX_SIZE or bytes(mv[:4]) != MAGIC:
        return None
    found = _UID.search(bytes(mv[PREFIX_SIZE:PREFIX_SIZE + 4096]))
    return found.group(1).decode() if found else None


def to_numpy(t: TensorData) -> Any:
    """Wrap a tensor's bytes as a numpy array without copying (not for bfloat16)."""
    import numpy as np

    if t.dtype == "bfloat16":
        raise UnknownDtype("numpy has no bfloat16; wrap with engine.stages.tensors.to_torch")
    return np.frombuffer(t.data, dtype=np.dtype(t.dtype), count=math.prod(t.shape)).reshape(t.shape)


def from_numpy(array: Any) -> TensorData:
    """Describe a numpy array as :class:`TensorData` (made contiguous if it is not)."""
    import numpy as np

    array = np.ascontiguousarray(array)
    return TensorData(str(array.dtype), tuple(int(d) for d in array.shape), array.reshape(-1).view(np.uint8))
