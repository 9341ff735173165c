"""CPU thread budgets for stage instances (torch-free; the TaskManager decides, the worker applies).

Why: torch, OpenMP, MKL and OpenBLAS each default to one thread per core. Ten
stage workers on a two-core host then run twenty busy threads, and OpenMP's
barrier at every parallel region waits for the slowest of them: measured here,
the one-call tiny SD pipeline took 4.7 s with 2 threads and 0.68 s with 1 when
another process kept one core busy (7x). Ray gives its workers
``OMP_NUM_THREADS=1`` for the same reason. So every instance gets an explicit
budget, and nothing in a worker may take more.

The budget (``budget_for``):

- an explicit ``--threads-per-instance N`` / ``ONEPIECE_THREADS_PER_INSTANCE=N``
  wins; then an ``OMP_NUM_THREADS`` the node itself was started with (an
  operator's choice, kept for every instance);
- ``auto`` on a CUDA device: 1 thread (the GPU does the work; the CPU thread
  launches kernels and copies), 2 when the host has at least 4 cores per
  instance (tokenisation and video encoding keep a second one busy);
- ``auto`` on the CPU: the host's usable cores (its CPU affinity and cgroup
  quota, not ``os.cpu_count()``) shared evenly among the instances placed on
  the node, at least 1.

``apply_env`` sets the variables every threaded library reads when it loads
(so it must happen before the worker imports torch: the TaskManager puts them
in the child's environment), and ``apply_torch`` sets torch's intra-op and
inter-op pools once torch is imported. Inter-op is 1: eager inference never
runs graph branches in parallel, and every inter-op thread would bring an
intra-op pool of its own.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from engine import envs

# Every threaded runtime a stage worker may load, and the variable each reads at load time.
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "BLIS_NUM_THREADS", "RAYON_NUM_THREADS")
BUDGET_VAR = "ONEPIECE_THREAD_BUDGET"  # what the worker reads back to size torch's pools


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota (containers)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.floor(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cores)


def parse_threads(value: str | int | None) -> int | None:
    """``"auto"`` / None -> None (decide per node); a positive integer -> itself; ValueError otherwise."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "auto")):
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"threads per instance must be a positive integer or 'auto', got {value!r}") from None
    if n < 1:
        raise ValueError(f"threads per instance must be a positive integer or 'auto', got {value!r}")
    return n


def inherited() -> int | None:
    """The ``OMP_NUM_THREADS`` this process was started with, when it is a positive integer."""
    try:
        n = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return None
    return n if n > 0 else None


def is_cuda(device: str | None, default: str = "auto") -> bool:
    """Whether an instance with this device setting runs on a GPU (decided without importing torch)."""
    d = (device or default or "auto").lower()
    if d.startswith("cuda"):
        return True
    if d == "auto":
        return Path("/dev/nvidiactl").exists()
    return False


def budget_for(instances: int, cuda: bool, explicit: int | None = None, cores: int | None = None) -> int:
    """CPU threads for one instance among ``instances`` on this node (see the module docstring)."""
    if explicit is not None:
        return explicit
    cores = usable_cores() if cores is None else cores
    share = max(1, cores // max(1, instances))
    if cuda:
        return 2 if share >= 4 else 1
    return share


def apply_env(env: dict[str, str], threads: int) -> dict[str, str]:
    """Put the budget into a child's environment (before it loads any threaded library)."""
    for name in THREAD_VARS:
        env[name] = str(threads)
    env[BUDGET_VAR] = str(threads)
    # threads that wait at a barrier sleep instead of spinning: a spinning waiter takes the core a
    # neighbour (another stage, or another tenant's process) needs
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["TOKENIZERS_PARALLELISM"] = "false"
    return env


def apply_torch(threads: int | None = None) -> int:
    """Size torch's pools to the budget (call after importing torch, before the first op). Returns it."""
    import torch

    n = threads if threads is not None else int(envs.THREAD_BUDGET or 0)
    if n < 1:
        return torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or parallel work already ran in this process
        pass
    return n
