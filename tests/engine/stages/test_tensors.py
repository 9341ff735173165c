"""Torch tensors through the Workflow Message: dtypes kept, payloads wrapped without a copy."""

from __future__ import annotations

import pytest
import torch

from engine.stages.components import from_torch, to_torch
from engine.workflow import message as wm

HEADER = wm.Header(uid="ab" * 16, workflow="sd-t2i", stage="denoise", route=["denoise"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int64])
def test_round_trip_keeps_dtype_shape_and_values(dtype: torch.dtype) -> None:
    t = (torch.arange(60) % 17).to(dtype).view(3, 4, 5)
    msg = wm.decode(wm.encode(HEADER, {"x": from_torch(t)}))
    back = to_torch(msg.tensors["x"])
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back, t)


def test_wrapped_tensor_aliases_the_message_buffer() -> None:
    buf = bytearray(wm.encode(HEADER, {"x": from_torch(torch.zeros(4, dtype=torch.float32))}))
    entry = wm.decode(buf).tensors["x"]
    assert entry.data.obj is buf  # a view, not a copy
    wrapped = to_torch(entry)
    start = len(buf) - 16  # the only payload ends the message
    buf[start:start + 4] = torch.tensor([1.5]).numpy().tobytes()
    assert wrapped[0].item() == 1.5


def test_non_contiguous_tensors_are_encoded_in_logical_order() -> None:
    t = torch.arange(6, dtype=torch.float32).view(2, 3).t()
    back = to_torch(wm.decode(wm.encode(HEADER, {"x": from_torch(t)})).tensors["x"])
    assert torch.equal(back, t)
