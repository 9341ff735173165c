"""What a request costs here, in seconds of stage work, from stage times measured on this deployment.

The spec's cost models are priors for the reference GPU; on another device, and
with another model, the shape is not the same: the tiny Stable Diffusion model on
one CPU thread takes 0.02 s a step at 64x64 and 1.3 s at 256x256 (64x the time
for 16x the pixels: attention is quadratic in them), while SD 1.5 on an H100
scales almost linearly over the same range. Admission that prices every request
like the ones its rate was measured on accepts a 512x512 50-step request (about
15 minutes here) on a 2-minute wait, and answers 504 when the wait is over.

So each TaskWorker keeps the (work units, steps, seconds) of its stage's runs
(:class:`Samples`): what its calibration measured at warm-up, one step at each
of a spread of sizes (engine.worker.calibrate), and its recent completed runs.
It fits a per-step time ``alpha + beta * u + gamma * u**2`` over them (attention
is quadratic in the tokens, convolutions linear: a stage whose cost model's
``growth`` is 1 fits no ``gamma``), by least squares on the relative error (a
small size counts as much as a large one: the price's ratio to the truth is
what admission lives with) with every coefficient kept non-negative, so the
fit never falls as the size grows. It publishes the fit with its instance
counters (:meth:`Fit.to_json`); the Proxy reads the fits of the instances it
routes to (:class:`Pricer`) and prices a request as the sum of its stages'
predicted seconds; the ETA (engine.proxy.eta) uses the same fits.

Past the largest size measured, a fit that the measurements determine (more
distinct sizes than its degree) extrapolates with its polynomial: a first
request at a size nothing has run yet is priced from the measured curve. One
that they do not (a single size, or a line where the stage may be quadratic:
calibration off, nothing else run yet) extrapolates by the fastest growth the
stage's architecture allows (the cost model's ``growth``) from the largest
point measured, so a request larger than anything measured is priced high,
never low. A stage with no measured runs is priced by its prior (GPU-seconds
on the reference device): the price is then a lower bound, and admission
treats it as before.

Pure: fed samples, no I/O; the worker and the Proxy do the reading and writing.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_SAMPLES = 64  # a worker's recent runs that its fit is made of (its calibration's points besides)


@dataclass(frozen=True)
class Fit:
    """Per-step seconds ``alpha + beta * u + gamma * u**2``, measured up to ``u = u_max``, from ``n`` samples at
    ``sizes`` distinct sizes; ``degree``: the highest power fitted (1 or 2). A run's time besides its steps is
    folded into them (the fit is of seconds per step)."""

    alpha: float
    beta: float
    u_max: float
    n: int
    gamma: float = 0.0
    sizes: int = 0
    degree: int = 1

    @property
    def determined(self) -> bool:
        """Whether the measurements pin the polynomial down (more distinct sizes than its degree)."""
        return self.sizes > self.degree

    def poly(self, u: float) -> float:
        return self.alpha + self.beta * u + self.gamma * u * u

    def per_step(self, u: float, growth: float) -> float:
        if u <= self.u_max or self.u_max <= 0 or self.determined:
            return self.poly(u)
        # past what was measured, on a curve not determined: the fastest growth from the largest point measured
        return self.poly(self.u_max) * (u / self.u_max) ** growth

    def predict(self, u: float, steps: float, growth: float) -> float:
        return max(1.0, steps) * self.per_step(u, growth)

    def to_json(self) -> str:
        return json.dumps({"alpha": self.alpha, "beta": self.beta, "gamma": self.gamma, "u_max": self.u_max,
                           "n": self.n, "sizes": self.sizes, "degree": self.degree})

    @staticmethod
    def from_json(raw: str | bytes | None) -> Fit | None:
        """The fit an instance published (one without ``gamma``/``sizes``, from an older worker, extrapolates
        by growth as it did); None for anything malformed."""
        if not raw:
            return None
        try:
            d = json.loads(raw)
            fit = Fit(float(d["alpha"]), float(d["beta"]), float(d["u_max"]), int(d["n"]), float(d.get("gamma", 0.0)),
                      int(d.get("sizes", 0)), int(d.get("degree", 1)))
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        ok = all(x >= 0 and x == x and x != float("inf") for x in (fit.alpha, fit.beta, fit.gamma, fit.u_max))
        return fit if ok and fit.n > 0 and fit.degree in (1, 2) else None


# the polynomial's terms (powers of u) tried, in order of preference: an equally good fit with fewer or lower
# terms wins (one size: proportional through it; two: the line through them)
_TERMS = {1: ((1,), (0,), (0, 1)), 2: ((1,), (0,), (0, 1), (2,), (0, 2), (1, 2), (0, 1, 2))}


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``a x = b`` by Gaussian elimination with partial pivoting; None when ``a`` is (nearly) singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    scale = max(abs(a[i][i]) for i in range(n)) or 1.0
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) <= 1e-12 * scale:
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


def _weighted_lsq(xs: Sequence[float], ps: Sequence[float], ws: Sequence[float],
                  terms: tuple[int, ...]) -> tuple[list[float], float] | None:
    """(coefficients of ``terms``, weighted squared error) of the least-squares fit; None when singular."""
    rows = [[x ** k for k in terms] for x in xs]
    k = len(terms)
    ata = [[sum(w * r[i] * r[j] for r, w in zip(rows, ws, strict=True)) for j in range(k)] for i in range(k)]
    atb = [sum(w * r[i] * p for r, p, w in zip(rows, ps, ws, strict=True)) for i in range(k)]
    coef = _solve(ata, atb)
    if coef is None:
        return None
    sse = sum(w * (sum(c * v for c, v in zip(coef, r, strict=True)) - p) ** 2
              for r, p, w in zip(rows, ps, ws, strict=True))
    return coef, sse


def fit(samples: list[tuple[float, float, float]], degree: int = 2) -> Fit | None:
    """The per-step fit of ``(units, steps, seconds)`` samples: least squares of the relative error of the seconds
    per step, over the polynomials in the units up to ``degree`` with non-negative coefficients (every subset of
    terms, the best feasible one: exact non-negative least squares for three terms)."""
    pts = [(u, s / max(1.0, n)) for u, n, s in samples if s >= 0 and u >= 0]
    if not pts:
        return None
    u_max = max(u for u, _ in pts)
    sizes = len({round(u / u_max, 9) for u, _ in pts}) if u_max > 0 else 1
    ws = [1.0 / max(p, 1e-9) ** 2 for _, p in pts]
    if u_max <= 0:  # no size to grow with (a text encoder): a constant
        mean = sum(w * p for (_, p), w in zip(pts, ws, strict=True)) / sum(ws)
        return Fit(mean, 0.0, 0.0, len(pts), 0.0, sizes, degree)
    xs, ps = [u / u_max for u, _ in pts], [p for _, p in pts]
    best: tuple[tuple[int, ...], list[float], float] | None = None
    tol = 1e-12 * len(pts)
    for terms in _TERMS[2 if degree >= 2 else 1]:
        got = _weighted_lsq(xs, ps, ws, terms)
        if got is None or min(got[0]) < 0:
            continue
        if best is None or got[1] < best[2] - tol:
            best = (terms, got[0], got[1])
    assert best is not None  # a single term on positive sizes is never singular, and its coefficient >= 0
    coef = dict(zip(best[0], best[1], strict=True))
    return Fit(coef.get(0, 0.0), coef.get(1, 0.0) / u_max, u_max, len(pts), coef.get(2, 0.0) / u_max ** 2, sizes,
               2 if degree >= 2 else 1)


class Samples:
    """A stage's measurements for one workflow, and their fit (what its worker publishes): the calibration's
    points (the latest at each size, kept) and the recent completed runs. ``degree``: 2 for a stage whose time
    can grow with the square of its units (its cost model's ``growth``), else 1."""

    def __init__(self, maxlen: int = MAX_SAMPLES, degree: int = 2) -> None:
        self.runs: deque[tuple[float, float, float]] = deque(maxlen=maxlen)
        self.calibration: dict[float, tuple[float, float, float]] = {}
        self.degree = degree

    def add(self, units: float, steps: float, seconds: float) -> Fit | None:
        """A completed run."""
        self.runs.append((float(units), float(steps), float(seconds)))
        return self.fit()

    def calibrated(self, units: float, steps: float, seconds: float) -> Fit | None:
        """A calibration measurement (it replaces an earlier one at the same size)."""
        self.calibration[float(units)] = (float(units), float(steps), float(seconds))
        return self.fit()

    def fit(self) -> Fit | None:
        return fit([*self.calibration.values(), *self.runs], self.degree)


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
