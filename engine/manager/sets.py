"""Workflow Sets: regionally autonomous groups of nodes, each with its own Proxies and stage instances.

A request stays inside the set whose Proxy took it: every instance carries its
set, and route tables (a set's Proxies and workers) see only their set's
routes. Each node has a *home* set (``onepiece node --set``); the leading Node
Manager decides each node's *current* set and balances stages within a set
(Theorem 1 per set). It moves a node between sets only when a set is short
(arrival above ``SHORT`` of its capacity for some workflow) and another set
has a spare node (without it, that set still has ``SPARE`` headroom); a lent
node goes home once its host set no longer needs it. One move per tick, under
the manager's cooldown.

Keys the leading Node Manager writes for them (under the cluster root; built by :mod:`engine.coord.keys`)::

    sets/nodes/<node>        "<set>"        the node's current set (fenced; absent: its home set)
    sets/capacity/<set>/<wf> {"rps", ...}   the set's capacity for a workflow (fenced)
    sets/state               {set: {"nodes", "proxies", "workflows": {wf: {"capacity", "arrival"}}}}

The Proxies' registration and the platform's question, which Proxy to use for
a workflow, are coordination: :mod:`engine.coord.proxies`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

DEFAULT = "default"
SHORT = 0.9  # a set is short when arrival > SHORT x capacity for some workflow
SPARE = 0.75  # a node is spare when, without it, its set keeps arrival <= SPARE x capacity


def current_sets(home: Mapping[str, str], chosen: Mapping[str, str]) -> dict[str, str]:
    """Each live node's current set: the manager's choice where it made one, else the node's home set."""
    return {n: chosen.get(n, h) for n, h in home.items()}


def rebalance_sets(home: Mapping[str, str], current: Mapping[str, str],
                   capacity: Callable[[str, int], dict[str, float]],
                   arrival: Mapping[str, Mapping[str, float]]) -> tuple[str, str, str] | None:
    """At most one move: (node, from set, to set), or None.

    ``capacity(set, nodes)`` is each workflow's throughput the set would have with that many nodes;
    ``arrival[set][workflow]`` is what the set's Proxies accept per second.
    """
    members: dict[str, list[str]] = {}
    for n, s in sorted(current.items()):
        members.setdefault(s, []).append(n)

    def short(s: str, nodes: int) -> bool:
        cap = capacity(s, nodes)
        return any(a > SHORT * cap.get(w, 0.0) for w, a in arrival.get(s, {}).items() if a > 0)

    def roomy(s: str, nodes: int) -> bool:
        cap = capacity(s, nodes)
        return all(a <= SPARE * cap.get(w, 0.0) for w, a in arrival.get(s, {}).items() if a > 0)

    # a lent node goes home when its host set can do without it
    for n, s in sorted(current.items()):
        if s != home.get(n, s) and len(members[s]) > 1 and roomy(s, len(members[s]) - 1):
            return n, s, home[n]
    for s in sorted(members, key=lambda x: -max(arrival.get(x, {}).values(), default=0.0)):
        if not short(s, len(members[s])):
            continue
        for t in sorted(members):
            if t == s or len(members[t]) < 2 or not roomy(t, len(members[t]) - 1):
                continue
            # lend a node of the donor's own first (a node lent elsewhere already is on its way home)
            candidates = sorted(members[t], key=lambda n: (home.get(n) != t, n))
            return candidates[0], t, s
    return None
