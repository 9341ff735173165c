"""wan2.1-i2v video_encode: uint8 frames -> fragmented mp4 (H.264) bytes, on the CPU, streamed as they come.

The mp4 is fragmented (``empty_moov``: the init segment first, then one ``moof``+``mdat`` per frame) so that
it can be published while the decoder is still running (engine.worker.chunks) and played as it arrives
(Media Source Extensions, ffmpeg). The encoder runs without lookahead or B-frames (x264's ``zerolatency``)
and on one thread: its output depends only on the frames, never on how they were chunked or on the host,
so the streamed fragments concatenated are byte for byte the result :func:`encode_mp4` gives for the whole
clip (the reference the bit-identity tests use).
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping
from typing import Any

from engine.stages.base import ModelFreeStage, StageContext

# frag_every_frame: a fragment is complete as soon as the next frame's packet arrives, so a chunk's frames
# are published with its chunk (all but the last frame, which goes out with the next chunk or the end);
# skip_trailer: no mfra index at the end, which a stream reader has no use for.
MOVFLAGS = "empty_moov+default_base_moof+frag_every_frame+skip_trailer"
X264 = {"tune": "zerolatency", "preset": "medium", "crf": "23"}


class _Sink(io.RawIOBase):
    """The muxer's output: bytes as it writes them (it never seeks with these flags)."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        self.buf += b
        return len(b)


def split_boxes(buf: bytearray) -> tuple[list[bytes], int]:
    """The complete top-level boxes at the start of ``buf`` grouped into playable pieces (``ftyp``+``moov``:
    the init segment; ``moof``+``mdat``: a fragment), and how many bytes they took; an incomplete group stays."""
    pieces: list[bytes] = []
    start = off = 0
    while off + 8 <= len(buf):
        size, kind = int.from_bytes(buf[off:off + 4], "big"), bytes(buf[off + 4:off + 8])
        if size < 8 or off + size > len(buf):
            break
        off += size
        if kind in (b"moov", b"mdat"):  # the end of a group
            pieces.append(bytes(buf[start:off]))
            start = off
    return pieces, start


class Mp4Stream:
    """An H.264 fragmented-mp4 encoder fed frames in chunks; :meth:`feed` and :meth:`close` return the
    pieces (init segment, fragments) completed meanwhile, in order."""

    def __init__(self, fps: int) -> None:
        self.fps = int(fps)
        self._sink = _Sink()
        self._out: Any = None
        self._stream: Any = None
        self._pts = 0
        self.size = 0  # bytes returned so far

    def _open(self, height: int, width: int) -> None:
        import av

        self._out = av.open(self._sink, mode="w", format="mp4", options={"movflags": MOVFLAGS})
        s = self._out.add_stream("libx264", rate=self.fps, options=dict(X264))
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        s.codec_context.thread_count = 1  # x264's output depends on its threads: one, everywhere
        self._stream = s

    def feed(self, frames: Iterable[Any]) -> list[bytes]:
        """Encode (H, W, 3) uint8 frames; the pieces this completed."""
        import av

        for frame in frames:
            if self._out is None:
                self._open(frame.shape[0], frame.shape[1])
            vf = av.VideoFrame.from_ndarray(frame, format="rgb24")
            vf.pts = self._pts
            self._pts += 1
            for packet in self._stream.encode(vf):
                self._out.mux(packet)
        return self._take()

    def close(self) -> list[bytes]:
        """Flush the encoder and end the file; the last pieces."""
        if self._out is None:
            raise ValueError("an mp4 needs at least one frame")
        for packet in self._stream.encode():
            self._out.mux(packet)
        self._out.close()
        pieces = self._take()
        if self._sink.buf:
            raise RuntimeError(f"the muxer left {len(self._sink.buf)} bytes outside a complete box")
        return pieces

    def _take(self) -> list[bytes]:
        pieces, used = split_boxes(self._sink.buf)
        del self._sink.buf[:used]
        self.size += used
        return pieces


def encode_mp4(frames: Any, fps: int) -> bytes:
    """(F, H, W, 3) uint8 array -> the fragmented mp4 a stream of the same frames gives, in one call."""
    stream = Mp4Stream(fps)
    return b"".join([*stream.feed(frames), *stream.close()])


class VideoChunks:
    """One request's chunked input (engine.worker.chunks): frames in, mp4 pieces out, the video at the end."""

    def __init__(self, stage: WanVideoEncode, fps: int) -> None:
        self.stage = stage
        self.mp4 = Mp4Stream(fps)
        self.pieces: list[bytes] = []

    def feed(self, inputs: Mapping[str, Any]) -> list[bytes]:
        got = self.mp4.feed(self.stage.array(inputs["frames"]))
        self.pieces += got
        return got

    def finish(self) -> tuple[list[bytes], dict[str, Any]]:
        """(the last pieces, the stage's outputs: the whole video, the pieces concatenated)."""
        last = self.mp4.close()
        self.pieces += last
        return last, {"video": b"".join(self.pieces)}


class WanVideoEncode(ModelFreeStage):
    """``frames`` -> ``video`` mp4 bytes; takes its frames in chunks too (:meth:`open_chunks`)."""

    def run(self, inputs: Mapping[str, Any], params: Mapping[str, Any], ctx: StageContext) -> dict[str, Any]:
        return {"video": encode_mp4(self.array(inputs["frames"]), int(params.get("fps", 16)))}

    def open_chunks(self, params: Mapping[str, Any], ctx: StageContext) -> VideoChunks:
        """A request whose frames arrive in chunks: feed each, then finish."""
        return VideoChunks(self, int(params.get("fps", 16)))
