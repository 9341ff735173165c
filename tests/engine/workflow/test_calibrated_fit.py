"""The per-step fit ``alpha + beta*u + gamma*u**2`` (engine.workflow.pricing) on synthetic calibration samples:
a first request past the sizes measured is priced from the measured curve, not by the worst-case growth."""

from __future__ import annotations

import json

import pytest

from engine.workflow import get_workflow
from engine.workflow.pricing import Fit, Pricer, Samples, fit

DEFAULT = 64 * 64  # the tiny SD model's default size (pixels)


def tiny_sd_step(u: float) -> float:
    """A step of the tiny SD model on one CPU thread as measured (engine/workflow/pricing.py's docstring):
    0.02 s at 64x64, 1.3 s at 256x256: a fixed part, a linear part and attention's quadratic one."""
    return 0.004 + 2.0e-6 * u + 2.8e-10 * u * u


def _calibration(step: object, sides: list[int]) -> list[tuple[float, float, float]]:
    return [(float(s * s), 1.0, step(s * s)) for s in sides]  # type: ignore[operator]


def test_a_size_past_the_measured_ones_is_priced_from_the_measured_curve() -> None:
    # calibration: one step at 1/4..4x of the default pixel count (64 is the floor here)
    f = fit(_calibration(tiny_sd_step, [64, 96, 128, 176, 256]))
    assert f is not None and f.determined and f.sizes == 5 and f.degree == 2 and f.u_max == 256 * 256
    for side, steps in ((64, 50), (128, 50), (256, 50), (384, 50), (512, 50), (768, 20)):
        u = side * side
        assert f.predict(u, steps, 2.0) == pytest.approx(steps * tiny_sd_step(u), rel=0.02), side


def h100_sd15_step(u: float) -> float:
    """SD 1.5 on an H100 scales almost linearly over the sizes it serves (pricing.py's docstring)."""
    return 0.012 + 1.0e-7 * u + 2.0e-14 * u * u


def test_a_nearly_linear_stage_is_not_priced_by_its_worst_case_past_the_default() -> None:
    """Measured up to its default (512x512), a first 1024x1024 request is priced from the curve: about 3.5x the
    default's step; the worst-case growth from the largest point (the former rule) said 16x."""
    f = fit(_calibration(h100_sd15_step, [256, 368, 512]))
    assert f is not None and f.determined
    u = 1024 * 1024
    assert f.predict(u, 30, 2.0) == pytest.approx(30 * h100_sd15_step(u), rel=0.05)
    assert f.predict(u, 1, 2.0) < 0.4 * h100_sd15_step(512 * 512) * (u / (512 * 512)) ** 2


def test_small_sizes_count_as_much_as_large_ones() -> None:
    """Least squares on the relative error: the 64x64 step (0.02 s) is priced as well as the 256x256 one
    (1.3 s), though a plain least squares would trade its whole size away for a millisecond at 256."""
    samples = _calibration(tiny_sd_step, [64, 96, 128, 176, 256])
    noisy = [(u, n, s * (1.08 if i % 2 else 0.93)) for i, (u, n, s) in enumerate(samples)]  # +-8% noise
    f = fit(noisy)
    assert f is not None
    for u, _, s in samples:
        assert f.per_step(u, 2.0) == pytest.approx(s, rel=0.15)


def test_coefficients_stay_non_negative_and_a_linear_stage_fits_no_square() -> None:
    concave = [(float(u), 1.0, 0.1 * u ** 0.5) for u in (100, 400, 1600, 6400)]  # grows slower than a line
    f = fit(concave)
    assert f is not None and min(f.alpha, f.beta, f.gamma) >= 0
    assert f.per_step(6400, 2.0) > f.per_step(1600, 2.0) > f.per_step(100, 2.0)  # never falls with the size
    line = fit([(float(u), 2.0, 2 * (0.01 + 1e-5 * u)) for u in (1000, 2000, 4000)], degree=1)
    assert line is not None and line.gamma == 0 and line.degree == 1 and line.determined
    assert line.predict(16000, 1, 1.0) == pytest.approx(0.01 + 1e-5 * 16000)  # the line, past the sizes run


def test_a_curve_the_samples_do_not_determine_still_extrapolates_by_growth() -> None:
    """One size (calibration off, nothing else run): the price past it is the stage's worst case, as before."""
    one = fit([(1024.0, 3.0, 0.06)] * 5)
    assert one is not None and not one.determined and one.sizes == 1
    assert one.predict(1024, 3, 2.0) == pytest.approx(0.06)
    assert one.predict(4096, 1, 2.0) == pytest.approx(16 * 0.02)
    two = fit([(1000.0, 1.0, 0.02), (2000.0, 1.0, 0.03)])  # a line, where the stage may be quadratic
    assert two is not None and not two.determined and two.predict(8000, 1, 2.0) == pytest.approx(0.03 * 16)


def test_calibration_points_outlast_the_runs() -> None:
    """64 runs of one size fill the run window; the calibration's sizes stay, so a new size is still priced
    from the curve (and the runs move the fit at their own size)."""
    samples = Samples()
    for u, n, s in _calibration(tiny_sd_step, [64, 96, 128, 176, 256]):
        samples.calibrated(u, n, s)
    for _ in range(100):
        got = samples.add(DEFAULT, 20, 20 * tiny_sd_step(DEFAULT))
    assert got is not None and got.determined and got.n == 5 + 64
    assert got.predict(512 * 512, 10, 2.0) == pytest.approx(10 * tiny_sd_step(512 * 512), rel=0.05)


def test_published_fits_read_back_and_older_ones_keep_their_rule() -> None:
    f = fit(_calibration(tiny_sd_step, [64, 128, 256]))
    assert f is not None and Fit.from_json(f.to_json()) == f
    old = Fit.from_json(json.dumps({"alpha": 0.0, "beta": 1e-5, "u_max": 4096.0, "n": 3}))  # an older worker's
    assert old is not None and not old.determined and old.predict(8192, 1, 2.0) == pytest.approx(4 * 4096e-5)
    for bad in ('{"alpha": 0, "beta": 0, "gamma": -1, "u_max": 1, "n": 1}',
                '{"alpha": 0, "beta": 0, "u_max": 1, "n": 1, "degree": 3}', "[]", "{"):
        assert Fit.from_json(bad) is None


def test_the_pricer_prices_a_first_request_at_a_new_size_from_the_calibration() -> None:
    spec = get_workflow("sd-t2i")
    samples = Samples()
    for u, n, s in _calibration(tiny_sd_step, [64, 96, 128, 176, 256]):
        fitted = samples.calibrated(u, n, s)
    pricer = Pricer()
    pricer.update({("sd-t2i", "denoise"): [fitted]})
    big = spec.resolve_params({"prompt": "x", "width": 512, "height": 512, "num_inference_steps": 50})
    prior = spec.estimate_cost(big)
    others = sum(v for k, v in prior.items() if k != "denoise")
    assert pricer.price(spec, big) == pytest.approx(50 * tiny_sd_step(512 * 512) + others, rel=0.02)
