"""Telemetry without a GPU falls back to CPU figures and says so; with NVML it reports GPUs."""

from __future__ import annotations

import os

import pytest

from engine.telemetry.devices import DeviceSampler, process_sample


def _nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


@pytest.mark.skipif(_nvml_works(), reason="this host has a working NVML; the fallback does not apply")
def test_without_nvml_samples_are_cpu_and_labelled() -> None:
    s = DeviceSampler()
    assert s.fallback_reason in {"NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded", "nvidia-ml-py not installed"}
    (d,) = s.sample()
    assert d.kind == "cpu" and d.source.startswith("cpu (no NVML: ")
    assert 0 < d.memory_used <= d.memory_total
    assert 0.0 <= d.utilisation <= 100.0


@pytest.mark.skipif(not _nvml_works(), reason="no NVIDIA driver on this host")
def test_with_nvml_every_gpu_is_reported() -> None:
    samples = DeviceSampler().sample()
    assert samples and all(d.kind == "gpu" and d.source == "nvml" for d in samples)


def test_process_sample_reports_this_process() -> None:
    s = process_sample(os.getpid())
    assert s["rss_bytes"] > 10 << 20
