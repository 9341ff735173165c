"""Warm-up calibration (engine.worker.calibrate): a stage measured at a spread of sizes before any request, on
inputs made at the shapes its spec declares, within its budget, only while its worker is idle; its fit published
so that the Proxy prices a first request at a new size from measurements."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

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
    assert store.instances.price_fits([(INSTANCE, "sd-t2i")]) == {}
    ticks = 0
    while worker.calibrator is not None:
        worker.last_active = time.monotonic() - 1.0  # idle
        assert check() is False
        ticks += 1
        assert ticks < 50
    fit = Fit.from_json(store.instances.price_fits([(INSTANCE, "sd-t2i")])[(INSTANCE, "sd-t2i")])
    assert fit is not None and fit.sizes >= 3 and fit.determined  # image_encode's cost is linear: degree 1
    stats = store.instances.read(INSTANCE)
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
    report = json.loads(store.instances.read(INSTANCE)["calibration.sd-t2i"])
    assert report == {"points": 0, "done": True, "notes": ["off"]}
    assert store.instances.price_fits([(INSTANCE, "sd-t2i")]) == {}
    store.close()


def test_the_default_size_is_measured_first_and_the_warm_up_runs_on_the_least(
        tiny_models: dict[str, Path], monkeypatch: Any) -> None:
    """A heavy stage (a video decoder on CPU) may have budget for one timed point only: that point is the
    default request's, not a quarter of its pixels extrapolated (benchmarks/estimates.md: Wan2.1's decode was
    priced 3.7x over from one point at 1/4). The untimed warm-up runs on the smallest size planned, and a stage
    whose cost the spec does not tie to the size (a text encoder) is measured at the default."""
    from engine.stages.runner import LocalRunner
    from engine.worker import calibrate

    folder = tiny_models["wan2.1-t2v"]
    spec = bound_spec("wan2.1-t2v", folder)
    default = spec.resolve_params({"prompt": "x"})
    sized = plan(spec, "vae_decode", folder)
    assert [(p["height"], p["width"], p["num_frames"]) for p in sized[:1]] == \
        [(default["height"], default["width"], default["num_frames"])]
    rest = [calibrate.pixels(p) for p in sized[1:]]
    assert rest == sorted(rest) and rest[0] < calibrate.pixels(sized[0]) < rest[-1]
    assert [calibrate.pixels(p) for p in plan(spec, "text_encode", folder)] == [calibrate.pixels(sized[0])]
    timed: list[int] = []
    real = calibrate.time_once
    monkeypatch.setattr(calibrate, "time_once",
                        lambda ex, i, p: (timed.append(calibrate.pixels(p)), real(ex, i, p))[1])
    got: list[float] = []
    decode = LocalRunner("wan2.1-t2v", folder, "cpu").executors["vae_decode"]
    cal = Calibrator.of(decode, folder, [("wan2.1-t2v", "vae_decode")], 1e-6,
                        lambda wf, u, n, s: got.append(u))  # type: ignore[arg-type,return-value]
    assert cal is not None
    while cal.pending:
        cal.tick()
    model = spec.costs["vae_decode"]
    assert got == [model.units(spec.dims(sized[0]))]  # the one point the budget bought: the default's
    assert timed == [rest[0], calibrate.pixels(sized[0])]  # the warm-up on the least, then the default


def test_made_up_frames_vary_as_a_decoders_do(tiny_models: dict[str, Path]) -> None:
    """An encoder's time depends on what it encodes: flat frames cost H.264 next to nothing, so the video
    encoder was priced at 0.01 s against 3.9 s measured (benchmarks/estimates.md)."""
    folder = tiny_models["wan2.1-t2v"]
    spec = bound_spec("wan2.1-t2v", folder)
    p = plan(spec, "video_encode", folder)[0]
    frames = synthetic_inputs(spec, "video_encode", model_dims(spec, folder, p), p, "float32")["frames"]
    assert tuple(frames.shape) == (p["num_frames"], p["height"], p["width"], 3)
    assert frames.unique().numel() > 200 and float(frames.float().std()) > 50


def test_a_collaborating_step_is_recorded_at_the_share_its_instance_computes(
        sd: Any, tiny_models: dict[str, Path], monkeypatch: Any) -> None:
    """In Collaboration mode a peer computes half of a guided step: the calibration's step, timed alone, is
    recorded at the share the instance's ``share`` callback gives for the planned request."""
    from engine.worker import calibrate

    monkeypatch.setattr(calibrate, "time_once", lambda ex, i, p: 0.8)
    asked: list[dict[str, Any]] = []
    got: list[float] = []

    def share(wf: str, p: dict[str, Any]) -> float:
        asked.append(p)
        return 0.5

    cal = Calibrator.of(sd.executors["denoise"], tiny_models["sd-t2i"], [("sd-t2i", "denoise")], 1.0,
                        lambda wf, u, n, s: got.append(s), share)  # type: ignore[arg-type,return-value]
    assert cal is not None
    for _ in range(3):  # the warm-up, then two sizes
        cal.tick()
    assert got == [0.4, 0.4] and [p["height"] for p in asked] == [64, 96]


def test_an_instance_that_can_collaborate_is_calibrated_at_its_mode_share(
        redis_server: Any, etcd_server: Any, ring: tuple[RingConsumer, Any]) -> None:
    """A CFG-parallel instance (one with a collab service) was not calibrated, so Wan2.1's denoise was priced
    by the spec's GPU prior, 3.2x its time here. It is now, at its whole step in Individual mode (the default)
    and at the executor's ``cfg_share`` while the Node Manager publishes Collaboration mode."""
    from engine.worker.taskworker import TaskWorker

    consumer, _ = ring
    store = JobStore.from_url(redis_server.url, ttl=60)
    base = image_encode_worker(store, consumer, etcd_server.url, calibrate_s=0.5)
    base.executor.cfg_share = lambda params: 0.5  # type: ignore[attr-defined]  # as WanDenoise's, guided
    worker = TaskWorker(base.config, store, base.routes, base.executor, consumer, collab=object())
    worker._calibrating(lambda: False)
    assert worker.calibrator is not None
    assert worker._step_share("sd-t2i", {}) == 1.0  # Individual mode
    key = worker.routes.keys.capacity("sd-t2i")
    worker.routes.client.put(key, json.dumps({"rps": 1.0, "mode": "collaboration"}))
    try:
        worker.routes.refresh()
        assert worker.routes.mode("sd-t2i") == "collaboration"
        assert worker._step_share("sd-t2i", {}) == 0.5
        assert base._step_share("sd-t2i", {}) == 1.0  # no collab service: it computes every step itself
    finally:
        worker.routes.client.delete(key)
        store.close()



WORKFLOWS = ("flux.1-dev", "flux.1-schnell", "qwen-image", "sd-t2i", "wan2.1-i2v", "wan2.1-t2v", "wan2.2-i2v-a14b",
             "wan2.2-t2v-a14b", "wan2.2-ti2v-5b")


def test_the_list_of_workflows_calibrated_is_every_workflow() -> None:
    from engine.workflow import workflows

    assert set(WORKFLOWS) == set(workflows())


@pytest.mark.models
@pytest.mark.parametrize("workflow", WORKFLOWS)
def test_every_stage_is_calibrated_on_its_made_up_inputs(workflow: str, tiny_models: dict[str, Path]) -> None:
    """Each stage of each workflow takes the inputs the calibration makes up and is measured at its default
    size. Two did not: Qwen-Image's decoder (its VAE's spatial factor comes from ``temperal_downsample``, not
    ``block_out_channels``: the latent sides were unknown) and Wan2.2's low-noise expert (see below); both were
    priced by the spec's prior until requests came."""
    from engine.stages.runner import LocalRunner

    folder = tiny_models[workflow]
    for stage, executor in LocalRunner(workflow, folder, "cpu").executors.items():
        seen: list[float] = []
        cal = Calibrator.of(executor, folder, [(workflow, stage)], 1e-6,
                            lambda wf, u, n, s, seen=seen: seen.append(u))  # type: ignore[misc]
        assert cal is not None, stage
        while cal.pending:
            cal.tick()
        assert not cal.targets[0].notes and len(seen) == 1, (stage, cal.targets[0].notes)


@pytest.mark.models
def test_a_wan22_low_noise_expert_is_calibrated_on_a_state_it_can_continue(tiny_models: dict[str, Path]) -> None:
    """The low-noise expert continues the high one's UniPC state, which made-up numbers are not: its
    calibration stopped at the warm-up with ``ExpertMismatch``. The executor makes the made-up inputs valid
    (``calibration_inputs``: the state a high stage that took no step hands on at this request's boundary)."""
    from engine.stages.runner import LocalRunner
    from engine.stages.wan.experts import ExpertMismatch, restore_scheduler

    folder = tiny_models["wan2.2-t2v-a14b"]
    low = LocalRunner("wan2.2-t2v-a14b", folder, "cpu").executors["denoise_low"]
    spec = bound_spec("wan2.2-t2v-a14b", folder)
    p = plan(spec, "denoise_low", folder)[0]
    made = synthetic_inputs(spec, "denoise_low", model_dims(spec, folder, p), p, "float32")
    scheduler, boundary, _, _ = low.steps_of(p)
    with pytest.raises(ExpertMismatch):  # the control: the spec's shapes alone are not a state to continue
        restore_scheduler(scheduler, made, boundary, "cpu")
    scheduler, boundary, _, _ = low.steps_of(p)
    restore_scheduler(scheduler, low.calibration_inputs(made, p), boundary, "cpu")
