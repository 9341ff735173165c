"""The still variants of a finished video (``GET /v1/videos/{id}/content?variant=...``), made from its mp4.

``thumbnail``: the first frame as a PNG. ``spritesheet``: up to :data:`SPRITES` frames, evenly spaced, in
one JPEG grid. Decoded with imageio's bundled ffmpeg, the library that wrote the mp4.
"""

from __future__ import annotations

import io
import math
import os
import tempfile
from typing import Any

SPRITES = 16
SPRITE_WIDTH = 160  # pixels per frame in the grid; taller videos keep their aspect ratio


def _frames(mp4: bytes, limit: int | None = None) -> list[Any]:
    import imageio

    fd, path = tempfile.mkstemp(suffix=".mp4")  # ffmpeg reads mp4 from a seekable file
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(mp4)
        with imageio.get_reader(path, format="ffmpeg") as reader:
            frames = []
            for frame in reader:
                frames.append(frame)
                if limit is not None and len(frames) >= limit:
                    break
        return frames
    finally:
        os.unlink(path)


def thumbnail(mp4: bytes) -> bytes:
    """The first frame as PNG bytes."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(_frames(mp4, 1)[0]).save(buf, format="PNG")
    return buf.getvalue()


def spritesheet(mp4: bytes) -> bytes:
    """Up to :data:`SPRITES` evenly spaced frames in a JPEG grid (row by row, in time order)."""
    from PIL import Image

    frames = _frames(mp4)
    n = min(SPRITES, len(frames))
    picked = [frames[round(i * (len(frames) - 1) / max(1, n - 1))] for i in range(n)]
    h0, w0 = picked[0].shape[:2]
    w = min(SPRITE_WIDTH, w0)
    h = max(1, round(h0 * w / w0))
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    sheet = Image.new("RGB", (cols * w, rows * h))
    for i, frame in enumerate(picked):
        sheet.paste(Image.fromarray(frame).resize((w, h)), ((i % cols) * w, (i // cols) * h))
    buf = io.BytesIO()
    sheet.save(buf, format="JPEG", quality=85)
    return buf.getvalue()


VARIANTS = {"thumbnail": (thumbnail, "image/png", "png"), "spritesheet": (spritesheet, "image/jpeg", "jpg")}
