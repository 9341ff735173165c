"""The engine's etcd keyspace: every key any process reads or writes, built here and only here.

All keys live under one root (``/onepiece``; ``ONEPIECE_ETCD_ROOT`` or ``onepiece manager --root``
chooses another, so that several engines can share one etcd; every process of one engine must use
the same root). Values are JSON unless noted.

======================================================  ==============================================  ============
key                                                     value                                           writer
======================================================  ==============================================  ============
``<root>/routes/<workflow>/<stage>/<instance>``         an instance's ring address (``Route``)          TaskManager
``<root>/nodes/<node>``                                 the node's report, bound to its lease           TaskManager
``<root>/assignments/<node>``                           the node's desired instances                    Node Manager
``<root>/capacity/<workflow>``                          measured capacity, mode, recommendation         Node Manager
``<root>/manager/leader``                               the leader's name (its create_revision fences)  election
``<root>/overrides``                                    operators' bounds, pins and modes               Node Manager
``<root>/actions/requests/<id>``                        a queued operator action                        platform
``<root>/actions/results/<id>``                         its verdict                                     Node Manager
``<root>/audit/<id>``                                   the same verdict, kept                          Node Manager
``<root>/sets/state``                                   the Workflow Sets and their members             Node Manager
``<root>/sets/nodes/<node>``                            the set a node was moved to (a JSON string)     Node Manager
``<root>/sets/capacity/<set>/<workflow>``               one set's capacity for a workflow               Node Manager
``<root>/proxies/<set>/<proxy>``                        a Proxy's URL and arrival rates, on its lease   Proxy
======================================================  ==============================================  ============

The engine user that ``onepiece etcd-auth`` creates may read and write ``<root>/`` and below only.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine import envs

log = logging.getLogger(__name__)

DEFAULT_ROOT = "/onepiece"


def default_root() -> str:
    """``ONEPIECE_ETCD_ROOT`` when set, else ``/onepiece``."""
    return (envs.ETCD_ROOT or DEFAULT_ROOT).rstrip("/") or DEFAULT_ROOT


def _family(path: str) -> tuple[Callable[[Keyspace], str], Callable[[Keyspace, str], str]]:
    """The two methods of a flat family of keys under ``<root>/<path>/``: the prefix, and one key.

    ``nodes, node = _family("nodes")`` in :class:`Keyspace` gives ``ks.nodes()`` ->
    ``<root>/nodes/`` and ``ks.node(name)`` -> ``<root>/nodes/<name>``."""

    def prefix(self: Keyspace) -> str:
        return f"{self.root}/{path}/"

    def key(self: Keyspace, name: str, /) -> str:
        return f"{prefix(self)}{name}"

    return prefix, key


def _fixed(path: str) -> Callable[[Keyspace], str]:
    """The method of the one key ``<root>/<path>``."""

    def key(self: Keyspace) -> str:
        return f"{self.root}/{path}"

    return key


@dataclass(frozen=True)
class Keyspace:
    """The keys of one engine, under ``root``. Prefixes end with ``/``; :func:`read_prefix` strips them."""

    root: str = DEFAULT_ROOT

    @classmethod
    def from_env(cls) -> Keyspace:
        return cls(default_root())

    def __post_init__(self) -> None:
        if not self.root.startswith("/") or self.root.endswith("/"):
            raise ValueError(f"an etcd root is /name without a trailing slash, got {self.root!r}")

    # instances -----------------------------------------------------------------------------------
    def routes(self, workflow: str = "", stage: str = "") -> str:
        """The prefix of every route, of a workflow's, or of one stage's."""
        return f"{self.root}/routes/" + "".join(f"{p}/" for p in (workflow, stage) if p)

    def route(self, workflow: str, stage: str, instance: str) -> str:
        return f"{self.routes(workflow, stage)}{instance}"

    nodes, node = _family("nodes")
    assignments, assignment = _family("assignments")

    # the Node Manager's publications ------------------------------------------------------------
    capacities, capacity = _family("capacity")
    leader = _fixed("manager/leader")
    overrides = _fixed("overrides")

    # operator actions ------------------------------------------------------------------------------
    action_requests, action_request = _family("actions/requests")
    _action_results, action_result = _family("actions/results")
    audits, audit = _family("audit")

    # Workflow Sets --------------------------------------------------------------------------------
    sets_state = _fixed("sets/state")
    set_nodes, set_node = _family("sets/nodes")

    def set_capacities(self, workflow_set: str) -> str:
        return f"{self.root}/sets/capacity/{workflow_set}/"

    def set_capacity(self, workflow_set: str, workflow: str) -> str:
        return f"{self.set_capacities(workflow_set)}{workflow}"

    def proxies(self, workflow_set: str = "") -> str:
        return f"{self.root}/proxies/" + (f"{workflow_set}/" if workflow_set else "")

    def proxy(self, workflow_set: str, name: str) -> str:
        return f"{self.proxies(workflow_set)}{name}"


def keyspace(root: str | None = None) -> Keyspace:
    """The keys under ``root``, or under :func:`default_root` when it is None or empty."""
    return Keyspace(root.rstrip("/") if root else default_root())


def _text(b: Any) -> str:
    return b.decode() if isinstance(b, bytes) else str(b)


def read_prefix(client: Any, prefix: str, *, as_json: bool = True) -> dict[str, Any]:
    """Every key under ``prefix``, named relative to it: ``{rest_of_key: value}``.

    Values are parsed JSON (a malformed one is logged and left out, never fatal) or, with
    ``as_json=False``, text. Raises whatever the client raises when etcd cannot be read: an
    unreadable prefix must never be taken for an empty one."""
    out: dict[str, Any] = {}
    for value, meta in client.get_prefix(prefix):
        key = _text(meta["key"])
        if not as_json:
            out[key[len(prefix):]] = _text(value)
            continue
        try:
            out[key[len(prefix):]] = json.loads(value)
        except ValueError:
            log.warning("ignoring a malformed value at %s", key)
    return out


def read_keys(client: Any, prefix: str) -> set[str]:
    """The keys under ``prefix``, named relative to it, without their values (etcd's ``keys_only``: a
    membership check need not fetch every node's report). Raises when etcd cannot be read."""
    from engine.coord.watch import _prefix_end

    got = client.get(prefix, metadata=True, range_end=_prefix_end(prefix), keys_only=True)
    return {_text(meta["key"])[len(prefix):] for _, meta in got or ()}


def read_json(client: Any, key: str) -> Any:
    """The JSON value at ``key``, or None when it is absent or malformed (logged)."""
    got = client.get(key)
    if not got:
        return None
    try:
        return json.loads(got[0])
    except ValueError:
        log.warning("ignoring a malformed value at %s", key)
        return None
