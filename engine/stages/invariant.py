"""Batch-invariant linears: a request's rows in a step-level batch get the bytes they get alone.

A batched step stacks each request's rows (a guided pair: 2) into one model call. Most of a UNet's
kernels give a row the same bytes whatever else is in the batch, but a linear over a 2-D input (the
time embedding and each resnet's time projection: one row per sample) does not on every CPU: MKL's sgemm
picks its kernel by the number of rows, and on AVX-512 (seen on an AMD EPYC, Zen 4) two rows and four
differ in the last bits, where the host of the earlier sessions (its CPU not recorded) gave
equal bytes up to 14 rows. So inside :func:`rows_per_request` a 2-D linear runs once per request's rows,
the call it gets alone, and its bytes cannot depend on the batch. The same for a SiLU over a 2-D input
(the modulation's ``Sequential(SiLU, Linear)`` of a timestep embedding): torch's vectorised loop takes
elements in chunks of twice the vector width and the tail one by one with another ``exp``, so where a
row's width is not a multiple of the chunk (the tiny Qwen-Image's 48 on AVX-512: 32 + 16) an element's
bytes depend on where its row starts. Linears over 3-D inputs (tokens x
channels) and convolutions of guided pairs measured equal (``benchmarks/batch_equality.py``); the batch
tests check the whole model's bytes on the host they run on.

:func:`install` replaces ``torch.nn.Linear.forward`` and ``torch.nn.SiLU.forward`` once per process with
ones that read a thread-local
(outside a batched step, one attribute read more per call); PEFT's LoRA layers call ``nn.Linear``
modules, so an adapter's projections are chunked too.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_local = threading.local()
_installed = False
_lock = threading.Lock()


def install() -> None:
    """Make ``nn.Linear`` chunk 2-D inputs inside :func:`rows_per_request` (idempotent, any thread)."""
    global _installed
    with _lock:
        if _installed:
            return
        import torch
        import torch.nn.functional as F

        def forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
            rows = getattr(_local, "rows", 0)
            if rows and x.dim() == 2 and x.shape[0] > rows:
                return torch.cat([F.linear(part, self.weight, self.bias) for part in x.split(rows)])
            if getattr(_local, "samples", False) and x.dim() >= 3 and x.shape[0] > 1:
                return torch.cat([F.linear(part, self.weight, self.bias) for part in x.split(1)])
            return F.linear(x, self.weight, self.bias)

        def silu(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
            inplace = getattr(self, "inplace", False)
            rows = getattr(_local, "rows", 0)
            if rows and x.dim() == 2 and x.shape[0] > rows:
                return torch.cat([F.silu(part, inplace=inplace) for part in x.split(rows)])
            if getattr(_local, "samples", False) and x.dim() >= 3 and x.shape[0] > 1:
                return torch.cat([F.silu(part, inplace=inplace) for part in x.split(1)])
            return F.silu(x, inplace=inplace)

        forward.__doc__ = torch.nn.Linear.forward.__doc__
        silu.__doc__ = torch.nn.SiLU.forward.__doc__
        torch.nn.Linear.forward = forward  # type: ignore[method-assign]
        torch.nn.SiLU.forward = silu  # type: ignore[method-assign]
        def conv(original: Any) -> Any:
            def forward(self: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
                if getattr(_local, "samples", False) and x.shape[0] > 1:
                    return torch.cat([original(self, part) for part in x.split(1)])
                return original(self, x)

            forward.__doc__ = original.__doc__
            return forward

        torch.nn.Conv2d.forward = conv(torch.nn.Conv2d.forward)  # type: ignore[method-assign]
        torch.nn.Conv3d.forward = conv(torch.nn.Conv3d.forward)  # type: ignore[method-assign]
        try:  # transformers' own SiLU module (Qwen2's MLPs): F.silu as nn.SiLU, the same chunking
            from transformers.activations import SiLUActivation

            SiLUActivation.forward = silu  # type: ignore[method-assign]
        except ImportError:
            pass
        _installed = True


@contextmanager
def per_sample() -> Iterator[None]:
    """In this thread, a linear or a SiLU over a batch of sequences (3-D and up), and a 2-D or 3-D convolution
    over a batch, runs once per sample: a text encoder's batch of prompts of one length, the Wan
    transformer's rows (its patch embedding, a Conv3d, gave another last bit at batch 2). Measured on Qwen2.5-VL: its MLP's SiLU over (2, 177, 16)
    differs in the last bit from the same sample alone (the vectorised loop's tail of a lone sample is the
    batch's middle), and a linear's kernel is chosen by the row count."""
    install()
    before = getattr(_local, "samples", False)
    _local.samples = True
    try:
        yield
    finally:
        _local.samples = before


@contextmanager
def rows_per_request(rows: int) -> Iterator[None]:
    """In this thread, a 2-D linear's input is ``rows`` rows per request: each request's are run alone."""
    if rows:  # a solo call (0) needs the plain forward only
        install()
    before = getattr(_local, "rows", 0)
    _local.rows = int(rows)
    try:
        yield
    finally:
        _local.rows = before

