"""wan2.1-i2v video_encode: uint8 frames -> mp4 (H.264) bytes, on the CPU."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from engine.stages.base import ModelFreeStage, StageContext


def encode_mp4(frames: Any, fps: int) -> bytes:
    """(F, H, W, 3) uint8 array -> mp4 bytes, through imageio's bundled ffmpeg.

    ffmpeg wants a seekable file for the mp4 index, hence the temporary file.
    """
    import imageio

    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        # macro_block_size=1: keep the exact size (the default pads to 16).
        with imageio.get_writer(path, fps=fps, codec="libx264", macro_block_size=1,
                                ffmpeg_log_level="error", output_params=["-pix_fmt", "yuv420p"]) as writer:
            for frame in frames:
                writer.append_data(frame)
        return Path(path).read_bytes()
    finally:
        os.unlink(path)


class WanVideoEncode(ModelFreeStage):
    """``frames`` -> ``video`` mp4 bytes."""

    def run(self, inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: StageContext) -> dict[str, Any]:
        return {"video": encode_mp4(self.array(inputs["frames"]), int(params.get("fps", 16)))}
