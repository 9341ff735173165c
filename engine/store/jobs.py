"""The result store and the job-event stream, on Redis.

Contract:
  * every accepted UID gets a status hash (``keys.job_key``) and an ``accepted``
    event; it then reaches exactly one terminal state, whatever the number of
    workers that race to finish it: terminal transitions run as one Lua script
    that refuses to leave a terminal state;
  * the result bytes are written only by the transition to ``completed``, so a
    redelivered or recomputed request can never produce a second result or a
    second ``completed`` event;
  * everything expires (``ttl``): Redis holds transient state, the platform's
    database ledger is the truth about jobs;
  * with an object store (``objects``, :mod:`engine.store.objects`), the
    result's bytes go there, uploaded by the worker before the transition,
    and Redis keeps only their reference (key, size, sha256); the object
    outlives Redis and its TTL, and :meth:`JobStore.result` finds it by the
    UID when Redis has forgotten the job.

Events go to one stream (``keys.EVENTS``, capped at ``maxlen`` entries) with
the fields uid, type, stage, progress, ts, detail and attempt (1 + the times
the job was started again after its node was lost). The stream is a complete
timeline: every stage run writes ``stage_started`` and then ``stage_finished``
(or ``stage_stopped``), the last stage included, before the job's terminal
event; a timeline event written after the terminal transition (a stage that
finished while a cancel landed) is still appended, only progress is dropped
and the status hash no longer moves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from string import Template
from typing import TYPE_CHECKING, Any

from engine.store import keys
from engine.store.instances import InstanceStats
from engine.store.previews import PreviewStore

log = logging.getLogger("onepiece.store")

if TYPE_CHECKING:
    from engine.store.objects import ObjectRef, ObjectStore, PartWriter


def _lua(script: str) -> str:
    """A Lua script with the job states' names (keys.JobState) filled in: ``$finished`` is the test that the
    state ``s`` is terminal, ``$completed`` (and each other state by its name) the quoted name."""
    names = {state.value: f"'{state.value}'" for state in keys.JobState}
    finished = " or ".join(f"s == {names[state]}" for state in keys.JobState if state in keys.TERMINAL)
    return Template(script).substitute(names, finished=finished)


def _stream_id(entry_id: str) -> tuple[int, int]:
    """A stream entry id (``ms-seq``) as a pair that orders as Redis orders ids."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


ENDINGS_MAXLEN = 10_000  # terminal events kept in keys.ENDINGS: a long poll's waker needs only the recent ones

# Non-terminal events: the status hash moves only while the job is not finished, so a late progress
# report cannot make a cancelled job look alive again; timeline events (ARGV[10] = '1') are appended to
# the stream even then, so every stage run that happened is on record.
_EVENT = _lua("""
local s = redis.call('HGET', KEYS[1], 'state')
local attempt = 1 + tonumber(redis.call('HGET', KEYS[1], 'attempts') or '0')
if $finished then
  if ARGV[10] ~= '1' then return 0 end
elseif ARGV[7] ~= '' then
  redis.call('HSET', KEYS[1], 'state', ARGV[7], 'stage', ARGV[3], 'progress', ARGV[4], 'updated', ARGV[5])
  redis.call('EXPIRE', KEYS[1], ARGV[8])
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[9], '*', 'uid', ARGV[1], 'type', ARGV[2], 'stage', ARGV[3],
           'progress', ARGV[4], 'ts', ARGV[5], 'detail', ARGV[6], 'attempt', attempt)
return 1
""")

# Terminal transition (+ the result for ``completed``), at most once per UID. A completed event carries the
# output's description (ARGV[11], ObjectRef JSON: key, size, sha256, content type; key '' when inline) in its
# ``output`` field, for the platform's ledger.
_FINISH = _lua("""
local s = redis.call('HGET', KEYS[1], 'state')
if $finished then return 0 end
if ARGV[2] == $completed then
  redis.call('SET', KEYS[4], ARGV[9], 'EX', ARGV[7])
end
redis.call('HSET', KEYS[1], 'state', ARGV[2], 'stage', ARGV[3], 'progress', ARGV[4], 'updated', ARGV[5],
           'detail', ARGV[6])
redis.call('EXPIRE', KEYS[1], ARGV[7])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[5])
if ARGV[2] == $completed then redis.call('INCR', KEYS[6]) end
local attempt = 1 + tonumber(redis.call('HGET', KEYS[1], 'attempts') or '0')
local fields = {'uid', ARGV[1], 'type', ARGV[2], 'stage', ARGV[3], 'progress', ARGV[4], 'ts', ARGV[5],
                'detail', ARGV[6], 'attempt', attempt}
if ARGV[11] ~= '' then
  table.insert(fields, 'output')
  table.insert(fields, ARGV[11])
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[8], '*', unpack(fields))
redis.call('XADD', KEYS[7], 'MAXLEN', '~', ARGV[10], '*', 'uid', ARGV[1], 'type', ARGV[2])
return 1
""")

# Accept a job: claim the UID (at most once), its status hash, its in-flight entry, its input and its
# ``accepted`` event, in one round trip. KEYS: job, inflight, input, events; ARGV: uid, workflow, cost, now,
# detail, ttl, maxlen, message ('' for none), has_message.
_ACCEPT = _lua("""
if redis.call('HSETNX', KEYS[1], 'state', $queued) == 0 then return 0 end
if ARGV[9] == '1' then redis.call('SET', KEYS[3], ARGV[8], 'EX', ARGV[6]) end
redis.call('HSET', KEYS[1], 'state', $queued, 'workflow', ARGV[2], 'stage', '', 'progress', 0, 'created', ARGV[4],
           'updated', ARGV[4], 'detail', ARGV[5], 'cost', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[7], '*', 'uid', ARGV[1], 'type', 'accepted', 'stage', '',
           'progress', 0, 'ts', ARGV[4], 'detail', ARGV[5], 'attempt', 1)
return 1
""")

# A worker's check before it runs a stage, and (ARGV[7] = '1') the stage's start when the job may run: not
# finished, the stage not already done, no cancel asked. KEYS: job, done marker, cancel flag, events; ARGV:
# uid, stage, progress, now, ttl, maxlen, start. Returns {state or '', done, cancel, started}.
_GATE = _lua("""
local s = redis.call('HGET', KEYS[1], 'state')
local done = redis.call('EXISTS', KEYS[2])
local cancel = redis.call('EXISTS', KEYS[3])
local finished = $finished
if ARGV[7] == '1' and not finished and done == 0 and cancel == 0 then
  local attempt = 1 + tonumber(redis.call('HGET', KEYS[1], 'attempts') or '0')
  redis.call('HSET', KEYS[1], 'state', $in_progress, 'stage', ARGV[2], 'progress', ARGV[3], 'updated', ARGV[4])
  redis.call('EXPIRE', KEYS[1], ARGV[5])
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[6], '*', 'uid', ARGV[1], 'type', 'stage_started', 'stage', ARGV[2],
             'progress', ARGV[3], 'ts', ARGV[4], 'detail', '', 'attempt', attempt)
  return {s or '', done, cancel, 1}
end
return {s or '', done, cancel, 0}
""")

# Start a job again after its node was lost: only if it is unfinished and still where the caller saw it
# (so two Proxies sweeping at once retry it once), at most ARGV[5] times. Returns {1, message} to
# re-inject, {2} when out of attempts, {0} when someone else moved or finished it.
_RETRY = _lua("""
local s = redis.call('HGET', KEYS[1], 'state')
if not s or $finished then return {0} end
if redis.call('HGET', KEYS[1], 'node') ~= ARGV[2] then return {0} end
local n = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
if n > tonumber(ARGV[5]) then return {2} end
local msg = redis.call('GET', KEYS[3])
if not msg then return {2} end
for i = 4, #KEYS do redis.call('DEL', KEYS[i]) end
redis.call('HSET', KEYS[1], 'state', $queued, 'stage', '', 'progress', 0, 'updated', ARGV[3], 'detail', ARGV[4],
           'node', '', 'instance', '')
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', 'uid', ARGV[1], 'type', 'retried', 'stage', '',
           'progress', 0, 'ts', ARGV[3], 'detail', ARGV[4], 'attempt', n + 1)
return {1, msg}
""")


def _described(result: bytes | bytearray | memoryview | None, ref: ObjectRef | None) -> str:
    """The completed event's ``output`` field: the stored object's reference, or (an inline result) the same
    description with no key; '' for no result."""
    if ref is not None:
        return ref.to_json()
    if result is None:
        return ""
    import hashlib

    from engine.store.objects import ObjectRef, sniff_content_type

    view = memoryview(result).cast("B")
    return ObjectRef("", view.nbytes, hashlib.sha256(view).hexdigest(), sniff_content_type(view)).to_json()


@dataclass(frozen=True)
class Orphan:
    """An unfinished job last handed to an instance on a node that is gone."""

    uid: str
    workflow: str
    node: str
    instance: str
    stage: str


@dataclass(frozen=True)
class JobStatus:
    """What the status hash says about one UID."""

    uid: str
    state: str
    workflow: str
    stage: str
    progress: int
    created: float
    updated: float
    detail: str

    @property
    def terminal(self) -> bool:
        return self.state in keys.TERMINAL

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class JobStore:
    """Results, status hashes, events, cancel flags and in-flight costs of jobs.

    ``client`` is a ``redis.Redis`` (bytes responses). Thread-safe as far as
    the client is (redis-py's connection pool is).
    """

    def __init__(self, client: Any, ttl: int = 3600, events_maxlen: int = 100_000,
                 objects: ObjectStore | None = None, inline_bytes: int = 0,
                 endings_maxlen: int = ENDINGS_MAXLEN) -> None:
        self.r = client
        self.objects = objects  # None: results' bytes in Redis (--object-store none)
        if int(inline_bytes) < 0:
            raise ValueError(f"inline_bytes must be 0 or more, not {inline_bytes}")
        # with a store, results under this many bytes stay in Redis (ONEPIECE_OBJECT_INLINE_BYTES): faster, and
        # lost with Redis (docs/operations.md, "Object storage for outputs")
        self.inline_bytes = int(inline_bytes)
        self.ttl = int(ttl)
        self.maxlen = int(events_maxlen)
        self.endings_maxlen = int(endings_maxlen)  # keys.ENDINGS' cap (a benchmark scales it with the others)
        self._event = client.register_script(_EVENT)
        self._finish = client.register_script(_FINISH)
        self._retry = client.register_script(_RETRY)
        self._accept = client.register_script(_ACCEPT)
        self._gate = client.register_script(_GATE)
        self.preview = PreviewStore(client, self.ttl)  # jobs' live previews (engine.store.previews)
        self.instances = InstanceStats(client)  # stage instances' counters (engine.store.instances)

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> JobStore:
        import redis

        return cls(redis.Redis.from_url(url), **kwargs)

    def close(self) -> None:
        self.r.close()
        if self.objects is not None:
            self.objects.close()

    # -- intake --------------------------------------------------------------------------
    def accept(self, uid: str, workflow: str, cost: float, detail: str = "",
               message: bytes | None = None) -> bool:
        """Record a newly accepted job (state ``queued``) and count its cost as in flight; ``message``
        (the request as it enters the first stage) is kept until the job finishes, for :meth:`retry`.

        Returns False (and records nothing) when ``uid`` is already taken: a caller-chosen UID (the
        platform names its jobs) is claimed once.
        """
        args: list[Any] = [uid, workflow, repr(float(cost)), repr(time.time()), detail, self.ttl, self.maxlen,
                           bytes(message) if message is not None else b"", "1" if message is not None else "0"]
        ks = [keys.job_key(uid), keys.inflight_key(workflow), keys.input_key(uid), keys.EVENTS]
        return bool(self._accept(keys=ks, args=args))  # one round trip (was two: the claim, then the rest)

    def drain_sample(self, workflows: list[str]) -> dict[str, tuple[int, int]]:
        """workflow -> (jobs in flight, jobs completed since the store began): one round trip, for the
        Proxy's :class:`engine.proxy.drain.DrainMeter`."""
        pipe = self.r.pipeline(transaction=False)
        for wf in workflows:
            pipe.zcard(keys.inflight_key(wf))
            pipe.get(keys.finished_key(wf))
        out = pipe.execute()
        return {wf: (int(out[2 * i] or 0), int(out[2 * i + 1] or 0)) for i, wf in enumerate(workflows)}

    def inflight(self, workflow: str) -> tuple[int, float]:
        """(jobs, predicted GPU-seconds) accepted for ``workflow`` and not yet finished."""
        entries = self.r.zrange(keys.inflight_key(workflow), 0, -1, withscores=True)
        return len(entries), float(sum(score for _, score in entries))

    def prune_inflight(self, workflows: list[str]) -> int:
        """Drop in-flight entries whose job is gone (its status hash expired or was lost with Redis) or
        finished; returns how many. Such an entry would count against admission for ever. Race-free:
        :meth:`accept` writes the hash and the entry in one transaction, and the terminal transition
        removes the entry in the same script that finishes the job."""
        return self.sweep_inflight(workflows, None)[0]

    def sweep_inflight(self, workflows: list[str], live_nodes: set[str] | None) -> tuple[int, list[Orphan]]:
        """(in-flight entries dropped, as :meth:`prune_inflight`; :meth:`orphans` among ``live_nodes``, none
        when None) in one pass over the in-flight sets: two round trips for every workflow together (three
        when something is dropped), what a Proxy's sweep costs every second."""
        pipe = self.r.pipeline(transaction=False)
        for wf in workflows:
            pipe.zrange(keys.inflight_key(wf), 0, -1)
        listed = [(wf, u.decode()) for wf, uids in zip(workflows, pipe.execute(), strict=True) for u in uids]
        if not listed:
            return 0, []
        pipe = self.r.pipeline(transaction=False)
        for _, uid in listed:
            pipe.hmget(keys.job_key(uid), "state", "node", "instance", "stage")
        stale: dict[str, list[str]] = {}
        orphans = []
        for (wf, uid), (state, node, instance, stage) in zip(listed, pipe.execute(), strict=True):
            if state is None or state.decode() in keys.TERMINAL:
                stale.setdefault(wf, []).append(uid)
                continue
            node_s = node.decode() if node else ""
            if live_nodes is not None and node_s and node_s not in live_nodes:
                orphans.append(Orphan(uid, wf, node_s, instance.decode() if instance else "",
                                      stage.decode() if stage else ""))
        dropped = 0
        if stale:
            pipe = self.r.pipeline(transaction=False)
            for wf, uids in stale.items():
                pipe.zrem(keys.inflight_key(wf), *uids)
            dropped = sum(int(n) for n in pipe.execute())
        return dropped, orphans

    # -- events ----------------------------------------------------------------------------
    def event(self, uid: str, type_: str, stage: str = "", progress: int = 0, detail: str = "",
              state: str = "") -> bool:
        """Append a non-terminal event; with ``state``, also update the status hash.

        When the job already finished, a timeline event (stage started, finished or stopped) is still
        appended (the status hash stays as it is); anything else is dropped and False returned.
        """
        if type_ not in keys.EVENT_TYPES or type_ in keys.TERMINAL:
            raise ValueError(f"not a non-terminal event type: {type_!r}")
        timeline = "1" if type_ in keys.TIMELINE else "0"
        args = [uid, type_, stage, int(progress), time.time(), detail, state, self.ttl, self.maxlen, timeline]
        return bool(self._event(keys=[keys.job_key(uid), keys.EVENTS], args=args))

    def finish(self, uid: str, workflow: str, state: str, stage: str = "", detail: str = "",
               result: bytes | bytearray | memoryview | None = None, uploaded: ObjectRef | None = None) -> bool:
        """Move the job to terminal ``state`` (with ``result`` for ``completed``); at most once.

        Returns True if this call made the transition, False if the job had
        already finished (the result, if any, is then not written).

        With an object store the result is uploaded first (its own object for this attempt) and only its
        reference goes into Redis with the transition; an upload that fails raises
        (:class:`engine.store.objects.ObjectStoreError`) and the job is not completed, and an attempt that
        loses the race to finish deletes its own object. ``uploaded``: the result is in the store already
        (streamed while it was made, :meth:`result_writer`): recorded without a second upload once its size
        and sha256 are the result's; else it is deleted, the difference logged, and the result uploaded as
        without it (the stream is an optimisation, never a reason to lose the result).
        """
        if state not in keys.TERMINAL:
            raise ValueError(f"not a terminal state: {state!r}")
        if (state == keys.COMPLETED) != (result is not None):
            raise ValueError("a result goes with the completed state, and only with it")
        ref = None
        if uploaded is not None:
            ref = self._streamed(uid, result, uploaded)
            if ref is None:
                return False
        elif result is not None and self.stores(result):
            if self._field(uid, "state") in keys.TERMINAL:
                return False  # already finished: nothing to upload
            ref = self._upload(uid, result)
        progress = 100 if state == keys.COMPLETED else int(self._field(uid, "progress") or 0)
        value = ref.to_json().encode() if ref is not None else bytes(result) if result is not None else b""
        args: list[Any] = [uid, state, stage, progress, time.time(), detail, self.ttl, self.maxlen, value,
                           self.endings_maxlen, _described(result, ref)]
        ks = [keys.job_key(uid), keys.EVENTS, keys.inflight_key(workflow),
              keys.result_ref_key(uid) if ref is not None else keys.result_key(uid), keys.input_key(uid),
              keys.finished_key(workflow), keys.ENDINGS]
        made = bool(self._finish(keys=ks, args=args))
        if ref is not None and not made and self.objects is not None:
            self.objects.delete(ref)  # another attempt finished the job: its object is the result
        return made

    def stores(self, result: bytes | bytearray | memoryview) -> bool:
        """Whether ``result`` goes to the object store (a store is configured and it is not under
        ``inline_bytes``) rather than into Redis."""
        return self.objects is not None and memoryview(result).nbytes >= self.inline_bytes

    def result_writer(self, uid: str) -> PartWriter | None:
        """A writer of this attempt's result object as the result is made (its parts uploaded as they fill,
        :meth:`engine.store.objects.ObjectStore.stream`), for :meth:`finish`'s ``uploaded``; None without
        an object store."""
        import secrets

        from engine.store.objects import result_key

        return None if self.objects is None else self.objects.stream(result_key(uid, secrets.token_hex(8)))

    def _streamed(self, uid: str, result: bytes | bytearray | memoryview | None, uploaded: ObjectRef) -> ObjectRef | None:
        """``uploaded`` when it is ``result`` byte for byte (size and sha256) and the job is not finished yet;
        None (the object deleted) when it is finished; when they differ, the object deleted, the difference
        logged and the result uploaded the ordinary way (its new reference)."""
        import hashlib

        if self.objects is None or result is None:
            raise ValueError("an uploaded result needs an object store and the result it is")
        if self._field(uid, "state") in keys.TERMINAL:
            self.objects.delete(uploaded)  # already finished: its result is another attempt's
            return None
        view = memoryview(result).cast("B")
        digest = hashlib.sha256(view).hexdigest()
        if (view.nbytes, digest) == (uploaded.size, uploaded.sha256):
            return uploaded
        self.objects.delete(uploaded)
        log.error("job %s: the streamed result %r is not its result (%d bytes, sha256 %s..., against %d bytes, "
                  "sha256 %s...); uploading the result instead", uid, uploaded.key, uploaded.size,
                  uploaded.sha256[:16], view.nbytes, digest[:16])
        return self._upload(uid, result)

    def _upload(self, uid: str, result: bytes | bytearray | memoryview) -> ObjectRef:
        import secrets

        from engine.store.objects import result_key, sniff_content_type

        assert self.objects is not None
        return self.objects.put(result_key(uid, secrets.token_hex(8)), result, sniff_content_type(result))

    # -- where jobs are, and jobs whose node was lost -----------------------------------------------
    def located(self, uid: str, node: str, instance: str) -> None:
        """Record the instance (and its node) a job was just handed to."""
        self.r.hset(keys.job_key(uid), mapping={"node": node, "instance": instance})

    def orphans(self, workflows: list[str], live_nodes: set[str]) -> list[Orphan]:
        """Unfinished jobs whose last hand-off went to a node not in ``live_nodes`` (finished ones' in-flight
        entries are dropped on the way: :meth:`sweep_inflight`)."""
        return self.sweep_inflight(workflows, live_nodes)[1]

    def retry(self, orphan: Orphan, stages: list[str], max_attempts: int) -> bytes | None:
        """Claim ``orphan`` for a fresh start (its per-stage done markers cleared, a ``retried`` event);
        returns the message to re-inject, or None when it was already moved, finished, or is out of
        attempts (:attr:`Orphan` then still names the lost node: the caller fails it with the reason)."""
        detail = (f"node {orphan.node} was lost while the job was at {orphan.instance or orphan.stage or 'intake'}; "
                  f"started again")
        ks = [keys.job_key(orphan.uid), keys.EVENTS, keys.input_key(orphan.uid),
              *(keys.done_key(orphan.uid, s) for s in stages)]
        got = self._retry(keys=ks, args=[orphan.uid, orphan.node, time.time(), detail, max_attempts, self.maxlen])
        if int(got[0]) == 1:
            return bytes(got[1])
        if int(got[0]) == 2:
            self.finish(orphan.uid, orphan.workflow, keys.FAILED, orphan.stage,
                        detail=f"node {orphan.node} was lost while the job was at {orphan.instance or orphan.stage}; "
                               f"gave up after {max_attempts} attempts")
        return None

    def read_events(self, after: str, block_ms: int, count: int = 1000,
                    stream: str = keys.EVENTS) -> tuple[str, list[dict[str, str]]]:
        """(the id to read after next, the events written after ``after``), waiting up to ``block_ms`` for
        the first (``after`` "$": only new ones). One blocking read serves every waiter of a process.
        ``stream``: ``keys.ENDINGS`` for the terminal events alone (uid and type)."""
        if after == "$":  # from what is the end now: a concrete id, so nothing written meanwhile is skipped
            last = self.r.xrevrange(stream, count=1)
            after = (last[0][0].decode() if isinstance(last[0][0], bytes) else last[0][0]) if last else "0-0"
        entries = self.read_entries(after, block_ms, count, stream)
        return (entries[-1][0] if entries else after), [fields for _, fields in entries]

    def read_entries(self, after: str, block_ms: int | None, count: int = 1000,
                     stream: str = keys.EVENTS) -> list[tuple[str, dict[str, str]]]:
        """The events written after the stream id ``after``, with their ids (a reader that keeps its own
        cursor, like the platform's reconciler); waits up to ``block_ms`` for the first (None: not at all)."""
        resp = self.r.xread({stream: after}, count=count, block=block_ms)
        out: list[tuple[str, dict[str, str]]] = []
        for _, entries in resp or ():
            for eid, fields in entries:
                out.append((eid.decode() if isinstance(eid, bytes) else eid,
                            {(k.decode() if isinstance(k, bytes) else k):
                             (v.decode(errors="replace") if isinstance(v, bytes) else v) for k, v in fields.items()}))
        return out

    def lost_after(self, after: str, stream: str = keys.EVENTS) -> str | None:
        """The oldest event the stream holds, when the stream no longer holds a reader's cursor ``after``: its
        cap (``maxlen``) trimmed the cursor away, or Redis restarted, so events after the cursor may be gone
        unread (None: the cursor is still there, or is "0-0" and nothing was ever trimmed). Trimming takes the
        oldest events first, so a reader that keeps up never meets it. A cursor trimmed exactly up to the event
        after it is reported though nothing after it was lost; Redis before 7.0 has no ``entries-added``, so a
        cursor at "0-0" is never reported there. One ``XINFO STREAM``."""
        import redis.exceptions

        try:
            info = self.r.xinfo_stream(stream)
        except redis.exceptions.ResponseError:  # no such stream (nothing written yet, or Redis restarted)
            return None
        first = (info.get("first-entry") or (None,))[0]
        if first is None:
            return None
        first = first.decode() if isinstance(first, bytes) else first
        if _stream_id(first) <= _stream_id(after):
            return None
        trimmed = int(info.get("entries-added", 0)) > int(info.get("length", 0))
        return first if after != "0-0" or trimmed else None

    def events(self, uid: str | None = None, count: int = 10_000) -> list[dict[str, str]]:
        """Events in stream order (all jobs, or one UID's); a convenience for tests and tools."""
        out = []
        for _id, fields in self.r.xrange(keys.EVENTS, count=count):
            e = {k.decode(): v.decode() for k, v in fields.items()}
            if uid is None or e["uid"] == uid:
                out.append(e)
        return out

    # -- status, results, cancel --------------------------------------------------------------
    def status(self, uid: str) -> JobStatus | None:
        h = self.r.hgetall(keys.job_key(uid))
        if not h:
            return None
        g = {k.decode(): v.decode() for k, v in h.items()}
        return JobStatus(uid, g.get("state", ""), g.get("workflow", ""), g.get("stage", ""),
                         int(float(g.get("progress", 0))), float(g.get("created", 0)),
                         float(g.get("updated", 0)), g.get("detail", ""))

    def state(self, uid: str) -> str | None:
        v = self._field(uid, "state")
        return v or None

    def result(self, uid: str) -> bytes | None:
        """The job's result bytes: from Redis, or from the object store by the reference Redis keeps, or (Redis
        has forgotten the job: a restart, the TTL) from the store by the UID alone. None when none is found."""
        raw, ref = self.r.mget(keys.result_key(uid), keys.result_ref_key(uid))
        if raw is not None:
            return raw
        found = self.result_ref(uid, ref)
        return self.objects.get(found) if found is not None and self.objects is not None else None

    def result_ref(self, uid: str, raw: bytes | None | bool = False) -> ObjectRef | None:
        """Where the job's result is in the object store (key, size, sha256), or None (no store, a result
        kept in Redis, none yet). ``raw``: the reference as already read from Redis (False: read it)."""
        from engine.store.objects import ObjectRef, result_prefix

        if self.objects is None:
            return None
        if raw is False:
            raw = self.r.get(keys.result_ref_key(uid))
        if raw:
            return ObjectRef.from_json(raw)
        if self.r.exists(keys.result_key(uid)):
            return None
        return self.objects.newest(result_prefix(uid))

    def drop_results(self, uids: Iterable[str], chunk: int = 500, freed: dict[str, int] | None = None) -> int:
        """Delete these jobs' result bytes now instead of at their TTL; returns how many existed.

        ``UNLINK`` in commands of ``chunk`` keys: Redis frees the bytes (a video is megabytes) in a
        background thread, and no single command holds the server while thousands go. ``freed``, when given,
        gets the object store's deleted ``objects`` and their ``bytes`` added to it."""
        dropped = 0
        batch: list[str] = []
        for uid in uids:
            batch.append(keys.result_key(uid))
            if len(batch) >= chunk:
                dropped += self._unlink_results(batch, freed)
                batch = []
        if batch:
            dropped += self._unlink_results(batch, freed)
        return dropped

    def _unlink_results(self, result_keys: list[str], freed: dict[str, int] | None = None) -> int:
        """UNLINK result keys and their streamed copies (engine.store.fragments), and delete every object of
        those jobs in the object store (found by the UID: also once Redis forgot the reference, and an
        attempt's orphan); how many results existed."""
        uids = [k.rsplit(":", 1)[1] for k in result_keys]
        stored = 0
        if self.objects is not None:
            from engine.store.objects import result_prefix

            for u in uids:
                n, size = self.objects.purge(result_prefix(u))
                stored += n > 0
                if freed is not None:
                    freed["objects"] = freed.get("objects", 0) + n
                    freed["bytes"] = freed.get("bytes", 0) + size
        pipe = self.r.pipeline(transaction=False)
        pipe.unlink(*result_keys)
        pipe.unlink(*(keys.fragments_key(u) for u in uids))
        if self.objects is not None:
            pipe.unlink(*(keys.result_ref_key(u) for u in uids))
        return int(pipe.execute()[0]) + stored

    def request_cancel(self, uid: str) -> None:
        """Flag ``uid`` so that the worker running it stops at its next step check."""
        self.r.set(keys.cancel_key(uid), 1, ex=self.ttl)

    def cancel_requested(self, uid: str) -> bool:
        return bool(self.r.exists(keys.cancel_key(uid)))

    # -- worker bookkeeping -------------------------------------------------------------------
    def gate(self, uid: str, stage: str, start_progress: int | None = None) -> tuple[str | None, bool, bool, bool]:
        """(state, ``stage`` done, cancel requested, started) in one round trip: what a worker checks before it
        runs a stage. With ``start_progress``, the same script also starts the stage when the job may run (not
        finished, the stage not done, no cancel): the ``stage_started`` event at that progress, as
        :meth:`event` writes it, and ``started`` True; one round trip for both."""
        ks = [keys.job_key(uid), keys.done_key(uid, stage), keys.cancel_key(uid), keys.EVENTS]
        args = [uid, stage, int(start_progress or 0), time.time(), self.ttl, self.maxlen,
                "1" if start_progress is not None else "0"]
        state, done, cancel, started = self._gate(keys=ks, args=args)
        state = state.decode() if isinstance(state, bytes) else state
        return state or None, bool(done), bool(cancel), bool(started)

    def mark_done(self, uid: str, stage: str) -> None:
        self.r.set(keys.done_key(uid, stage), 1, ex=self.ttl)

    def handed_on(self, uid: str, stage: str, node: str, instance: str) -> None:
        """A stage handed the job to ``instance`` on ``node``: where to look if that node dies
        (:meth:`located`), and the stage's done marker (:meth:`mark_done`), in one round trip."""
        pipe = self.r.pipeline(transaction=False)
        pipe.hset(keys.job_key(uid), mapping={"node": node, "instance": instance})
        pipe.set(keys.done_key(uid, stage), 1, ex=self.ttl)
        pipe.execute()

    def is_done(self, uid: str, stage: str) -> bool:
        return bool(self.r.exists(keys.done_key(uid, stage)))

    # -- helpers ----------------------------------------------------------------------------------
    def _field(self, uid: str, name: str) -> str:
        v = self.r.hget(keys.job_key(uid), name)
        return v.decode() if v is not None else ""

    @staticmethod
    def _fields(uid: str, type_: str, stage: str, progress: int, ts: float, detail: str) -> dict[str, Any]:
        return {"uid": uid, "type": type_, "stage": stage, "progress": progress, "ts": ts, "detail": detail}
