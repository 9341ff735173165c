"""The engine's own intake takes numbers as numbers only: a string of digits, ASCII or full-width (``６０``,
which Python's ``int()`` and ``float()`` read), is refused naming its field, by the workflow spec's
parameter coercion and by the Proxy's ``deadline_s``, so a client that skips the web platform gets the
same 400 (issue 39, finding 7). A guard: both already refused, as they must go on doing."""

from __future__ import annotations

import pytest

from engine.proxy.intake import Intake
from engine.proxy.parsing import BadRequest
from engine.workflow import InvalidRequest, get_workflow

SD = {"prompt": "a cat", "height": 64, "width": 64, "num_inference_steps": 2}


@pytest.mark.parametrize(("name", "value"), [("guidance_scale", "５"), ("guidance_scale", "5"),
                                             ("num_inference_steps", "２"), ("height", "６４"), ("seed", True)])
def test_a_param_written_as_digits_is_refused_naming_it(name: str, value: object) -> None:
    with pytest.raises(InvalidRequest) as got:
        get_workflow("sd-t2i").resolve_params({**SD, name: value})
    assert got.value.field == name


@pytest.mark.parametrize("value", ["６０", "60", True])
def test_the_proxys_deadline_is_a_number_only(value: object) -> None:
    with pytest.raises(BadRequest) as got:
        Intake().submission("sd-t2i", SD, {}, value)
    assert got.value.field == "deadline_s"
    assert Intake().submission("sd-t2i", SD, {}, 60).deadline is not None
