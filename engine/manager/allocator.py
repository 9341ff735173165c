"""How many instances each stage needs: Theorem 1, generalised to chains and graphs.

Theorem 1 (PAPER.md): if stage X has K workers with per-request time T_X and
stage Y has T_Y > T_X, Y needs M = ceil(K * T_Y / T_X) instances for both to
sustain K / T_X requests per second. In general, an instance of stage s serves
1 / T_s requests per second, so a workflow sustains

    throughput(n) = min over stages s of  n_s / T_s

(for a graph, every stage sees every request once, so the same formula holds:
parallel branches such as Wan's text and image encoders each need their own
n_s / T_s >= rate). Two questions follow, both answered here:

- **for a rate**: the fewest instances that sustain ``rate`` at a target
  utilisation: n_s = max(min_s, ceil(rate * T_s / utilisation));
- **for a budget**: the allocation of ``budget`` instances that maximises
  throughput: water-filling, one instance at a time to the stage with the lowest
  n_s / T_s. Greedy is optimal for this max-min objective with per-stage caps
  (each step raises the minimum as much as any single addition can), and the
  tests check it against exhaustive search.

Memory constraints (which models fit on one device) are expressed as per-stage
``max_instances``; the caller derives them from device memory and model sizes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field


class AllocationError(ValueError):
    """The request cannot be met: budget below the per-stage minimums, or a rate above the caps."""


@dataclass(frozen=True)
class StageProfile:
    name: str
    seconds: float  # measured service time per request on one instance (moving average)
    min_instances: int = 1
    max_instances: int | None = None

    def __post_init__(self) -> None:
        if self.seconds <= 0:
            raise ValueError(f"stage {self.name!r}: service time must be positive, got {self.seconds}")
        if self.min_instances < 0 or (self.max_instances is not None and self.max_instances < self.min_instances):
            raise ValueError(f"stage {self.name!r}: bad bounds {self.min_instances}..{self.max_instances}")


@dataclass
class Allocation:
    instances: dict[str, int]
    throughput: float  # requests per second the allocation sustains
    bottleneck: str
    idle: int = 0  # budget left unassigned (the idle pool)
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.instances.values())


def throughput(stages: list[StageProfile], instances: Mapping[str, int]) -> tuple[float, str]:
    """(requests/s, bottleneck stage) of an allocation."""
    rates = {s.name: instances.get(s.name, 0) / s.seconds for s in stages}
    bottleneck = min(rates, key=lambda k: rates[k])
    return rates[bottleneck], bottleneck


def theorem1(k: int, t_x: float, t_y: float) -> int:
    """The paper's two-stage rule: instances of Y that keep up with ``k`` instances of X."""
    return math.ceil(k * t_y / t_x - 1e-9)


def for_rate(stages: list[StageProfile], rate: float, utilisation: float = 1.0) -> Allocation:
    """The fewest instances per stage that sustain ``rate`` requests/s at ``utilisation``."""
    if rate < 0 or not 0 < utilisation <= 1:
        raise AllocationError(f"rate must be >= 0 and utilisation in (0, 1]; got {rate}, {utilisation}")
    out: dict[str, int] = {}
    notes = []
    for s in stages:
        need = max(s.min_instances, math.ceil(rate * s.seconds / utilisation - 1e-9))
        if s.max_instances is not None and need > s.max_instances:
            notes.append(f"{s.name}: needs {need}, capped at {s.max_instances}")
            need = s.max_instances
        out[s.name] = need
    tp, bottleneck = throughput(stages, out)
    return Allocation(out, tp, bottleneck, notes=notes)


def for_budget(stages: list[StageProfile], budget: int) -> Allocation:
    """The allocation of at most ``budget`` instances with the highest throughput."""
    base = {s.name: s.min_instances for s in stages}
    if sum(base.values()) > budget:
        raise AllocationError(f"budget {budget} is below the per-stage minimums ({sum(base.values())})")
    n = dict(base)
    left = budget - sum(n.values())
    caps = {s.name: s.max_instances for s in stages}
    seconds = {s.name: s.seconds for s in stages}
    while left > 0:
        open_ = [k for k in n if caps[k] is None or n[k] < caps[k]]  # type: ignore[operator]
        if not open_:
            break
        # the stage whose rate is lowest gets the next instance (ties: the slower stage)
        k = min(open_, key=lambda s: (n[s] / seconds[s], -seconds[s]))
        n[k] += 1
        left -= 1
    tp, bottleneck = throughput(stages, n)
    # instances beyond what the bottleneck can use are better off idle (ready to move)
    trimmed = {s.name: max(s.min_instances, min(n[s.name], math.ceil(tp * s.seconds - 1e-9))) for s in stages}
    idle = budget - sum(trimmed.values())
    return Allocation(trimmed, tp, bottleneck, idle=idle)
