"""A job's streamed result: its fragments (init segment, then ``moof``+``mdat`` pieces of a fragmented mp4) in
one Redis stream per job, written once each by sequence number and read while it grows.

Contract:
  * entry ``seq`` (0, 1, ...) has the stream id ``<seq + 1>-0``: :meth:`Fragments.append` writes it only when
    it is the next one, so a fragment is never written twice nor out of order; a repeat (a restarted mp4
    worker encodes the same frames again) is accepted as a no-op only when its digest equals what is there,
    any other repeat or a gap is refused (:class:`FragmentMismatch`) and its job must fail, never stream
    a corrupt file;
  * the writer ends the stream with an ``end`` entry before it completes the job, so a reader that saw it has
    every fragment, and one that sees the job end without it reports a clean error (:class:`StreamFailed`);
  * bounded: at most :data:`MAX_FRAGMENTS` entries per job (one per chunk of frames), expiring with the
    result (the store's ``ttl``) and dropped with it (``JobStore.drop_results``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

from engine.store import keys

MAX_FRAGMENTS = 4096

# KEYS: the job's fragment stream; ARGV: seq, entry id, data, digest, ttl, end flag, max. Returns 1 (written),
# 0 (the same entry was there), -1 (another entry was there), -2 (a gap), -3 (over the bound).
_APPEND = """
local n = redis.call('XLEN', KEYS[1])
local seq = tonumber(ARGV[1])
if seq >= tonumber(ARGV[7]) then return -3 end
if seq < n then
  local e = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
  if e[1] and e[1][2][2] == ARGV[4] then return 0 end
  return -1
end
if seq > n then return -2 end
redis.call('XADD', KEYS[1], ARGV[2], 'sha', ARGV[4], 'end', ARGV[6], 'data', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return 1
"""


class FragmentMismatch(RuntimeError):
    """A fragment that does not continue the job's stream (another one under its number, or a gap)."""


class StreamFailed(Exception):
    """The job ended without completing its stream: ``state`` (failed, cancelled, expired, ...) and why."""

    def __init__(self, state: str, detail: str) -> None:
        super().__init__(f"{state}: {detail}")
        self.state, self.detail = state, detail


class Fragments:
    """The per-job fragment streams over a :class:`engine.store.JobStore` (its client and TTL)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._append = store.r.register_script(_APPEND)

    def append(self, uid: str, seq: int, data: bytes, end: bool = False) -> bool:
        """Write fragment ``seq`` (``end``: the end marker, no data); False when it was already there."""
        digest = hashlib.sha256(data).hexdigest() + ("e" if end else "")
        got = int(self._append(keys=[keys.fragments_key(uid)],
                               args=[seq, f"{seq + 1}-0", bytes(data), digest, self.store.ttl,
                                     "1" if end else "0", MAX_FRAGMENTS]))
        if got < 0:
            why = {-1: "another fragment is stored under that number", -2: "the fragments before it are missing",
                   -3: f"a job streams at most {MAX_FRAGMENTS} fragments"}[got]
            raise FragmentMismatch(f"fragment {seq} of {uid}: {why}")
        return got == 1

    def end(self, uid: str, seq: int) -> bool:
        """Mark the stream complete after ``seq`` fragments."""
        return self.append(uid, seq, b"", end=True)

    def count(self, uid: str) -> int:
        return int(self.store.r.xlen(keys.fragments_key(uid)))

    def read(self, uid: str, after: str, block_ms: int | None) -> list[tuple[str, bytes, bool]]:
        """(entry id, data, end) of the entries after ``after`` ("0-0": from the first), waiting up to
        ``block_ms`` for one (None: not at all)."""
        rows = self.store.r.xread({keys.fragments_key(uid): after}, count=64, block=block_ms)
        out = []
        for _key, entries in rows or ():
            for eid, f in entries:
                out.append((eid.decode() if isinstance(eid, bytes) else eid, bytes(f[b"data"]), f[b"end"] == b"1"))
        return out

    def iter(self, uid: str, wait_s: float = 0.5) -> Iterator[bytes]:
        """The job's streamed result, each fragment as it is written, until its end marker. A job that
        completed without fragments (another workflow, or its stream expired before the result) yields its
        result in one piece; one that ends otherwise raises :class:`StreamFailed` (so does an unknown job)."""
        after, seen = "0-0", False
        while True:
            rows = self.read(uid, after, int(wait_s * 1000))
            if not rows:  # quiet for wait_s: has the job ended? (then one last look, for what came meanwhile)
                st = self.store.status(uid)
                if st is None:
                    raise StreamFailed("not_found", "no such job (or it expired)")
                if not st.terminal:
                    continue
                rows = self.read(uid, after, None)
                if not rows:
                    yield from self._ended(uid, st, seen)
                    return
            for eid, data, end in rows:
                if end:
                    return
                after, seen = eid, True
                yield data

    def _ended(self, uid: str, st: Any, seen: bool) -> Iterator[bytes]:
        if st.state != keys.COMPLETED:
            raise StreamFailed(st.state, st.detail or f"the job is {st.state}")
        result = None if seen else self.store.result(uid)
        if result is None:
            raise StreamFailed("incomplete", "the job completed but its stream is incomplete (expired or dropped)")
        yield result
