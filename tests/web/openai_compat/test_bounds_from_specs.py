"""Bounds written once: the OpenAI routes' model parameters are the workflows' ParamSpecs.

Every field a generation route accepts is a parameter of one of its models (its bounds the widest over
them, recomputed here from the specs), one of the job's options, or one of the route's own fields; a
field re-declared by hand with its own bound (the prompt's 4000 against the specs' 4096) is caught.
"""

from __future__ import annotations

from typing import Any

import pytest
from rest_framework import serializers

from engine.workflow import workflows
from onepiece_platform.jobs.api import openai_serializers as s

ROUTES = [
    (s.VideoCreateSerializer, "video", s.VIDEO_PARAMS, s.VIDEO_ROUTE_FIELDS),
    (s.ImageGenerateSerializer, "image", s.IMAGE_PARAMS, s.IMAGE_ROUTE_FIELDS),
    (s.VideoRemixSerializer, "video", ("prompt",), ("input_reference",)),
]


def _widest(output: str, name: str) -> dict[str, Any]:
    """The bounds a field of ``name`` must have, from the specs themselves (not from param_bounds)."""
    specs = [p for w in workflows().values() if w.final_output == output for p in w.params if p.name == name]
    assert specs, f"no {output} workflow takes {name}"
    if specs[0].type is str:
        out: dict[str, Any] = {"max_length": max(p.max_length for p in specs)}
        if all(p.choices for p in specs):
            out["choices"] = {c for p in specs for c in p.choices}
        return out
    return {"min_value": min(p.minimum for p in specs), "max_value": max(p.maximum for p in specs)}


def _bounds(field: serializers.Field) -> dict[str, Any]:
    if isinstance(field, serializers.ChoiceField):
        return {"max_length": 16, "choices": set(field.choices)}  # ParamSpec's choices carry a max_length
    if isinstance(field, serializers.CharField):
        return {"max_length": field.max_length}
    return {"min_value": field.min_value, "max_value": field.max_value}


def drift(serializer: type[serializers.Serializer], output: str, params: tuple[str, ...],
          own: tuple[str, ...]) -> list[str]:
    """What a route accepts that is not a spec parameter, an option or its own, and every bound that
    differs from the specs'."""
    fields = serializer().fields
    found = [f"{name}: neither a parameter of a {output} model, an option nor the route's own"
             for name in fields if name not in {*params, *s.OPTION_FIELDS, *own}]
    for name in params:
        want, got = _widest(output, name), _bounds(fields[name])
        if "choices" not in want:
            got.pop("choices", None)
        if got != want:
            found.append(f"{name}: {got} where the specs say {want}")
    return found


@pytest.mark.parametrize(("serializer", "output", "params", "own"), ROUTES, ids=lambda v: getattr(v, "__name__", ""))
def test_every_field_is_a_spec_parameter_an_option_or_the_routes_own(
        serializer: type[serializers.Serializer], output: str, params: tuple[str, ...], own: tuple[str, ...]) -> None:
    assert drift(serializer, output, params, own) == []


def test_a_hand_written_bound_or_an_undeclared_field_is_caught() -> None:
    class Drifted(s.ImageGenerateSerializer):
        prompt = serializers.CharField(max_length=4000)  # the bound the route once had
        steps = serializers.IntegerField(required=False)  # a field nobody declared

    found = drift(Drifted, "image", s.IMAGE_PARAMS, s.IMAGE_ROUTE_FIELDS)
    assert any(f.startswith("prompt: ") and "4096" in f for f in found), found
    assert any(f.startswith("steps: neither") for f in found), found


def _refused(r: Any, param: str) -> None:
    assert r.status_code == 400, (r.status_code, r.content[:300])
    assert r.json()["error"]["param"] == param, r.json()


def test_the_routes_accept_what_the_models_accept_and_refuse_past_it(alice) -> None:
    _, c, _ = alice
    video = {"size": "32x32", "seconds": "1", "num_inference_steps": 2}
    # the specs' 4,096 characters (the route's own 4,000 refused prompts every model takes)
    made = c.post("/v1/videos", {**video, "prompt": "a" * 4096}, format="json")
    assert made.status_code == 200, made.content[:300]
    _refused(c.post("/v1/videos", {**video, "prompt": "a" * 4097}, format="json"), "prompt")
    # the video models' step limit (the route's own was 1,000 for every model)
    _refused(c.post("/v1/videos", {**video, "prompt": "a cat", "num_inference_steps": 101}, format="json"),
             "num_inference_steps")
    # a quality no video model serves is refused where it is sent, with the levels that are
    r = c.post("/v1/videos", {**video, "prompt": "a cat", "quality": "ultra"}, format="json")
    _refused(r, "quality")
    # images: the whole seed range of the specs (the route stopped at 2**63 - 5), with room for n images
    top = 2**63 - 1
    assert s.ImageGenerateSerializer(data={"prompt": "a cat", "seed": top}).is_valid()
    two = s.ImageGenerateSerializer(data={"prompt": "a cat", "seed": top, "n": 2})
    assert not two.is_valid() and "seed" in two.errors, two.errors
    assert s.ImageGenerateSerializer(data={"prompt": "a cat", "seed": top - 1, "n": 2}).is_valid()
