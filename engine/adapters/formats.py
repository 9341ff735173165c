"""Reading safetensors files without torch: the header (names, dtypes, shapes) and the metadata.

A safetensors file is 8 bytes of little-endian header length, a JSON header
(``{name: {"dtype", "shape", "data_offsets"}, "__metadata__": {...}}``) and the
tensor bytes. The registry validates adapters from their headers alone, so
``onepiece adapters add``, the Proxy and the web platform never import torch.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit


class NotSafetensors(ValueError):
    """The file is not a well-formed safetensors file."""


def read_header(path: str | Path) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """({tensor name: {"dtype", "shape", "data_offsets"}}, metadata) of a safetensors file; checks that the
    offsets tile the data section exactly (a truncated or padded file is refused)."""
    p = Path(path)
    size = p.stat().st_size
    with p.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise NotSafetensors(f"{p.name} is not a safetensors file (shorter than 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n < 2 or n > MAX_HEADER_BYTES or 8 + n > size:
            raise NotSafetensors(f"{p.name} is not a safetensors file (header length {n})")
        raw = f.read(n)
    try:
        doc = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise NotSafetensors(f"{p.name} is not a safetensors file (header is not JSON: {exc})") from None
    if not isinstance(doc, dict):
        raise NotSafetensors(f"{p.name} is not a safetensors file (header is not an object)")
    meta = doc.pop("__metadata__", None) or {}
    if not isinstance(meta, dict):
        raise NotSafetensors(f"{p.name}: __metadata__ is not an object")
    spans = []
    for name, info in doc.items():
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            raise NotSafetensors(f"{p.name}: tensor {name!r} lacks dtype, shape or data_offsets")
        start, end = info["data_offsets"]
        spans.append((int(start), int(end)))
    at = 0
    for start, end in sorted(spans):
        if start != at or end < start:
            raise NotSafetensors(f"{p.name}: tensor data offsets overlap or leave holes")
        at = end
    if 8 + n + at != size:
        raise NotSafetensors(f"{p.name}: {size} bytes, but the header describes {8 + n + at}")
    return doc, {str(k): str(v) for k, v in meta.items()}


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
