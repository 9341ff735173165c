"""A job's live previews on Redis: one capped stream per job (``keys.preview_key``), never the ring.

The worker's publisher (:class:`engine.worker.previews.Previews`) writes them; the Proxy's and the
platform's preview routes and the job's websocket read them. A stream only takes a later step than it
holds, in one script, so the two Wan2.2 A14B expert workers writing one job's previews cannot put them
out of step order whichever writes last; it expires with the job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.store import keys

# a job's preview: appended only after a smaller step (KEYS: the preview stream;
# ARGV: step, stage, total, image, mime, entries kept, ttl)
_ADD_PREVIEW = """
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if last[1] then
  local f = last[1][2]
  for i = 1, #f, 2 do
    if f[i] == 'step' and tonumber(f[i + 1]) >= tonumber(ARGV[1]) then return false end
  end
end
local id = redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[6], '*', 'stage', ARGV[2], 'step', ARGV[1],
                      'total', ARGV[3], 'image', ARGV[4], 'mime', ARGV[5])
redis.call('EXPIRE', KEYS[1], ARGV[7])
return id
"""


@dataclass(frozen=True)
class Preview:
    """One live preview of a job (engine.stages.preview): after ``step`` of ``total`` of ``stage``; ``id``: its
    stream entry's id (read on after it)."""

    id: str
    stage: str
    step: int
    total: int
    image: bytes
    mime: str = "image/png"

    def meta(self) -> dict[str, Any]:
        """The preview without its bytes."""
        return {"id": self.id, "stage": self.stage, "step": self.step, "total": self.total, "mime": self.mime}


def _preview(entry_id: bytes | str, f: Mapping[bytes, bytes]) -> Preview:
    sid = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return Preview(sid, f[b"stage"].decode(), int(f[b"step"]), int(f[b"total"]), bytes(f[b"image"]),
                   f.get(b"mime", b"image/png").decode())


class PreviewStore:
    """Jobs' preview streams on ``client`` (a ``redis.Redis``), expiring after ``ttl`` seconds like the job."""

    #: previews kept per job (a stream capped at about this many; readers want the latest, the socket the rest)
    KEPT = 32

    def __init__(self, client: Any, ttl: int) -> None:
        self.r, self.ttl = client, ttl
        self._add = client.register_script(_ADD_PREVIEW)

    def add(self, uid: str, stage: str, step: int, total: int, image: bytes, mime: str = "image/png") -> str | None:
        """Append a preview to the job's stream and renew its TTL, in one script; None (nothing written)
        when the stream already holds a later step: two stages' workers (the Wan2.2 experts) write one
        job's previews, and the stream stays in step order whichever writes last."""
        entry = self._add(keys=[keys.preview_key(uid)],
                          args=[int(step), stage, int(total), bytes(image), mime, self.KEPT, self.ttl])
        if not entry:
            return None
        return entry.decode() if isinstance(entry, bytes) else str(entry)

    def latest(self, uid: str) -> Preview | None:
        """The job's newest preview, or None (none yet, previews off, or expired)."""
        rows = self.r.xrevrange(keys.preview_key(uid), count=1)
        return _preview(*rows[0]) if rows else None

    def since(self, uid: str, after: str = "0-0", block_ms: int | None = None, count: int = 16) -> list[Preview]:
        """The job's previews after entry ``after``, oldest first; waits up to ``block_ms`` for one."""
        rows = self.r.xread({keys.preview_key(uid): after}, count=count, block=block_ms)
        return [_preview(i, f) for _k, entries in rows for i, f in entries]
