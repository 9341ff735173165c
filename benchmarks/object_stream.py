"""A streamed video's fragments as parts while it decodes (issue 38): the time from the final chunk to the
completed job, streamed parts against the ordinary upload at the end, side by side in one run.

What runs is what the last stage's receiver does (engine.worker.chunks.Receiver), on a real redis-server and
the embedded Swift s3api server (what ``onepiece up`` starts), with the default part size (8 MiB, S3's
minimum 5 MiB kept): a synthetic video of SIZE bytes (random bytes under an mp4 ``ftyp`` head: an H.264
stream does not compress further) cut into fragments of 64 KiB, fed in ``--chunks`` chunks.

- ``streamed``: each chunk's fragments written to the job's result writer (``JobStore.result_writer``) as
  they come; at the final chunk, its fragments written, the writer finished (the last part, the completion)
  and ``JobStore.finish(completed, result=video, uploaded=ref)`` (the size and sha256 checked, the reference
  recorded);
- ``at finish``: nothing sent while chunks come; at the final chunk, ``JobStore.finish(completed,
  result=video)`` (one PUT up to 256 MiB, ``ONEPIECE_OBJECT_MULTIPART_BYTES``).

Timed: from the final chunk's arrival to ``finish`` returning (the job completed, its output in the store).
The chunks before it arrive ``--chunk-every`` seconds apart (the decoder's pace: the load model; 0: back to
back, the worst case for streaming, where the writer waits on the store for its queue), the same on both
sides. Sides interleaved round by round, their order rotated, medians.

    OMP_NUM_THREADS=1 python benchmarks/object_stream.py [--sizes 33554432,67108864] [--rounds 5]

Figures: benchmarks/object_delivery.md ("5. Streamed parts"); the JSON goes to
benchmarks/object_delivery/<date>-stream.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MiB = 1 << 20
FRAGMENT = 64 << 10
WORKFLOW, STAGE = "wan2.1-t2v", "video_encode"


def synthetic_chunks(size: int, chunks: int) -> list[list[bytes]]:
    """``size`` random bytes under an mp4 ``ftyp`` head, as ``chunks`` lists of 64 KiB fragments."""
    head = b"\x00\x00\x00\x18ftypisom\x00\x00\x02\x00isomiso2"
    data = head + os.urandom(size - len(head))
    frags = [data[i:i + FRAGMENT] for i in range(0, size, FRAGMENT)]
    per = -(-len(frags) // chunks)
    return [frags[i:i + per] for i in range(0, len(frags), per)]


PENDING: list[int] = []  # the streamed side's parts not uploaded yet when its final chunk arrived


def side(store: Any, chunks: list[list[bytes]], every_s: float, streamed: bool) -> float:
    """One job through the last stage's end: seconds from the final chunk to the completed job."""
    from engine.store import keys

    uid = uuid.uuid4().hex
    store.accept(uid, WORKFLOW, 1.0)
    writer = store.result_writer(uid) if streamed else None
    for chunk in chunks[:-1]:
        if writer is not None:
            for piece in chunk:
                writer.write(piece)
        time.sleep(every_s)  # the decoder's pace between chunks (the load model, not an event)
    t0 = time.perf_counter()
    if writer is not None:
        PENDING.append(writer.pending)
        for piece in chunks[-1]:
            writer.write(piece)
    video = b"".join(p for c in chunks for p in c)  # VideoChunks.finish's join: on both sides
    ref = writer.finish() if writer is not None else None
    assert store.finish(uid, WORKFLOW, keys.COMPLETED, STAGE, result=video, uploaded=ref)
    took = time.perf_counter() - t0
    got = store.result_ref(uid)
    assert got is not None and got.size == len(video) and (ref is None or got == ref)
    store.drop_results([uid])
    return took


def interleaved(sides: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each side's seconds over ``rounds`` rounds (one warm-up round first, not kept), order rotated."""
    names = list(sides)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 1):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            took = sides[name]()
            if r:
                times[name].append(took)
    return times


def measure(store: Any, size: int, args: argparse.Namespace, every_s: float) -> dict[str, Any]:
    chunks = synthetic_chunks(size, args.chunks)
    PENDING.clear()
    times = interleaved({"streamed": lambda: side(store, chunks, every_s, True),
                         "at finish": lambda: side(store, chunks, every_s, False)}, args.rounds)
    med = {n: statistics.median(v) * 1000 for n, v in times.items()}
    row = {"bytes": size, "chunks": len(chunks), "chunk_every_s": every_s, "final_chunk_to_completed_ms":
           {n: round(v, 1) for n, v in med.items()}, "all_ms": {n: [round(x * 1000, 1) for x in v]
                                                              for n, v in times.items()},
           "streamed_over_at_finish": round(med["streamed"] / med["at finish"], 3),
           "streamed_parts_pending_at_final_chunk": PENDING[1:]}  # the warm-up round's left out
    print(f"{size:>11,} B, {len(chunks)} chunks {every_s} s apart: streamed {med['streamed']:.0f} ms, "
          f"at finish {med['at finish']:.0f} ms ({row['streamed_over_at_finish']:.2f}x); parts pending at the "
          f"final chunk {PENDING[1:]}", flush=True)
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine import envs
    from engine.embedded.s3 import SwiftS3Server
    from engine.embedded.services import RedisServer
    from engine.store import JobStore
    from engine.store.objects import ObjectStore

    with tempfile.TemporaryDirectory(prefix="os-") as tmp:
        redis_server = RedisServer(envs.REDIS_SERVER_BIN, Path(tmp) / "redis").start()
        s3 = SwiftS3Server(Path(tmp) / "s3").start()
        try:
            objects = ObjectStore.from_url(s3.url)
            store = JobStore.from_url(redis_server.url, ttl=600, objects=objects)
            rows = [measure(store, size, args, every) for every in args.chunk_every for size in args.sizes]
            out = {"part_size": objects.part_size, "multipart_threshold": objects.multipart_threshold,
                   "fragment_bytes": FRAGMENT, "rounds": args.rounds, "rows": rows}
            store.close()
        finally:
            s3.stop()
            redis_server.stop()
    return out


def main() -> int:
    from engine.bench.figures import provenance
    from engine.bench.harness import write_result

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=lambda t: [int(x) for x in t.split(",") if x], default=[32 * MiB, 64 * MiB])
    p.add_argument("--chunks", type=int, default=21, help="chunks a video arrives in (Wan 81 frames: 1 + 20x4)")
    p.add_argument("--chunk-every", type=lambda t: [float(x) for x in t.split(",") if x], default=[0.25, 0.0],
                   help="seconds between chunks, comma-separated: one run per value")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    args.out = args.out or REPO / "benchmarks" / "object_delivery" / f"{dt.date.today()}-stream.json"
    before = provenance()
    result = run(args)
    return write_result(result, before, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
