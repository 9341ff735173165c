"""Per-device utilisation, memory and temperature: NVML where it works, else CPU figures.

Where NVML is missing (no driver library: ``NVMLError_LibraryNotFound``) or
present without a driver (``NVMLError_DriverNotLoaded``), the sampler falls back
to the host's CPU and memory through psutil and says so in every sample's
``source``, so a dashboard never shows CPU load as if it were a GPU.
"""

from __future__ import annotations

import os
import threading
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class DeviceSample:
    kind: str  # "gpu" | "cpu"
    index: int
    name: str
    utilisation: float  # percent, 0-100
    memory_used: int  # bytes
    memory_total: int  # bytes
    temperature_c: float | None
    source: str  # "nvml", or "cpu (no NVML: <reason>)"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class DeviceSampler:
    """Samples every device on this host. Thread-safe; NVML is initialised once, lazily."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._nvml: Any = None
        self._why_not: str | None = None

    def _init(self) -> None:
        if self._nvml is not None or self._why_not is not None:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
        except ImportError:
            self._why_not = "nvidia-ml-py not installed"
        except Exception as exc:
            self._why_not = type(exc).__name__

    @property
    def fallback_reason(self) -> str | None:
        with self._lock:
            self._init()
            return self._why_not

    def sample(self) -> list[DeviceSample]:
        with self._lock:
            self._init()
            if self._nvml is not None:
                return self._sample_nvml()
        return self._sample_cpu()

    def _sample_nvml(self) -> list[DeviceSample]:
        nv = self._nvml
        out = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            util = nv.nvmlDeviceGetUtilizationRates(h)
            mem = nv.nvmlDeviceGetMemoryInfo(h)
            try:
                temp = float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
            except Exception:
                temp = None
            name = nv.nvmlDeviceGetName(h)
            out.append(DeviceSample("gpu", i, name if isinstance(name, str) else name.decode(), float(util.gpu),
                                    int(mem.used), int(mem.total), temp, "nvml"))
        return out

    def _sample_cpu(self) -> list[DeviceSample]:
        import psutil

        vm = psutil.virtual_memory()
        temp = None
        try:
            temps = psutil.sensors_temperatures()
            first = next(iter(temps.values()), [])
            temp = float(first[0].current) if first else None
        except (AttributeError, OSError):
            pass
        return [DeviceSample("cpu", 0, f"{os.cpu_count()} CPU cores", float(psutil.cpu_percent(interval=None)),
                             int(vm.total - vm.available), int(vm.total), temp,
                             f"cpu (no NVML: {self._why_not})")]


def process_sample(pid: int | None = None) -> dict[str, float]:
    """CPU percent and resident memory of one process (a worker), for per-instance utilisation."""
    import psutil

    p = psutil.Process(pid)
    with p.oneshot():
        return {"cpu_percent": p.cpu_percent(interval=None), "rss_bytes": float(p.memory_info().rss)}
