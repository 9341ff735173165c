"""Reading safetensors files without torch: the header (names, dtypes, shapes) and the metadata.

A safetensors file is 8 bytes of little-endian header length, a JSON header
(``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}``) and the
tensor bytes. The registry validates adapters from their headers alone, so
``onepiece adapters add``, the Proxy and the web platform never import torch;
a malformed header is a :class:`NotSafetensors` naming what is wrong, never an
exception from deeper down.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any, BinaryIO

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
#: safetensors' dtypes and their item sizes in bytes (the sub-byte float formats are refused: no LoRA uses them)
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
               "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}


class NotSafetensors(ValueError):
    """The file is not a well-formed safetensors file."""


def shown(text: str, limit: int = 80) -> str:
    """``text`` as a refusal quotes it: repr'd (one line) and cut to ``limit`` characters."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def read_header(path: str | Path) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """({tensor name: {"dtype", "shape", "data_offsets"}}, metadata) of a safetensors file, validated entry by
    entry (see :func:`parse_header`); :class:`NotSafetensors` saying what is wrong otherwise."""
    p = Path(path)
    with p.open("rb") as f:
        return parse_header(f, os.fstat(f.fileno()).st_size, p.name)


def parse_header(f: BinaryIO, size: int, name: str) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """:func:`read_header` of the file open as ``f`` (``size`` bytes; ``name`` is how refusals call it).
    Every check safetensors (or torch) would otherwise fail on with a traceback is made here, on a bounded
    read: the header's length within the file, UTF-8, JSON (deep nesting included), an object; each tensor a
    known dtype, a shape of non-negative integers, ``data_offsets`` ``[begin, end]`` inside the data section
    holding exactly its bytes; the offsets tiling the data section (a truncated or padded file is refused);
    ``__metadata__`` an object of strings."""
    doc, n = _header_json(f, size, name)
    meta = doc.pop("__metadata__", None)
    meta = {} if meta is None else meta
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise NotSafetensors(f"{name}: __metadata__ is not an object of strings")
    data = size - 8 - n
    at = 0
    for start, end in sorted(_check_entry(name, key, info, data) for key, info in doc.items()):
        if start != at:
            raise NotSafetensors(f"{name}: tensor data offsets overlap or leave holes")
        at = end
    if at != data:
        raise NotSafetensors(f"{name}: {size} bytes, but the header describes {8 + n + at}")
    return doc, meta


def _header_json(f: BinaryIO, size: int, name: str) -> tuple[dict[str, Any], int]:
    """(the header as an object, its length in bytes)."""
    head = f.read(8)
    if len(head) != 8:
        raise NotSafetensors(f"{name} is not a safetensors file (shorter than 8 bytes)")
    (n,) = struct.unpack("<Q", head)
    if n < 2 or n > MAX_HEADER_BYTES or 8 + n > size:
        raise NotSafetensors(f"{name} is not a safetensors file (header length {n} in a file of {size} bytes)")
    raw = f.read(n)
    if len(raw) != n:
        raise NotSafetensors(f"{name} is not a safetensors file (shorter than its header length {n})")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise NotSafetensors(f"{name} is not a safetensors file (header is not UTF-8)") from None
    except RecursionError:
        raise NotSafetensors(f"{name} is not a safetensors file (header JSON is nested too deeply)") from None
    except ValueError as exc:
        raise NotSafetensors(f"{name} is not a safetensors file (header is not JSON: {exc})") from None
    if not isinstance(doc, dict):
        raise NotSafetensors(f"{name} is not a safetensors file (header is not an object)")
    return doc, n


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_entry(name: str, key: str, info: object, data: int) -> tuple[int, int]:
    """(begin, end) of one tensor's bytes in the data section (``data`` bytes long), once its entry is valid."""
    where = f"{name}: tensor {shown(key)}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
        raise NotSafetensors(f"{where} lacks dtype, shape or data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BYTES:
        got = shown(dtype, 20) if isinstance(dtype, str) else f"a JSON {type(dtype).__name__}"
        raise NotSafetensors(f"{where}: dtype {got} is not one of {', '.join(DTYPE_BYTES)}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise NotSafetensors(f"{where}: shape is not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets) \
            or not 0 <= offsets[0] <= offsets[1] <= data:
        raise NotSafetensors(f"{where}: data_offsets is not [begin, end] with 0 <= begin <= end <= {data} (the "
                             f"data section's length)")
    want = math.prod(shape) * DTYPE_BYTES[dtype]
    if offsets[1] - offsets[0] != want:
        raise NotSafetensors(f"{where}: data_offsets span {offsets[1] - offsets[0]} bytes; a {dtype} tensor of "
                             f"{len(shape)} dimensions as given takes {want}")
    return offsets[0], offsets[1]


def weight_shapes(component_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """{parameter name: shape} of a diffusers model folder's weights (one file or a sharded index)."""
    folder = Path(component_dir)
    index = folder / "diffusion_pytorch_model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else \
        ["diffusion_pytorch_model.safetensors"]
    out: dict[str, tuple[int, ...]] = {}
    for name in files:
        header, _ = read_header(folder / name)
        out.update({k: tuple(int(d) for d in v["shape"]) for k, v in header.items()})
    return out
