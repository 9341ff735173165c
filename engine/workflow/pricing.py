"""What a request costs here, in seconds of stage work, from stage times measured on this deployment.

The spec's cost models are priors for the reference GPU; on another device, and
with another model, the shape is not the same: the tiny Stable Diffusion model on
one CPU thread takes 0.02 s a step at 64x64 and 1.3 s at 256x256 (64x the time
for 16x the pixels: attention is quadratic in them), while SD 1.5 on an H100
scales almost linearly over the same range. Admission that prices every request
like the ones its rate was measured on accepts a 512x512 50-step request (about
15 minutes here) on a 2-minute wait, and answers 504 when the wait is over.

So each TaskWorker keeps the (work units, steps, seconds) of its recent runs
(:class:`Samples`), fits a per-step time ``alpha + beta * units`` over them and
publishes the fit with its instance counters (:meth:`Fit.to_json`); the Proxy
reads the fits of the instances it routes to (:class:`Pricer`) and prices a
request as the sum of its stages' predicted seconds. Within the sizes a stage
has run, the fit interpolates; beyond the largest it has seen, it extrapolates
by the fastest growth the stage's architecture allows (the cost model's
``growth``: 2 for stages with attention over the latent tokens, 1 otherwise),
so a request larger than anything measured is priced high, never low. A stage
with no measured runs is priced by its prior (GPU-seconds on the reference
device): the price is then a lower bound, and admission treats it as before.

Pure: fed samples, no I/O; the worker and the Proxy do the reading and writing.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_SAMPLES = 64  # a worker's recent runs that its fit is made of


@dataclass(frozen=True)
class Fit:
    """Per-step seconds ``alpha + beta * u`` for ``u`` up to ``u_max`` (the largest run seen); ``n`` runs
    behind it. A run's time besides its steps is folded into them (the fit is of seconds per step)."""

    alpha: float
    beta: float
    u_max: float
    n: int

    def per_step(self, u: float, growth: float) -> float:
        if u <= self.u_max or self.u_max <= 0:
            return self.alpha + self.beta * u
        # past what was measured: the stage's fastest possible growth from the largest point measured
        return (self.alpha + self.beta * self.u_max) * (u / self.u_max) ** growth

    def predict(self, u: float, steps: float, growth: float) -> float:
        return max(1.0, steps) * self.per_step(u, growth)

    def to_json(self) -> str:
        return json.dumps({"alpha": self.alpha, "beta": self.beta, "u_max": self.u_max, "n": self.n})

    @staticmethod
    def from_json(raw: str | bytes | None) -> Fit | None:
        if not raw:
            return None
        try:
            d = json.loads(raw)
            fit = Fit(float(d["alpha"]), float(d["beta"]), float(d["u_max"]), int(d["n"]))
        except (ValueError, KeyError, TypeError):
            return None
        ok = all(x >= 0 and x == x and x != float("inf") for x in (fit.alpha, fit.beta, fit.u_max))
        return fit if ok and fit.n > 0 else None


def fit(samples: list[tuple[float, float, float]]) -> Fit | None:
    """The per-step fit of ``(units, steps, seconds)`` runs: least squares of seconds per step on units,
    with both coefficients kept non-negative; one distinct size gives a proportional fit through it."""
    if not samples:
        return None
    pts = [(u, s / max(1.0, n)) for u, n, s in samples if s >= 0 and u >= 0]
    if not pts:
        return None
    u_max = max(u for u, _ in pts)
    mu = sum(u for u, _ in pts) / len(pts)
    mp = sum(p for _, p in pts) / len(pts)
    var = sum((u - mu) ** 2 for u, _ in pts)
    if var <= 1e-12 * max(1.0, mu * mu):  # one size: all of it proportional to the units (or fixed, at u = 0)
        return Fit(0.0 if mu > 0 else mp, mp / mu if mu > 0 else 0.0, u_max, len(pts))
    beta = sum((u - mu) * (p - mp) for u, p in pts) / var
    alpha = mp - beta * mu
    if beta < 0:  # noise across similar sizes: no growth measured, a flat cost
        alpha, beta = mp, 0.0
    elif alpha < 0:  # the line crosses zero before u = 0: proportional instead
        alpha, beta = 0.0, sum(u * p for u, p in pts) / sum(u * u for u, _ in pts)
    return Fit(alpha, beta, u_max, len(pts))


class Samples:
    """A worker's recent runs of its stage, and their fit (what it publishes)."""

    def __init__(self, maxlen: int = MAX_SAMPLES) -> None:
        self.runs: deque[tuple[float, float, float]] = deque(maxlen=maxlen)

    def add(self, units: float, steps: float, seconds: float) -> Fit | None:
        self.runs.append((float(units), float(steps), float(seconds)))
        return fit(list(self.runs))


class Pricer:
    """The Proxy's view of every stage's fit: ``update`` with what the instances published, ``price`` a
    request. Stages of one workflow with several instances take the fit with the most runs behind it."""

    def __init__(self) -> None:
        self.fits: dict[tuple[str, str], Fit] = {}

    def update(self, published: Mapping[tuple[str, str], list[Fit]]) -> None:
        self.fits = {k: max(fs, key=lambda f: f.n) for k, fs in published.items() if fs}

    def price(self, spec: Any, params: Mapping[str, Any]) -> float | None:
        """Seconds of stage work of one request with these resolved parameters: measured stages by their
        fits, the rest by their priors; None when no stage of the workflow has a fit yet."""
        dims = spec.dims(params)
        prior = spec.estimate_cost(params)
        total, measured = 0.0, False
        for stage in spec.route():
            f = self.fits.get((spec.name, stage))
            model = spec.costs.get(stage)
            if f is None or model is None:
                total += prior.get(stage, 0.0)
                continue
            measured = True
            total += f.predict(model.units(dims), model.steps(dims), model.growth)
        return total if measured else None
