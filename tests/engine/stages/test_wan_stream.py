"""Wan's streamed decode on the tiny model: the VAE's chunks (1 frame, then 4 per latent frame) are byte for
byte the one-call decode, and the mp4 stage fed those chunks writes, piece by piece, exactly the file
:func:`encode_mp4` makes of the whole clip (the one-call reference), a valid fragmented mp4 of every frame."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytestmark = [pytest.mark.models]


def test_chunked_decode_and_fragmented_mp4_equal_the_one_call_results(tiny_models: dict[str, Path]) -> None:
    import av
    import torch

    from engine.stages.base import StageContext
    from engine.stages.components import to_uint8
    from engine.stages.wan.decoders import WanVaeDecode
    from engine.stages.wan.video import WanVideoEncode, encode_mp4

    torch.set_num_threads(1)
    decode = WanVaeDecode()
    decode.load(tiny_models["wan2.1-t2v"])
    vae = decode.pipe.vae
    z = torch.randn(1, vae.config.z_dim, 5, 4, 6, generator=torch.Generator().manual_seed(0))
    steps: list[tuple[int, int]] = []
    chunks = [c["frames"].numpy().copy() for c in
              decode.run_chunks({"denoised": z}, {}, StageContext(progress=lambda s, n: steps.append((s, n))))]
    assert [len(c) for c in chunks] == [1, 4, 4, 4, 4] and steps[-1] == (5, 5)
    with torch.no_grad():  # the pipeline's own decode of the same latents
        std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
        video = vae.decode(z * std + mean, return_dict=False)[0]
    reference = to_uint8(decode.pipe.video_processor.postprocess_video(video, output_type="np")[0])
    frames = np.concatenate(chunks)
    assert frames.std() > 1.0
    np.testing.assert_array_equal(frames, reference)

    encoder = WanVideoEncode()
    encoder.load("/")
    stream = encoder.open_chunks({"fps": 16}, StageContext())
    pieces: list[Any] = [stream.feed({"frames": torch.from_numpy(c)}) for c in chunks]
    last, out = stream.finish()
    assert pieces[0][0][4:8] == b"ftyp" and len(pieces[0]) == 1  # the init segment before any frame is out
    assert all(p[4:8] == b"moof" for group in [*pieces[1:], last] for p in group)
    streamed = b"".join(b"".join(g) for g in [*pieces, last])
    assert streamed == out["video"] == encode_mp4(reference, 16)
    with av.open(io.BytesIO(streamed)) as c:
        decoded = [f.to_ndarray(format="rgb24") for f in c.decode(video=0)]
    assert len(decoded) == len(frames) and decoded[0].shape == frames[0].shape
