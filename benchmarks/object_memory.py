"""Redis's memory while videos complete through the object store, and the outputs after Redis is killed
(issue 38, goal "Redis's memory stays flat (within 10%) while 200 videos of the default size complete; each
output is in the store and downloadable after a Redis SIGKILL").

The video is the default wan2.1-t2v request's on the tiny model, made once by the stages themselves
(``object_delivery.default_video``). The jobs then go through the completion path directly, as a last stage's
worker and the stages before it write them to a real redis-server, with the embedded Swift s3api server as the
store: ``accept`` (with the request message), per stage ``stage_started``, a progress event per reported denoise
step, ``stage_finished`` and the hand-off record, then ``finish(completed, result=video)`` (the upload, then the
reference) and the done marker. 200 real jobs would take 200 x ~20 s of this 2-core host's CPU (the tiny
model's vae_decode alone is 6-12 s here) and add nothing to what is measured: the bytes that reach Redis are the
same. Each job's video is the real one with an MP4 ``free`` box of its own appended (a box players skip), so
every output is distinct and reading one back proves it is that job's.

Side by side, on a second redis-server, the same jobs on today's Redis-only path (no store), the bytes in Redis.

``used_memory`` (INFO memory) is sampled before the first job (after ``--warm`` jobs, which load the scripts
and create the streams) and after every ``--every`` jobs. With ``ONEPIECE_OBJECT_INLINE_BYTES`` at its default
(256 KiB) the tiny default video (about 205 KB) would stay in Redis; the store path is taken with it at 0, as
it is for every video over 256 KiB (a real Wan2.1 default video is larger). Then: Redis is killed (SIGKILL),
started again empty (no persistence, as ``onepiece up`` runs it), and every output is read back from the store
by the key its completed event recorded (what the ledger keeps), checked against the recorded sha256, and
fetched once more through a presigned URL; the Proxy's fallback (``JobStore.result``, which finds the newest
object under the UID when Redis knows nothing) is checked for each too.

Two ways to start. By default from a near-empty Redis with the deployment's defaults (TTL 3600 s, the event
stream capped at 100,000 entries): every job's metadata is still there at the end, so the growth is its size.
With ``--steady-ttl S --rate R``: Redis in its steady state, as a deployment completing R jobs a second holds
it, scaled down so that it is reached in minutes: the keys expire after S seconds and the two streams are
capped at what S seconds of jobs write (``caps_for``: the stream's window equals the TTL's); ``2 R S`` jobs
bring Redis there first, then the ``--jobs`` measured ones, all paced at R a second on each side.

    OMP_NUM_THREADS=1 python benchmarks/object_memory.py [--jobs 200] [--steady-ttl 50 --rate 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import struct
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from object_delivery import REPO, WORKFLOW, default_video  # benchmarks/ is not a package

STAGES = ["text_encode", "denoise", "vae_decode", "video_encode"]


def unique(video: bytes, n: int) -> bytes:
    """``video`` with a ``free`` box of its own appended: a distinct, still valid MP4."""
    payload = f"onepiece bench job {n} ".encode() + os.urandom(16)
    return video + struct.pack(">I", 8 + len(payload)) + b"free" + payload


def one_job(js: Any, video: bytes, steps: int, reported: int) -> tuple[str, str]:
    """One job's writes to Redis, in the order the engine makes them; (uid, the completed event's output)."""
    from engine.store import keys

    uid = uuid.uuid4().hex
    message = json.dumps({"workflow": WORKFLOW, "params": {"prompt": "a lighthouse at dusk"}}).encode()
    js.accept(uid, WORKFLOW, 7.0, message=message)
    for i, st in enumerate(STAGES):
        js.event(uid, keys.STAGE_STARTED, st, 25 * i, state=keys.IN_PROGRESS)
        if st == "denoise":
            for k in range(1, reported + 1):
                step = max(1, steps * k // reported)
                js.event(uid, keys.PROGRESS, st, 25 + 25 * step // steps, detail=f"step {step}/{steps}",
                         state=keys.IN_PROGRESS)
        js.event(uid, keys.STAGE_FINISHED, st, 25 * (i + 1), detail="0.100s")
        if st != STAGES[-1]:
            js.handed_on(uid, st, "bench", f"{WORKFLOW}.{STAGES[i + 1]}.0")
    assert js.finish(uid, WORKFLOW, keys.COMPLETED, STAGES[-1], result=video)
    js.mark_done(uid, STAGES[-1])
    return uid, completed_output(js, uid)


def completed_output(js: Any, uid: str) -> str:
    """The ``output`` field of ``uid``'s completed event (the newest events are read, not the whole stream)."""
    from engine.store import keys

    for _id, fields in js.r.xrevrange(keys.EVENTS, count=20):
        e = {k.decode(): v.decode() for k, v in fields.items()}
        if e["uid"] == uid and e["type"] == keys.COMPLETED:
            return e["output"]
    raise AssertionError(f"no completed event for {uid}")


def used(js: Any) -> int:
    return int(js.r.info("memory")["used_memory"])


def complete_many(sides: dict[str, Any], video: bytes, jobs: int, every: int, warm: int,
                  steps: int, reported: int, rate: float = 0.0) -> tuple[dict[str, Any], dict[str, str]]:
    """``jobs`` jobs through each side, interleaved (``rate``: this many a second on each side, paced, as
    jobs complete in a deployment; 0: as fast as they go), after ``warm`` jobs the same way; the memory curve
    per side, and the store side's uid -> recorded output (JSON)."""
    empty = {name: used(js) for name, js in sides.items()}
    pace = Pace(rate)
    for n in range(warm):
        pace.wait()
        for js in sides.values():
            one_job(js, unique(video, -1 - n), steps, reported)
    curve: dict[str, list[tuple[int, int]]] = {name: [(0, used(js))] for name, js in sides.items()}
    recorded: dict[str, str] = {}
    t0 = time.perf_counter()
    for n in range(1, jobs + 1):
        pace.wait()
        data = unique(video, n)
        for name, js in sides.items():
            uid, output = one_job(js, data, steps, reported)
            if name == "store":
                recorded[uid] = output
        if n % every == 0 or n == jobs:
            for name, js in sides.items():
                curve[name].append((n, used(js)))
    took = time.perf_counter() - t0
    out: dict[str, Any] = {name: curve_figures(points, empty[name], jobs) for name, points in curve.items()}
    out["store"]["flat_within_10pct"] = out["store"]["growth_ratio"] <= 1.10
    out["seconds"] = round(took, 1)
    out["jobs_per_s_per_side"] = round(jobs / took, 2)
    return out, recorded


class Pace:
    """Starts jobs at ``rate`` a second (0: no pacing); a start that fell behind goes at once, and the
    schedule is kept (the rate over the run is the rate asked, when the host can keep it)."""

    def __init__(self, rate: float) -> None:
        self.period = 1.0 / rate if rate > 0 else 0.0
        self.next = time.monotonic()

    def wait(self) -> None:
        if self.period:
            delay = self.next - time.monotonic()
            if delay > 0:
                time.sleep(delay)  # a benchmark's pacing: jobs arrive at a set rate
            self.next += self.period


def curve_figures(points: list[tuple[int, int]], empty: int, jobs: int) -> dict[str, Any]:
    """The memory curve's figures: growth over the run from its baseline (the first point), its spread
    (largest over smallest point) and the bytes each job added."""
    base = points[0][1]
    peak = max(b for _, b in points)
    low = min(b for _, b in points)
    return {"used_memory": points, "empty_bytes": empty, "baseline_bytes": base, "peak_bytes": peak,
            "low_bytes": low, "growth_bytes": peak - base, "growth_ratio": round(peak / base, 4),
            "spread_ratio": round(peak / low, 4), "end_over_baseline": round(points[-1][1] / base, 4),
            "per_job_bytes": round((points[-1][1] - base) / jobs)}


def where_memory_goes(js: Any, uid: str) -> dict[str, int]:
    """MEMORY USAGE of one finished job's keys and of the shared streams (bytes)."""
    from engine.store import keys

    names = {"status hash": keys.job_key(uid), "result reference": keys.result_ref_key(uid),
             "result bytes": keys.result_key(uid), "events stream (all jobs)": keys.EVENTS,
             "endings (all jobs)": keys.ENDINGS}
    out = {name: int(js.r.memory_usage(k) or 0) for name, k in names.items()}
    out["done markers"] = sum(int(js.r.memory_usage(keys.done_key(uid, s)) or 0) for s in STAGES)
    out["result_bytes_keys_count (every job)"] = sum(1 for _ in js.r.scan_iter(match=keys.result_key("*"), count=1000))
    return out


def after_kill(redis_server: Any, url: str, objects: Any, recorded: dict[str, str]) -> dict[str, Any]:
    """SIGKILL Redis, start it again (empty), and read every recorded output back from the store."""
    from engine.store import JobStore
    from engine.store.objects import ObjectRef, ObjectStore

    redis_server.proc.kill()  # SIGKILL
    redis_server.proc.wait(10)
    redis_server.start()
    js = JobStore.from_url(url, ttl=600, objects=ObjectStore(objects.config))
    keys_after = int(js.r.dbsize())
    ok = {"by_recorded_key": 0, "presigned_url": 0, "proxy_fallback": 0}
    bad: list[str] = []
    for uid, raw in recorded.items():
        ref = ObjectRef.from_json(raw)
        got = js.objects.get(ref)
        if got is not None and len(got) == ref.size and hashlib.sha256(got).hexdigest() == ref.sha256:
            ok["by_recorded_key"] += 1
        else:
            bad.append(uid)
        with urllib.request.urlopen(js.objects.presign_get(ref, 600).url, timeout=30) as r:
            ok["presigned_url"] += hashlib.sha256(r.read()).hexdigest() == ref.sha256
        fallback = js.result(uid)
        ok["proxy_fallback"] += fallback is not None and hashlib.sha256(fallback).hexdigest() == ref.sha256
    js.close()
    return {"redis_keys_after_restart": keys_after, "outputs": len(recorded), "read_back": ok,
            "missing_or_wrong": bad, "all_downloadable": all(v == len(recorded) for v in ok.values())}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine import envs
    from engine.embedded.s3 import SwiftS3Server
    from engine.embedded.services import RedisServer
    from engine.stages.tiny import models_or_tiny
    from engine.store import JobStore, keys
    from engine.store.objects import ObjectStore

    with models_or_tiny(args.models, [WORKFLOW]) as folder:
        video, made = default_video(Path(folder))
    print(f"default video: {made['size']}, {made['bytes']:,} bytes", flush=True)
    with tempfile.TemporaryDirectory(prefix="object-memory-") as tmp:
        r_store = RedisServer(envs.REDIS_SERVER_BIN, Path(tmp) / "redis-store").start()
        r_plain = RedisServer(envs.REDIS_SERVER_BIN, Path(tmp) / "redis-plain").start()
        s3 = SwiftS3Server(Path(tmp) / "s3").start()
        try:
            objects = ObjectStore.from_url(s3.url)
            objects.ensure_bucket()
            caps = caps_for(args)
            sides = {"store": JobStore.from_url(r_store.url, objects=objects, inline_bytes=0, **caps),
                     "redis": JobStore.from_url(r_plain.url, **caps)}
            memory, recorded = complete_many(sides, video, args.jobs, args.every, args.warm, made["steps"],
                                             args.reported_steps, args.rate)
            memory["caps"] = caps
            if args.steady_ttl:
                for name, js in sides.items():
                    m = memory[name]
                    # jobs whose keys the steady state holds: the status hashes there are at the end
                    m["jobs_held_at_end"] = sum(1 for _ in js.r.scan_iter(match=keys.job_key("*"), count=1000))
                    mean = sum(b for _, b in m["used_memory"]) / len(m["used_memory"])
                    m["steady_per_job_bytes"] = round((mean - m["empty_bytes"]) / m["jobs_held_at_end"])
            last = list(recorded)[-1]
            memory["store"]["one_job_keys"] = where_memory_goes(sides["store"], last)
            plain_uid = sides["redis"].r.xrevrange(keys.EVENTS, count=1)[0][1][b"uid"].decode()
            memory["redis"]["one_job_keys"] = where_memory_goes(sides["redis"], plain_uid)
            for js in sides.values():
                js.r.close()
            killed = after_kill(r_store, r_store.url, objects, recorded)
        finally:
            s3.stop()
            r_store.stop()
            r_plain.stop()
    return {"video": made, "jobs": args.jobs, "warm_jobs": args.warm, "reported_denoise_steps": args.reported_steps,
            "rate_per_side": args.rate, "steady_ttl_s": args.steady_ttl, "memory": memory, "after_sigkill": killed}


def events_per_job(reported: int) -> int:
    """Stream entries :func:`one_job` writes: accepted, a start and an end per stage, the progress, completed."""
    return 2 + 2 * len(STAGES) + reported


def caps_for(args: argparse.Namespace) -> dict[str, int]:
    """The JobStore's TTL and stream caps. Near-empty run: the deployment defaults (TTL 3600 s, 100,000
    events, ENDINGS_MAXLEN endings). Steady state (``--steady-ttl S`` at ``--rate R``): a deployment of that
    rate scaled down: the TTL S, and both streams capped at what S seconds of jobs write, so the stream's
    window equals the TTL's, as a deployment's 100,000 events equal its 3600 s TTL at 1.4 jobs a second."""
    from engine.store.jobs import ENDINGS_MAXLEN

    if not args.steady_ttl:
        return {"ttl": 3600, "events_maxlen": 100_000, "endings_maxlen": ENDINGS_MAXLEN}
    alive = round(args.rate * args.steady_ttl)
    return {"ttl": int(args.steady_ttl), "events_maxlen": alive * events_per_job(args.reported_steps),
            "endings_maxlen": alive}


def main() -> int:
    from engine.bench.figures import provenance
    from engine.bench.harness import write_result

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=200)
    p.add_argument("--every", type=int, default=20, help="sample used_memory after every this many jobs")
    p.add_argument("--warm", type=int, default=None, help="jobs before the baseline (default 3: scripts loaded, "
                   "streams made; with --steady-ttl, twice the jobs of a TTL: keys expire, streams at their caps)")
    p.add_argument("--steady-ttl", type=int, default=0,
                   help="seconds: measure Redis in its steady state (keys expiring at this TTL, streams at their "
                        "caps scaled to it: caps_for); 0: from a near-empty Redis with the deployment's defaults")
    p.add_argument("--rate", type=float, default=0.0,
                   help="jobs a second on each side, paced (required with --steady-ttl; 0: as fast as they go)")
    p.add_argument("--reported-steps", type=int, default=10,
                   help="progress events per denoise stage (the worker reports at most one per progress interval)")
    p.add_argument("--models", default=None, help="a folder with wan2.1-t2v/ (default: tiny models built here)")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "object_delivery" / f"{dt.date.today()}-memory.json")
    args = p.parse_args()
    if args.steady_ttl and args.rate <= 0:
        p.error("--steady-ttl needs --rate")
    if args.warm is None:
        args.warm = round(2 * args.rate * args.steady_ttl) if args.steady_ttl else 3
    before = provenance()
    result = run(args)
    for name in ("store", "redis"):
        m = result["memory"][name]
        print(f"{name:6}: used_memory {m['baseline_bytes']:,} -> peak {m['peak_bytes']:,} bytes over {args.jobs} "
              f"jobs ({m['growth_ratio']:.3f}x, spread {m['spread_ratio']:.3f}x, {m['per_job_bytes']:,} bytes per job"
              + (f"; steady: {m['steady_per_job_bytes']:,} bytes per live job" if args.steady_ttl else "") + ")")
    k = result["after_sigkill"]
    print(f"after SIGKILL: Redis restarted with {k['redis_keys_after_restart']} keys; read back {k['read_back']} "
          f"of {k['outputs']}; all downloadable: {k['all_downloadable']}")
    return write_result(result, before, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
