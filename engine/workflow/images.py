"""The one check of an input image (run by :meth:`engine.workflow.spec.WorkflowSpec.validate_request`).

Bounded before anything is decoded, cheapest first: the byte size, then the
format (only the formats a client sends; PIL's exotic plug-ins such as EPS,
which runs Ghostscript, are never reached), then the dimensions read from the
file's header (a decompression bomb is refused here, before its pixels
exist), then a full ``verify()`` of the file's structure and checksums, which
reads the bytes without decoding the pixels. CPU-bound: async callers run it
in a thread.
"""

from __future__ import annotations

import io
import struct

from engine.workflow.errors import InvalidRequest

FORMATS = ("PNG", "JPEG", "WEBP")
MAX_BYTES = 16 << 20
MAX_PIXELS = 4096 * 4096


class ImageTooLarge(InvalidRequest):
    """The image's bytes are over the limit (HTTP 413 rather than 400)."""


def check_image(data: bytes | bytearray | memoryview, name: str = "image", max_bytes: int = MAX_BYTES,
                max_pixels: int = MAX_PIXELS) -> tuple[int, int]:
    """(width, height) of a well-formed image within the limits; raises :class:`InvalidRequest` naming
    ``name`` (:class:`ImageTooLarge` for the byte size) otherwise. Never decodes pixels."""
    import warnings

    from PIL import Image, UnidentifiedImageError

    if len(data) > max_bytes:
        raise ImageTooLarge(name, f"{name} is {len(data)} bytes; the limit is {max_bytes}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(bytes(data)), formats=FORMATS) as img:
                w, h = img.size  # from the header; no pixels decoded yet
                if w * h > max_pixels:
                    raise InvalidRequest(name, f"{name} is {w}x{h}; at most {max_pixels} pixels are accepted")
                img.verify()
    except InvalidRequest:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError, struct.error,
            Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise InvalidRequest(name, f"{name} is not a readable image (PNG, JPEG or WebP): {exc}") from None
    return w, h


def blank_png(width: int, height: int) -> bytes:
    """A mid-grey PNG: the image input of a warm-up request."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (128, 128, 128)).save(buf, "PNG")
    return buf.getvalue()

