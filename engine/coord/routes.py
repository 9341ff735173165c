"""Instance routes in etcd: where each stage instance's inbox ring listens.

Read from (keys: :mod:`engine.coord.keys`)::

    <root>/routes/<workflow>/<stage>/<instance>  {"address": "shm://...", "node": "...", "instance": "...",
                                                  "generation": <int>, "collab": ..., "set": ...,
                                                  "limits": {param: {"default", "maximum", "why"}}}
    <root>/capacity/<workflow>                   {"rps": ..., "mode": ..., "service_s": ...}: capacity the
                                                 Node Manager measured, and the workflow's scheduling mode
    <root>/sets/capacity/<set>/<workflow>        one Workflow Set's capacity

A TaskManager publishes a route once the instance's worker is ready and removes
it when the instance is stopped; routes are bound to the node's lease, so a
node that dies takes its routes with it. Readers (workers, the Proxy) keep a
:class:`RouteTable`: a cached copy kept by a background thread
(:meth:`RouteTable.start`), so the etcd round trip is never on a request's path.
The thread watches the three prefixes (:class:`engine.coord.watch.PrefixWatch`)
and applies each change from the watch's event itself (no read), and reads them
all again once every ``full_read_s`` (30 s) as a safety net: etcd's load is a
watch stream per prefix and reader and a read per reader every 30 s, not three
reads per reader and second (every worker and the Proxy polled every second
before, a load that grew with every instance added). When a watch cannot be opened or breaks
(etcd restarted, a member lost), the thread says so once and polls every
``refresh_s`` until a watch opens again. Without the thread (tests, tools) the
cache refreshes lazily, every ``refresh_s``.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.coord.keys import Keyspace, read_keys, read_prefix
from engine.coord.watch import Change, PrefixWatch, WatchEnded
from engine.workflow import limits as model_limits

log = logging.getLogger(__name__)
FULL_READ_S = 30.0  # the safety net under the watches: every prefix read again this often anyway

@dataclass(frozen=True)
class Route:
    """One instance of one stage: its id and its inbox ring's address.

    ``generation`` changes whenever the ring behind the address is a new one
    (the instance was removed and added again), never across a worker restart
    (the ring survives that): senders keep their producer while it is unchanged.
    """

    workflow: str
    stage: str
    instance: str
    address: str
    node: str = ""
    generation: int = 0
    collab: str = ""  # Collaboration mode: the ring where this instance takes (and answers) CFG halves
    workflow_set: str = "default"  # its Workflow Set: requests never leave the set whose Proxy took them
    # what the model this instance loaded allows (engine.workflow.limits): intake binds the spec to it
    limits: dict[str, dict[str, Any]] = field(default_factory=dict, compare=False, hash=False)
    max_message: int = 0  # the largest message its inbox ring takes (0: not published); intake checks every hop

    @property
    def ring_id(self) -> str:
        return f"{self.address}#{self.generation}"

    def to_json(self) -> str:
        return json.dumps({"address": self.address, "node": self.node, "instance": self.instance,
                           "generation": self.generation, "collab": self.collab, "set": self.workflow_set,
                           "limits": self.limits, "max_message": self.max_message})


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def publish_route(client: Any, route: Route, lease: Any = None, keys: Keyspace | None = None) -> None:
    keys = keys or Keyspace.from_env()
    client.put(keys.route(route.workflow, route.stage, route.instance), route.to_json(), lease=lease)


def withdraw_route(client: Any, route: Route, keys: Keyspace | None = None) -> None:
    keys = keys or Keyspace.from_env()
    client.delete(keys.route(route.workflow, route.stage, route.instance))


def live_nodes(client: Any, keys: Keyspace | None = None) -> set[str]:
    """Names of the nodes registered now (each key lives as long as its node's lease). Raises when etcd
    cannot be read: an unknown membership must never be taken for an empty one."""
    return read_keys(client, (keys or Keyspace.from_env()).nodes())  # names only: not every node's report


class RouteTable:
    """A cached view of every published route, refreshed from etcd at most every ``refresh_s``.

    ``candidates(workflow, stage)`` never blocks on etcd for longer than the
    client's timeout, and only when the cache is stale; when etcd cannot be
    reached the last known routes are kept (a control-plane outage must not
    stop the data path).
    """

    def __init__(self, client: Any, refresh_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 workflow_set: str | None = None, keys: Keyspace | None = None, watch: bool = True,
                 full_read_s: float = FULL_READ_S) -> None:
        self.client = client
        self.watch = watch  # False: the background thread polls every refresh_s (as before watches)
        self.full_read_s = full_read_s
        self._changed = threading.Event()  # a watch saw a change, or ended
        self.watching = False  # the thread keeps the cache from watches now (not polling)
        self.keys = keys or Keyspace.from_env()
        self._failing = False  # the last refresh failed (logged once per outage)
        self.workflow_set = workflow_set  # a set's Proxy or worker sees only that set's routes (None: all)
        self.refresh_s = refresh_s
        self.clock = clock
        self._routes: dict[tuple[str, str], list[Route]] = {}
        self._capacity: dict[str, float] = {}
        self._modes: dict[str, str] = {}
        self._service: dict[str, dict[str, float]] = {}  # workflow -> stage -> the stage time the NM used
        self._fetched = -1e18
        self._raw: dict[str, dict[str, Any]] = {}  # what the cache was built from: prefix -> {key: value}
        self._malformed: set[str] = set()  # routes whose published limits did not parse (logged once)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> RouteTable:
        """Refresh in a daemon thread from now on; reads then never wait for etcd."""
        if self._thread is None:
            self._try_refresh()
            self._thread = threading.Thread(target=self._loop, name="onepiece-routes", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._changed.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self.watch:
                try:
                    self._serve_watched()
                    continue  # stopped, or a watch went quiet: open them again
                except Exception as exc:  # etcd away, a member lost, a refused watch: poll meanwhile
                    log.warning("routes: etcd watch failed (%s); polling every %.1fs until a watch opens again",
                                exc, self.refresh_s)
            self._poll(self.full_read_s if self.watch else float("inf"))

    def _poll(self, for_s: float) -> None:
        """Read every ``refresh_s`` for ``for_s`` (then the watches are tried again)."""
        until = time.monotonic() + for_s
        while time.monotonic() < until and not self._stop.wait(self.refresh_s):
            self._try_refresh()

    def _prefixes(self) -> list[str]:
        found = [self.keys.routes(), self.keys.capacities()]
        return found + ([self.keys.set_capacities(self.workflow_set)] if self.workflow_set is not None else [])

    def _serve_watched(self) -> None:
        """Keep the cache from watches until stopped (returns), a watch goes quiet (returns: open them
        again) or one fails (raises :class:`WatchEnded`)."""
        watches: list[PrefixWatch] = []
        readers: list[threading.Thread] = []
        ended: list[WatchEnded] = []  # this round's: a reader of an earlier round, closed, may still append there
        changes: queue.SimpleQueue[tuple[str, list[Change]]] = queue.SimpleQueue()  # (prefix, its changes)
        try:
            for prefix in self._prefixes():
                watches.append(PrefixWatch(self.client, prefix, quiet_s=3 * self.full_read_s))
            self._changed.clear()
            for w in watches:
                readers.append(threading.Thread(target=self._read_watch, args=(w, changes, ended),
                                                name="onepiece-routes-watch", daemon=True))
                readers[-1].start()
            self._try_refresh()  # after the watches opened: a change between this read and them is not missed
            self.watching = True
            next_full = time.monotonic() + self.full_read_s
            while not self._stop.is_set():
                changed = self._changed.wait(max(0.0, next_full - time.monotonic()))
                self._changed.clear()
                if self._stop.is_set():
                    return
                if ended:
                    if all(e.quiet for e in ended):
                        return
                    raise next(e for e in ended if not e.quiet)
                if changed:
                    self._apply(changes)  # from the events themselves: no read
                else:
                    self._try_refresh()  # the safety net's time: the prefixes read again
                    next_full = time.monotonic() + self.full_read_s
        finally:
            self.watching = False
            for w in watches:
                w.close()
            for t in readers:  # each wakes from its closed stream at once
                t.join(timeout=5)

    def _apply(self, changes: queue.SimpleQueue[tuple[str, list[Change]]]) -> None:
        """The watches' changes, in their order, applied to a copy of what the cache was built from."""
        raw = {p: dict(v) for p, v in self._raw.items()}
        applied = 0
        while True:
            try:
                prefix, batch = changes.get_nowait()
            except queue.Empty:
                break
            kept = raw.setdefault(prefix, {})
            for c in batch:
                applied += 1
                name = c.key[len(prefix):]
                if c.value is None:
                    kept.pop(name, None)
                    continue
                try:
                    kept[name] = json.loads(c.value)
                except ValueError:  # as read_prefix does: a malformed value is left out, never fatal
                    log.warning("ignoring a malformed value at %s", c.key)
                    kept.pop(name, None)
        if applied:
            self._install(raw)

    def _read_watch(self, w: PrefixWatch, changes: queue.SimpleQueue[tuple[str, list[Change]]],
                    ended: list[WatchEnded]) -> None:
        try:
            for batch in w.changes():
                changes.put((w.prefix, batch))
                self._changed.set()
        except WatchEnded as exc:  # told to the serving loop, which decides: open again, or poll
            ended.append(exc)
        except Exception as exc:  # a bug in reading: the same, never a silently dead watch
            log.exception("routes: reading the watch on %s failed", w.prefix)
            ended.append(WatchEnded(f"{type(exc).__name__}: {exc}"))
        self._changed.set()

    def _try_refresh(self) -> None:
        try:
            self.refresh()
        except Exception as exc:  # etcd down or slow: keep serving from the cache
            if not self._failing:
                log.warning("routes: cannot read etcd (%s); serving the last known routes until it answers", exc)
            self._failing = True
        else:
            if self._failing:
                log.warning("routes: etcd answers again")
            self._failing = False

    def refresh(self) -> None:
        """Read every prefix again (start, the safety net, polling)."""
        self._install({p: read_prefix(self.client, p) for p in self._prefixes()})

    def _install(self, raw: dict[str, dict[str, Any]]) -> None:
        """Serve ``raw`` (prefix -> {key under it: parsed value}) from now on."""
        found: dict[tuple[str, str], list[Route]] = {}
        for name, data in raw.get(self.keys.routes(), {}).items():  # a malformed one is skipped
            parts = name.split("/")
            if len(parts) != 3 or not isinstance(data, dict):
                continue
            workflow, stage, instance = parts
            found.setdefault((workflow, stage), []).append(
                Route(workflow, stage, instance, str(data["address"]), str(data.get("node", "")),
                      int(data.get("generation", 0)), str(data.get("collab", "")), str(data.get("set", "default")),
                      self._parsed_limits(name, data.get("limits")), _int(data.get("max_message"))))
        if self.workflow_set is not None:
            found = {k: [r for r in rs if r.workflow_set == self.workflow_set] for k, rs in found.items()}
        for rs in found.values():
            rs.sort(key=lambda r: r.instance)
        capacity: dict[str, float] = {}
        modes: dict[str, str] = {}
        service: dict[str, dict[str, float]] = {}
        for workflow, body in raw.get(self.keys.capacities(), {}).items():
            try:
                capacity[workflow] = float(body["rps"])
                modes[workflow] = str(body.get("mode", "individual"))
                service[workflow] = {str(k): float(v) for k, v in dict(body.get("service_s") or {}).items()}
            except (ValueError, KeyError, TypeError, AttributeError):
                continue
        if self.workflow_set is not None:  # a set's own capacity, where the Node Manager published one
            for workflow, body in raw.get(self.keys.set_capacities(self.workflow_set), {}).items():
                try:
                    capacity[workflow] = float(body["rps"])
                except (ValueError, KeyError, TypeError):
                    continue
        with self._lock:
            self._raw = raw
            self._routes = found
            self._capacity = capacity
            self._modes = modes
            self._service = service
            self._fetched = self.clock()

    def mode(self, workflow: str) -> str:
        """The workflow's scheduling mode the Node Manager published: "individual" (the default) or
        "collaboration"."""
        with self._lock:
            return self._modes.get(workflow, "individual")

    def capacity(self, workflow: str) -> float | None:
        """Requests/s the Node Manager measured ``workflow`` sustains now, if it published one."""
        with self._lock:
            return self._capacity.get(workflow)

    def _parsed_limits(self, name: str, raw: Any) -> dict[str, dict[str, Any]]:
        found = model_limits.parse(raw) if raw is not None else {}
        if found is None:
            if name not in self._malformed:  # said once per route: the spec's own bounds apply meanwhile
                self._malformed.add(name)
                log.warning("routes: %s publishes malformed model limits %r; the spec's own apply", name, raw)
            return {}
        return found

    def limits(self, workflow: str) -> dict[str, dict[str, Any]] | None:
        """The loaded model's parameter limits for ``workflow``: the strictest over its published instances
        (they normally load one folder), None when no instance published any."""
        with self._lock:
            found = None
            for (wf, _stage), rs in self._routes.items():
                if wf == workflow:
                    for r in rs:
                        found = model_limits.merge(found, r.limits or None)
            return found

    def max_message(self, workflow: str, stage: str) -> int | None:
        """The largest message every published instance of ``stage`` takes (None: none published one)."""
        with self._lock:
            sizes = [r.max_message for r in self._routes.get((workflow, stage), ()) if r.max_message]
        return min(sizes) if sizes else None

    def base_latency(self, workflow: str) -> float:
        """Seconds ``workflow`` takes through an idle pipeline: the sum of the stage times the Node
        Manager published with its capacity (0 when it published none)."""
        with self._lock:
            return sum(self._service.get(workflow, {}).values())

    def candidates(self, workflow: str, stage: str, *, fresh: bool = False) -> list[Route]:
        """The published instances of ``stage`` (possibly empty), sorted by instance id."""
        if fresh or (self._thread is None and self.clock() - self._fetched > self.refresh_s):
            self._try_refresh()
        with self._lock:
            return list(self._routes.get((workflow, stage), ()))

    def wait_for(self, workflow: str, stage: str, timeout: float) -> list[Route]:
        """Poll until ``stage`` has at least one route (start-up); empty after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.candidates(workflow, stage, fresh=True)
            if found or time.monotonic() >= deadline:
                return found
            time.sleep(0.1)
