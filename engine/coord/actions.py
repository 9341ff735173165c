"""The operators' action queue in etcd: an action's names, its request and the leader's verdict.

The web platform (or ``onepiece`` tooling) never calls a manager replica
directly: it writes a request under ``<root>/actions/requests/<id>``
(:func:`submit`) and reads the verdict the leading Node Manager records under
``<root>/actions/results/<id>`` (:func:`result`). The leader's side, checking
an action against the cluster and applying it to the allocator's overrides, is
the Node Manager's decision: :mod:`engine.manager.overrides`.

Actions:
  scale_stage   {workflow, stage, instances}   pin a stage's count (null: back to automatic)
  move_instance {instance, node}               place an instance on a node
  pin_instance  {instance, node}               same as move, kept across rebalancing
  drain_node    {node}                         move everything off a node (0 slots)
  undrain_node  {node}
  set_mode      {workflow, mode}               "individual" or "collaboration"
"""

from __future__ import annotations

import enum
import json
import time
import uuid
from typing import Any

from engine.coord.keys import keyspace


class Action(enum.StrEnum):
    """What an operator may ask the leading Node Manager (the platform's OperatorAction kinds are checked
    against these by a test)."""

    SCALE_STAGE = "scale_stage"
    MOVE_INSTANCE = "move_instance"
    PIN_INSTANCE = "pin_instance"
    DRAIN_NODE = "drain_node"
    UNDRAIN_NODE = "undrain_node"
    SET_MODE = "set_mode"


ACTIONS = tuple(Action)
MODES = ("individual", "collaboration")


class ActionRefused(ValueError):
    """The action is invalid for the cluster as it is; the message says why."""


def submit(client: Any, root: str | None, action: str, args: dict[str, Any], actor: str) -> str:
    """Queue an action for the leader; returns its id (poll :func:`result`)."""
    if action not in ACTIONS:
        raise ActionRefused(f"unknown action {action!r}; known: {', '.join(ACTIONS)}")
    action_id = f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"
    body = {"id": action_id, "action": action, "args": args, "actor": actor, "at": time.time()}
    client.put(keyspace(root).action_request(action_id), json.dumps(body))
    return action_id


def result(client: Any, root: str | None, action_id: str, timeout: float = 10.0) -> dict[str, Any] | None:
    """The leader's verdict on an action, waiting up to ``timeout`` seconds; None if none came."""
    deadline = time.monotonic() + timeout
    while True:
        got = client.get(keyspace(root).action_result(action_id))
        if got:
            return json.loads(got[0])
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.05)
