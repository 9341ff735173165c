"""Operators' actions are named once (OperatorAction.KINDS): every scaling kind is one the leader applies."""

from __future__ import annotations

from engine.coord.actions import ACTIONS
from onepiece_platform.engine_link.models import OperatorAction


def test_the_platforms_actions_are_the_leaders_and_a_warm_up() -> None:
    assert set(OperatorAction.SCALING) <= set(ACTIONS)
    assert OperatorAction.ALL == (*OperatorAction.SCALING, OperatorAction.WARM_UP)
    assert [k for k, _ in OperatorAction._meta.get_field("action").choices] == list(OperatorAction.ALL)
