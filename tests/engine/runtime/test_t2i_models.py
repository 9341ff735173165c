"""FLUX.1 and Qwen-Image on the real engine (``onepiece node`` with one worker per stage pool of the three
workflows, 8 processes, and ``onepiece proxy``; the session's cluster serves only the default three): each
workflow's default request completes through the public API (the
official openai client on /v1/images/generations, the platform in this process over the Proxy) with the
one-call pipeline's png bytes; a request over a limit of the loaded model is a 400 naming the field; the
ledger, the dashboard's traffic figures and the Proxy's metrics count the new workflows."""

from __future__ import annotations

import base64
import io
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.workflow.options import SERVING_PARAMS
from tests.fixtures.runtime import Cluster, NodeRun, engine, logs
from tests.fixtures.web import make_user

# live_server for every test here, not only the openai one: pytest orders tests by their session-scoped fixtures,
# and a module whose tests differ in them is split apart, so this module's engine was started (and stopped) twice
pytestmark = [pytest.mark.models, pytest.mark.timeout(600), pytest.mark.usefixtures("live_server")]
PIPELINES = {"flux.1-schnell": "FluxPipeline", "flux.1-dev": "FluxPipeline", "qwen-image": "QwenImagePipeline"}


WORKFLOWS = tuple(PIPELINES)


@pytest.fixture(scope="module")
def t2i_node(redis_server: Any, etcd_server: Any, tiny_models: dict[str, Path],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A node of its own (instance ids, rings and etcd root apart from the session's one_node deployment)
    serving the three workflows, and a Proxy."""
    from engine.worker.config import default_assignment

    base = default_assignment({w: str(tiny_models[w]) for w in WORKFLOWS}, device="cpu")
    node = NodeRun("t2i-node", base)
    with engine(redis_server.url, etcd_server.url, [node], tmp_path_factory.mktemp("t2i-node"),
                f"test-{os.getpid()}-t2i-", root=f"/test-{os.getpid()}-t2i") as (c, _procs):
        yield c


def _reference(folder: Path, workflow: str, params: dict[str, Any]) -> bytes:
    """The one-call pipeline's png on one thread, as the workers run (the same bytes need the same count)."""
    import diffusers
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pipe = getattr(diffusers, PIPELINES[workflow]).from_pretrained(folder)
        kwargs = {k: v for k, v in params.items() if k != "seed" and k not in SERVING_PARAMS}
        image = pipe(generator=torch.Generator().manual_seed(params["seed"]), **kwargs).images[0]
    finally:
        torch.set_num_threads(threads)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _default(workflow: str, folder: Path, **params: Any) -> dict[str, Any]:
    from engine.workflow import get_workflow

    spec = get_workflow(workflow)
    return spec.bound(spec.limits_of(str(folder))).resolve_params(params)


@pytest.fixture
def oa_engine(t2i_node: Cluster, live_server: Any, transactional_db: None, web_redis: str,
              settings: Any) -> Iterator[tuple[Any, Any]]:
    """(openai.OpenAI client for a fresh user, the user), the platform pointed at the session's Proxy."""
    import openai

    from onepiece_platform.engine_link.client import reset_engines

    settings.ONEPIECE = {**settings.ONEPIECE, "ENGINE_CLIENT": "onepiece_platform.engine_link.proxy.ProxyEngineClient",
                         "PROXY_URL": t2i_node.proxy, "PROXY_TOKEN": os.environ["ONEPIECE_PROXY_TOKEN"],
                         "IMAGE_WAIT_S": 240}
    reset_engines()
    user, key = make_user("t2i-user")
    client = openai.OpenAI(api_key=key, base_url=live_server.url + "/v1", max_retries=0, timeout=300)
    yield client, user
    client.close()
    reset_engines()


def test_default_images_through_the_openai_client(oa_engine: tuple[Any, Any], t2i_node: Cluster, live_server: Any,
                                                  tiny_models: dict[str, Path]) -> None:
    import openai
    from django.contrib.auth import get_user_model
    from django.test import Client

    from onepiece_platform.jobs.models import Job

    client, user = oa_engine
    for workflow, extra in (("flux.1-schnell", {}), ("qwen-image", {"negative_prompt": "blurry"})):
        got = client.images.generate(model=workflow, prompt="a cat on the moon", response_format="b64_json",
                                     extra_body=extra or None)
        png = base64.b64decode(got.data[0].b64_json)
        # the defaults the loaded folder gives: schnell's 256x256 (128 x its 2x VAE) in 4 steps; the tiny
        # Qwen-Image folder's declared 256x256 in 8 steps, guided by the negative prompt
        params = _default(workflow, tiny_models[workflow], prompt="a cat on the moon", **extra)
        assert got.size == f"{params['width']}x{params['height']}" == "256x256"
        assert png == _reference(tiny_models[workflow], workflow, params), logs(t2i_node, f"{workflow}.denoise.0")
        job = Job.objects.get(owner=user, workflow=workflow)
        assert job.state == "completed" and job.api == "openai" and job.params["num_inference_steps"] == \
            params["num_inference_steps"]

    # over a limit of the loaded model: refused before anything runs, naming the field
    for workflow, extra, field in (("flux.1-schnell", {"num_inference_steps": 17}, "num_inference_steps"),
                                   ("flux.1-schnell", {"guidance_scale": 3.5}, "guidance_scale"),
                                   ("qwen-image", {"seed": -1}, "seed")):
        with pytest.raises(openai.BadRequestError) as e:
            client.images.generate(model=workflow, prompt="a cat", extra_body=extra)
        assert e.value.body["param"] == field, e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.images.generate(model="qwen-image", prompt="a cat", size="2064x2064")  # type: ignore[arg-type]
    assert e.value.body["param"] == "size", e.value.body
    assert Job.objects.filter(owner=user).count() == 2

    # the dashboard's traffic figures and the platform's metrics know the new workflows as any other
    staff = Client()
    staff.force_login(get_user_model().objects.create_user("t2i-ops", is_staff=True))
    traffic = staff.get("/dashboard/api/traffic?minutes=5&step=60").json()["workflows"]
    assert traffic["flux.1-schnell"]["totals"]["accepted"] == 1 and traffic["qwen-image"]["totals"]["completed"] == 1
    with urllib.request.urlopen(live_server.url + "/metrics", timeout=30) as r:
        metrics = r.read().decode()
    for workflow in ("flux.1-schnell", "qwen-image"):
        assert f'onepiece_jobs{{state="completed",workflow="{workflow}"}} 1.0' in metrics, metrics


def test_dev_default_request_through_the_native_api(t2i_node: Cluster, tiny_models: dict[str, Path]) -> None:
    uid = t2i_node.submit("flux.1-dev", {"prompt": "a cat on the moon"})
    done = t2i_node.wait(uid, {"completed", "failed"}, timeout=300)
    assert done["state"] == "completed", (done, logs(t2i_node, "flux.1-dev.denoise.0"))
    status, png, headers = t2i_node.call("GET", f"/v1/requests/{uid}/result")
    assert status == 200 and headers["Content-Type"] == "image/png"
    params = _default("flux.1-dev", tiny_models["flux.1-dev"], prompt="a cat on the moon")
    assert (params["height"], params["num_inference_steps"], params["guidance_scale"]) == (256, 8, 3.5)
    assert png == _reference(tiny_models["flux.1-dev"], "flux.1-dev", params)
    started = [e["stage"] for e in t2i_node.events(uid) if e["type"] == "stage_started"]
    assert started == ["text_encode", "denoise", "vae_decode", "image_encode"]
    status, doc, _ = t2i_node.call("POST", "/v1/requests", {"workflow": "flux.1-dev",
                                                           "params": {"prompt": "a cat", "guidance_scale": 21}})
    assert status == 400 and doc["field"] == "guidance_scale", doc
