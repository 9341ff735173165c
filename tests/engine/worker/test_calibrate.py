"""Warm-up calibration (engine.worker.calibrate): a stage measured at a spread of sizes before any request, on
inputs made at the shapes its spec declares, within its budget, only while its worker is idle; its fit published
so that the Proxy prices a first request at a new size from measurements."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

from engine.store import JobStore, keys
from engine.transport.ring import RingConsumer
from engine.worker.calibrate import Calibrator, bound_spec, model_dims, plan, synthetic_inputs
from engine.worker.config import Calibration
from engine.workflow.pricing import Fit, Samples
from tests.engine.worker.rig import image_encode_worker, send_pixels

INSTANCE = "sd-t2i.image_encode.0"


def _idle_loop(worker: Any) -> Any:
    """The worker loop's stop check with calibration, as serve() wraps it (never stopping)."""
    return worker._calibrating(lambda: False)


def test_an_idle_worker_publishes_a_fit_of_several_sizes_before_any_request(
        redis_server: Any, etcd_server: Any, ring: tuple[RingConsumer, Any]) -> None:
    consumer, producer = ring
    store = JobStore.from_url(redis_server.url, ttl=60)
    store.r.delete(keys.instance_key(INSTANCE))
    worker = image_encode_worker(store, consumer, etcd_server.url, calibrate_s=0.5)
    check = _idle_loop(worker)
    worker.last_active = time.monotonic()  # it just handled something: busy, nothing is measured
    assert check() is False and worker.calibrator.targets[0].points == 0
    assert store.price_fits([(INSTANCE, "sd-t2i")]) == {}
    ticks = 0
    while worker.calibrator is not None:
        worker.last_active = time.monotonic() - 1.0  # idle
        assert check() is False
        ticks += 1
        assert ticks < 50
    fit = Fit.from_json(store.price_fits([(INSTANCE, "sd-t2i")])[(INSTANCE, "sd-t2i")])
    assert fit is not None and fit.sizes >= 3 and fit.determined  # image_encode's cost is linear: degree 1
    stats = store.instance_stats(INSTANCE)
    report = json.loads(stats["calibration.sd-t2i"])
    assert report["done"] and report["points"] == fit.sizes and not report["notes"]
    assert "requests" not in stats  # calibration is not a request
    # a request's run joins the calibration's points
    for _ in range(2):  # a process's first run is not sampled (one-off costs)
        uid = uuid.uuid4().hex
        store.accept(uid, "sd-t2i", 1.0)
        send_pixels(producer, uid)
        worker.handle(consumer.recv(timeout=5))
    after = worker.fits["sd-t2i"]
    assert after is not None and after.n == fit.n + 1 and after.sizes == fit.sizes + 1  # 8x8: a new size
    store.close()


def test_calibration_off_and_a_floor_stretched_stage_measure_nothing(
        redis_server: Any, etcd_server: Any, ring: tuple[RingConsumer, Any]) -> None:
    consumer, _ = ring
    store = JobStore.from_url(redis_server.url, ttl=60)
    stop = lambda: False  # noqa: E731
    off = image_encode_worker(store, consumer, etcd_server.url)  # calibrate_s 0, as a WorkerConfig defaults
    assert off._calibrating(stop) is stop and off.calibrator is None
    floored = image_encode_worker(store, consumer, etcd_server.url, calibrate_s=1.0, stage_time_s=0.2)
    assert floored._calibrating(stop) is stop  # a floor per run is no cost per step
    store.close()


def test_the_budget_bounds_the_sizes(sd: Any, tiny_models: dict[str, Path]) -> None:
    """With next to no budget, one size is measured and the growth stops; the stage then prices sizes past it
    by its worst case, as it would with calibration off."""
    samples = Samples()
    got: list[tuple[str, float, float, float]] = []

    def record(wf: str, u: float, n: float, s: float) -> Fit | None:
        got.append((wf, u, n, s))
        return samples.calibrated(u, n, s)

    cal = Calibrator.of(sd.executors["vae_decode"], tiny_models["sd-t2i"], [("sd-t2i", "vae_decode")], 1e-6, record)
    assert cal is not None
    while cal.pending:
        cal.tick()
    assert len(got) == 1 and not cal.targets[0].notes


def test_the_tiny_sd_stages_take_the_made_up_inputs_at_every_size(sd: Any, tiny_models: dict[str, Path]) -> None:
    """The shapes come from the spec and the model's configs (latent channels, the VAE's depth, the UNet's
    cross-attention width): every stage of the tiny SD model runs on them at each size planned."""
    folder = tiny_models["sd-t2i"]
    spec = bound_spec("sd-t2i", folder)
    sizes = [(p["height"], p["width"]) for p in plan(spec, "denoise", folder)]
    assert sizes[0] == (spec.param("height").default, spec.param("width").default) == (64, 64)  # its floor
    assert len(sizes) >= 4 and sizes == sorted(sizes)
    dims = model_dims(spec, folder, plan(spec, "vae_decode", folder)[1])
    latents = synthetic_inputs(spec, "vae_decode", dims, {"height": 96, "width": 96}, "float32")["denoised"]
    assert tuple(latents.shape) == (1, 4, 48, 48)  # the tiny VAE halves each side; 4 latent channels
    for stage in ("text_encode", "denoise", "vae_decode", "image_encode"):
        seen: list[float] = []
        cal = Calibrator.of(sd.executors[stage], folder, [("sd-t2i", stage)], 1.0,
                            lambda wf, u, n, s, seen=seen: seen.append(u))  # type: ignore[misc]
        assert cal is not None
        for _ in range(3):  # the warm-up, then two sizes
            cal.tick()
        assert not cal.targets[0].notes, (stage, cal.targets[0].notes)
        assert len(seen) == (1 if stage == "text_encode" else 2), stage  # a text encoder has one size: none


def test_the_budget_flag_reads_a_default_and_per_stage_values() -> None:
    c = Calibration.parse("5,denoise=20,sd-t2i/vae_decode=0")
    assert c.for_stage("sd-t2i", "denoise") == 20 and c.for_stage("sd-t2i", "vae_decode") == 0
    assert c.for_stage("wan2.1-t2v", "vae_decode") == 5 and Calibration.parse(None).for_stage("sd-t2i", "x") == 2.0
    for bad in ("-1", "1,2", "denoise=-3", "nope"):
        try:
            Calibration.parse(bad)
        except ValueError as exc:
            assert "calibrate-s" in str(exc)
        else:
            raise AssertionError(bad)


def test_an_instance_with_calibration_off_says_so(redis_server: Any, etcd_server: Any,
                                                  ring: tuple[RingConsumer, Any]) -> None:
    """Whoever waits for every instance's calibration (benchmarks/estimates_sweep.py) is told at once that
    this one has none, rather than waiting for a report that never comes."""
    consumer, _producer = ring
    store = JobStore.from_url(redis_server.url, ttl=60)
    store.r.delete(keys.instance_key(INSTANCE))
    worker = image_encode_worker(store, consumer, etcd_server.url, calibrate_s=0.0)
    check = _idle_loop(worker)
    assert check() is False and worker.calibrator is None
    report = json.loads(store.instance_stats(INSTANCE)["calibration.sd-t2i"])
    assert report == {"points": 0, "done": True, "notes": ["off"]}
    assert store.price_fits([(INSTANCE, "sd-t2i")]) == {}
    store.close()
