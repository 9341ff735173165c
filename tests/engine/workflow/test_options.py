"""A request's options are declared once (engine.workflow.options) and read typed where they are consumed.

No spec file declares ``preview_every`` or ``quality``: every workflow takes them from the options module,
bounded by its own spec; the edge (the Proxy's parser) builds one ``Options`` per request; a new option
declared there reaches every workflow without a spec file changing; the options then travel whole, apart from
the model's parameters, in the Workflow Message header.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import replace
from pathlib import Path

import pytest

from engine.dispatch import order
from engine.proxy.parsing import BadRequest, Parser
from engine.stages import caching
from engine.workflow import InvalidRequest, get_workflow, options, spec, workflows
from engine.workflow import message as wm
from engine.workflow.options import LOSSLESS, PARAM_OPTIONS, Options, Priority
from engine.workflow.params import ParamSpec
from engine.workflow.request import Request

SPECS = Path(spec.__file__).parent / "specs"


def test_no_spec_file_declares_a_request_option() -> None:
    names = "|".join(PARAM_OPTIONS)
    named = re.compile(rf"""["']({names})["']|\b(preview_every|quality)\(""")
    found = {f.name: m.group(0) for f in SPECS.glob("*.py") for m in named.finditer(f.read_text())}
    assert found == {}


def test_every_workflow_takes_the_options_it_serves_bounded_by_its_own_spec() -> None:
    for name, wf in workflows().items():
        params = {p.name: p for p in wf.params}
        steps = params["num_inference_steps"].maximum
        assert params["preview_every"] == options.params_for(steps, False)[0], name
        assert ("quality" in params) == wf.step_cache, name
        if wf.step_cache:
            assert params["quality"].choices == options.QUALITY_LEVELS and params["quality"].default == LOSSLESS
    # the workflows whose spec says their denoise caches are those the caching tables serve
    assert {n for n, w in workflows().items() if w.step_cache} == set(caching.LEVELS)


def test_a_new_option_reaches_every_workflow_from_the_options_module_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    extra = ParamSpec("new_option", int, 0, 0, 3, doc="an option declared in engine.workflow.options only")
    declared = options.params_for
    monkeypatch.setattr(spec, "params_for", lambda steps, cache: (*declared(steps, cache), extra))
    for name in ("sd-t2i", "wan2.1-t2v"):
        model_only = tuple(p for p in get_workflow(name).params if p.name not in PARAM_OPTIONS)
        rebuilt = replace(get_workflow(name), params=model_only)  # a spec built now, its file unchanged
        assert rebuilt.param("new_option") == extra
        assert rebuilt.resolve_params({"prompt": "a cat", "new_option": 2})["new_option"] == 2


def test_the_edge_builds_one_typed_options_per_request() -> None:
    parser = Parser()
    sub = parser.submission("flux.1-dev", {"prompt": "a cat", "quality": "high", "preview_every": 2}, {},
                            deadline_s=30, priority="high")
    assert isinstance(sub, Request) and sub.options == Options(Priority.HIGH, 30.0, 2, "high", ())
    assert sub.priority == 1 and sub.deadline is not None
    assert [p.level for p in Priority] == [-1, 0, 1] and order.LEVELS == {"low": -1, "normal": 0, "high": 1}
    plain = parser.submission("sd-t2i", {"prompt": "a cat"}, {})
    assert plain.options == Options() and plain.priority == 0 and plain.deadline is None
    for field, kwargs in (("priority", {"priority": "urgent"}), ("deadline_s", {"deadline_s": float("inf")}),
                          ("deadline_s", {"deadline_s": True, "priority": "urgent"})):
        with pytest.raises(BadRequest) as err:
            parser.submission("sd-t2i", {"prompt": "a cat"}, {}, **kwargs)
        assert err.value.field == field
    with pytest.raises(BadRequest) as err:  # a level the workflow does not serve: its spec's bound
        parser.submission("sd-t2i", {"prompt": "a cat", "quality": "high"}, {})
    assert err.value.field == "quality"


def test_the_options_travel_whole_in_the_header_apart_from_the_model_params() -> None:
    """The edge takes the options out of the params it resolved (Options.split) and the first stage's
    message carries them whole in its header's ``options``; a consumer reads them back typed."""
    from engine.proxy.intake import Intake

    intake = Intake()
    sub = intake.submission("flux.1-dev", {"prompt": "a cat", "quality": "high", "preview_every": 2}, {},
                            deadline_s=30, priority="high")
    assert not set(PARAM_OPTIONS) & set(sub.params)  # the model's parameters only
    assert sub.params["prompt"] == "a cat" and "num_inference_steps" in sub.params
    h = wm.decode(intake.ticket(sub).message).header
    assert h.options == {"quality": "high", "preview_every": 2, "priority": "high", "deadline_s": 30.0}
    assert Options.from_json(h.options) == sub.options and h.params == sub.params
    assert h.priority == 1 and h.deadline == sub.deadline  # the routing copies the rings and the order read
    plain = wm.decode(intake.ticket(intake.submission("sd-t2i", {"prompt": "a cat"}, {})).message).header
    assert plain.options == {} and Options.from_json(plain.options) == Options()



def _raw(version: int, doc: dict[str, object]) -> bytes:
    raw = json.dumps({**doc, "entries": []}).encode()
    return struct.pack("<4sHHIIQ", wm.MAGIC, version, 0, len(raw), 0, wm.PREFIX_SIZE + len(raw)) + raw


def test_a_version_1_message_keeps_its_options_and_a_bad_option_is_a_bad_header() -> None:
    """A version 1 message (its options among its params: one kept for a retry across an upgrade) is read
    with its options moved out, defaults dropped; a header whose options are not Options is refused when
    decoded (the worker's undecodable path), never later in a batcher."""
    base = wm.Header(uid="a" * 32, workflow="flux.1-dev", stage="denoise", route=["denoise"]).to_json()
    del base["options"]
    v1 = {**base, "params": {"prompt": "x", "quality": "high", "preview_every": 0, "lora": []}}
    h = wm.decode(_raw(1, v1)).header
    assert h.params == {"prompt": "x"} and h.options == {"quality": "high"}
    assert int.from_bytes(wm.encode(h)[4:6], "little") == wm.VERSION == 2
    assert wm.decode(wm.encode(h)).header.options == {"quality": "high"}
    for bad in ({"quality": "ultra"}, {"qualty": "high"}, {"lora": [{"name": "a"}]}):
        with pytest.raises(wm.BadHeader, match="options"):
            wm.decode(_raw(2, {**base, "params": {}, "options": bad}))
    with pytest.raises(wm.BadHeader, match="options"):  # version 2 always carries them
        wm.decode(_raw(2, {**base, "params": {}}))

def test_options_are_checked_when_made_and_round_trip() -> None:
    full = Options(Priority.LOW, 12.5, 3, "extra-high", ({"name": "a", "scale": 0.5, "digest": "d" * 64},))
    assert Options.from_json(full.to_json()) == full and Options().to_json() == {}
    assert Options("high").priority is Priority.HIGH  # the API's name becomes the enumeration
    for field, kwargs in (("priority", {"priority": "urgent"}), ("deadline_s", {"deadline_s": -1}),
                          ("preview_every", {"preview_every": -1}), ("quality", {"quality": "ultra"}),
                          ("lora", {"lora": ({"name": "a"},)})):
        with pytest.raises(InvalidRequest) as err:
            Options(**kwargs)
        assert err.value.field == field
    with pytest.raises(InvalidRequest) as err:
        Options.from_json({"qualty": "high"})
    assert err.value.field == "qualty"
    # the params the API takes them among: those set, and a workflow's own at their defaults
    assert full.params() == {"preview_every": 3, "quality": "extra-high", "lora": [dict(full.lora[0])]}
    assert Options().params(("quality", "preview_every")) == {"preview_every": 0, "quality": LOSSLESS}
