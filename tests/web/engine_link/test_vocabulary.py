"""The platform's job states and operator actions are the engine's names: generated from, or checked against,
engine.store.keys.JobState and engine.coord.actions.Action."""

from __future__ import annotations

from engine.coord.actions import ACTIONS, Action
from engine.store import keys
from onepiece_platform.engine_link.models import OperatorAction
from onepiece_platform.jobs import models as jobs


def test_the_ledgers_states_are_the_engines() -> None:
    assert list(jobs.States.values) == [s.value for s in keys.JobState]
    assert jobs.Job._meta.get_field("state").choices == [(s.value, s.value) for s in keys.JobState]
    assert set(jobs.TERMINAL) == set(keys.TERMINAL) and set(jobs.NON_TERMINAL) == set(keys.JobState) - keys.TERMINAL


def test_every_scaling_action_the_platform_offers_is_one_the_node_manager_takes() -> None:
    offered = set(OperatorAction.SCALING)
    assert offered <= set(ACTIONS), offered - set(ACTIONS)
    # pin_instance is the one Node Manager action the platform does not offer
    assert set(ACTIONS) - offered == {Action.PIN_INSTANCE}
    assert set(OperatorAction.ALL) - offered == {OperatorAction.WARM_UP}
    assert OperatorAction._meta.get_field("action").choices == OperatorAction.Kind.choices
