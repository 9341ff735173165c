"""Proxy registration in etcd: each Proxy's entry, and the platform's question of which Proxy to use.

Keys (under the cluster root; built by :mod:`engine.coord.keys`)::

    proxies/<set>/<name>     {"url", "set", "rps": {workflow: accepted/s}}    a Proxy, bound to its lease
    sets/state               {set: {"nodes", "proxies", "workflows": {wf: {"capacity", "arrival"}}}}

A Proxy registers itself (:func:`register_proxy`); the leading Node Manager
(:mod:`engine.manager.sets`) writes each Workflow Set's state, and
:func:`which_proxy` answers from it: one of the least loaded set's Proxies
for a workflow (arrival / capacity).
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Mapping
from typing import Any

from engine.coord.keys import keyspace, read_json


class NoProxy(LookupError):
    """No set has a Proxy and capacity for the workflow."""


def which_proxy(client: Any, workflow: str | None, root: str | None = None,
                rng: Callable[[list[str]], str] = random.choice) -> str:
    """The URL of a Proxy of the least loaded set that serves ``workflow`` (arrival / capacity); with
    ``workflow`` None (a status or result look-up, which any Proxy answers), any registered Proxy."""
    state = _state(client, root)
    if workflow is None:
        every = all_proxies(client, root, state)
        if not every:
            raise NoProxy("no Proxy is registered in any workflow set")
        return rng(every)
    best: tuple[float, str] | None = None
    for name, s in sorted(state.items()):
        wf = s.get("workflows", {}).get(workflow, {})
        cap, arr = float(wf.get("capacity", 0.0)), float(wf.get("arrival", 0.0))
        if cap <= 0 or not s.get("proxies"):
            continue
        if best is None or arr / cap < best[0]:
            best = (arr / cap, name)
    if best is None:
        raise NoProxy(f"no workflow set has a Proxy and capacity for {workflow!r}")
    return rng(sorted(state[best[1]]["proxies"]))


def _state(client: Any, root: str | None) -> dict[str, Any]:
    return read_json(client, keyspace(root).sets_state()) or {}


def all_proxies(client: Any, root: str | None = None, state: dict[str, Any] | None = None) -> list[str]:
    """Every registered Proxy's URL (for look-ups, which any Proxy answers: try them in turn)."""
    state = _state(client, root) if state is None else state
    return sorted({u for s in state.values() for u in s.get("proxies", [])})


def register_proxy(client: Any, workflow_set: str, name: str, url: str, rps: Mapping[str, float],
                   lease: Any, root: str | None = None) -> None:
    """A Proxy's registration (refreshed with its accepted rates; gone with its lease)."""
    body = {"url": url, "set": workflow_set, "rps": dict(rps)}
    client.put(keyspace(root).proxy(workflow_set, name), json.dumps(body, sort_keys=True), lease=lease)
