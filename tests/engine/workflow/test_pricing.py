"""Requests priced from measured stage times (engine.workflow.pricing) and admission on that price."""

from __future__ import annotations

from engine.proxy.monitor import Load, RequestMonitor
from engine.workflow import get_workflow
from engine.workflow.pricing import Fit, Pricer, Samples, fit


def test_fit_interpolates_and_extrapolates_by_the_stage_growth() -> None:
    # per step 0.01 + 1e-5 * u, measured at two sizes
    runs = [(1000.0, 10.0, 10 * (0.01 + 1e-5 * 1000)), (4000.0, 5.0, 5 * (0.01 + 1e-5 * 4000))]
    f = fit(runs)
    assert f is not None and abs(f.alpha - 0.01) < 1e-9 and abs(f.beta - 1e-5) < 1e-12 and f.u_max == 4000
    assert abs(f.predict(2000, 20, 2.0) - 20 * (0.01 + 0.02)) < 1e-9  # inside what was measured: the line
    # four times the largest size measured: a quadratic stage is priced at 16x the largest step, a linear 4x
    top = 0.01 + 1e-5 * 4000
    assert abs(f.predict(16000, 1, 2.0) - 16 * top) < 1e-9 and abs(f.predict(16000, 1, 1.0) - 4 * top) < 1e-9


def test_one_size_measured_is_proportional_and_noise_never_makes_it_cheaper() -> None:
    f = fit([(1024.0, 3.0, 0.06)] * 5)
    assert f is not None and f.alpha == 0 and abs(f.predict(1024, 3, 2.0) - 0.06) < 1e-12
    # the 512x512 50-step request after only 64x64 3-step ones: far over any 2-minute wait
    assert f.predict(512 * 512, 50, 2.0) > 1000
    noisy = fit([(1000.0, 1.0, 0.30), (1100.0, 1.0, 0.20)])  # a falling line across close sizes
    # flat, between the two (a least squares of the relative error: nearer the smaller)
    assert noisy is not None and noisy.beta == noisy.gamma == 0 and 0.20 < noisy.alpha < 0.25
    assert Fit.from_json(Fit(0.1, 0.2, 3.0, 4).to_json()) == Fit(0.1, 0.2, 3.0, 4)
    assert Fit.from_json('{"alpha": -1, "beta": 0, "u_max": 1, "n": 1}') is None
    assert Fit.from_json("not json") is None


def test_pricer_uses_measured_stages_and_priors_for_the_rest() -> None:
    spec = get_workflow("sd-t2i")
    pricer = Pricer()
    small = spec.resolve_params({"prompt": "x", "width": 64, "height": 64, "num_inference_steps": 3})
    assert pricer.price(spec, small) is None  # nothing measured: admission as before
    samples = Samples()
    for _ in range(3):
        samples.add(64 * 64, 3, 0.06)
    pricer.update({("sd-t2i", "denoise"): [samples.add(64 * 64, 3, 0.06)]})
    prior = spec.estimate_cost(small)
    got = pricer.price(spec, small)
    assert got is not None and abs(got - (0.06 + prior["text_encode"] + prior["vae_decode"] + prior["image_encode"])) < 1e-9
    big = spec.resolve_params({"prompt": "x", "width": 512, "height": 512, "num_inference_steps": 50})
    assert pricer.price(spec, big) > 100 * pricer.price(spec, small)


def test_admission_refuses_at_once_what_cannot_finish_within_its_deadline_even_idle() -> None:
    monitor = RequestMonitor(max_queue=64)
    idle = Load(inflight=4, inflight_cost=0.3, instances=4, entry_instances=1, drain_rps=12.0, base_latency_s=0.2)
    # priced by the rate of small requests alone, a request 4000x their size is admitted on a 120 s wait
    assert monitor.decide(idle, 2.0, 0.0, 120.0).admit
    refused = monitor.decide(idle, 2.0, 0.0, 120.0, own_s=900.0)
    assert not refused.admit and "900s of stage work" in refused.reason and refused.retry_after >= 1
    # a small one with its own price still goes through, and a large one with no deadline is queued
    assert monitor.decide(idle, 0.08, 0.0, 120.0, own_s=0.1).admit
    assert monitor.decide(idle, 2.0, 0.0, None, own_s=900.0).admit
    # its own work counts after the queue ahead of it, against the deadline
    finish = monitor.predicted_finish(idle, 2.0, own_s=60.0)
    assert finish >= 4 / 12.0 + 60.0
