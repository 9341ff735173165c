"""What delivering an output through the object store costs (issue 38, goal "delivery costs little").

Two figures, each side by side in one run against the same real servers (the embedded Swift s3api server that
``onepiece up`` starts, and a real redis-server), the sides interleaved round by round (their order rotated),
so the load of a shared host falls on all of them alike:

- ``upload``: the engine's upload path (``ObjectStore.put``, as the last stage's worker calls it through
  ``JobStore.finish``: Content-MD5 and the sha256 computed, one PUT up to ``ONEPIECE_OBJECT_MULTIPART_BYTES``,
  256 MiB by default, 8 MiB parts beyond, four in flight) against raw boto3 sending the same bytes to the same
  bucket: ``upload_fileobj`` (boto3's managed transfer, multipart over 8 MiB, 10 parts in flight) and
  ``put_object`` (one request). Also ``engine, 16 MiB threshold``: the engine's path with the threshold it had
  before (parts over 16 MiB), the before/after of the threshold. Throughput is bytes / median seconds; goal:
  the engine at least 0.5x raw boto3. ``--upload-only`` measures this alone (``--store URL``: against another
  store instead of the embedded Swift, to choose the threshold there).
- ``completion``: for the default wan2.1-t2v video on the tiny model (made once here, in this process, by
  the stages themselves: ``engine.stages.runner.LocalRunner``), the time from the last denoise step to a
  downloadable URL, store path against today's Redis-only path. The two paths differ only in the completion
  step, so that step is what is timed, round after round: ``JobStore.finish(completed, result=video)`` (the
  upload and the reference, or the bytes in Redis) and then what a URL costs (the status read and the
  presigned GET of the Proxy's ``/result/url``; on the Redis path the status read and the platform's HMAC
  signature); each URL is then fetched and checked (untimed). The rest of the span (the denoise stage's
  hand-off, vae_decode, video_encode) is the same code on both paths; it is timed once, from the last
  denoise step's progress callback to the finished video, and added to both. Goal: store / Redis at most 1.1x.
  Side ``store, default threshold``: a store configured with the default ``ONEPIECE_OBJECT_INLINE_BYTES``
  (256 KiB), under which the tiny default video (about 205 KB) stays in Redis.
- ``real_path`` (``--real-path-jobs N``, 0: none): the same span on the real path, as a check: two engines side by
  side (each a redis, an etcd, one ``onepiece node`` serving wan2.1-t2v and one ``onepiece proxy``), one with the
  store and one Redis-only, N default jobs a side, alternating; from each job's events, its last denoise progress
  event to its completed event, plus the ``/result/url`` call. The span's spread on a shared host is far wider
  than what the store adds, which is why the direct measurement above is the figure for the goal.

    OMP_NUM_THREADS=1 python benchmarks/object_delivery.py [--rounds 11] [--real-path-jobs 5] [--out FILE]

Figures and how they were taken: benchmarks/object_delivery.md; the JSON goes to
benchmarks/object_delivery/<date>.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import hmac
import io
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MiB = 1 << 20
UPLOAD_SIZES = [1 * MiB, 4 * MiB, 16 * MiB, 24 * MiB, 64 * MiB, 128 * MiB, 256 * MiB]  # and the default video's, first
BEFORE_THRESHOLD = 16 * MiB  # the multipart threshold before ONEPIECE_OBJECT_MULTIPART_BYTES (parts over it)
COMPLETION_SIZES = [4 * MiB, 32 * MiB]  # after the real video: what larger videos would add (synthetic bytes)
WORKFLOW = "wan2.1-t2v"


# -- the default video, made once ----------------------------------------------------------------------------
def default_video(folder: Path) -> tuple[bytes, dict[str, Any]]:
    """The default wan2.1-t2v request's video from ``folder/wan2.1-t2v`` (the tiny model: ``models_or_tiny``),
    and how it was made: its size, its stages' seconds, and ``after_last_step_s``, the seconds from the last
    denoise step's callback to the finished video."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("MKL_NUM_THREADS", "1")
    import torch

    from engine.stages.runner import LocalRunner, validate_request

    torch.set_num_threads(1)
    params = validate_request(WORKFLOW, folder / WORKFLOW, {"prompt": "a lighthouse at dusk"}, {})
    runner = LocalRunner(WORKFLOW, folder / WORKFLOW, "cpu")
    last_step: list[float] = []

    def progress(stage: str, step: int, total: int) -> None:
        if stage == "denoise" and step == total:
            last_step.append(time.perf_counter())

    result = runner.run(params, {}, progress=progress)
    done = time.perf_counter()
    video = bytes(result.outputs[runner.spec.final_output])
    return video, {
        "workflow": WORKFLOW, "model": str(folder / WORKFLOW), "bytes": len(video),
        "size": f"{params['width']}x{params['height']}x{params['num_frames']}",
        "steps": params["num_inference_steps"], "sha256": hashlib.sha256(video).hexdigest(),
        "stage_compute_s": {k: round(s.compute_s, 4) for k, s in result.stats.items()},
        "after_last_step_s": round(done - last_step[-1], 4)}


def synthetic(size: int) -> bytes:
    """``size`` random bytes under an MP4 ``ftyp`` head (so both sides send the content type of a video)."""
    head = b"\x00\x00\x00\x18ftypisom\x00\x00\x02\x00isomiso2"
    return head + os.urandom(size - len(head))


def interleaved(sides: dict[str, Callable[[int], Any]], rounds: int) -> dict[str, list[Any]]:
    """Each side's seconds (or what it measures) over ``rounds`` rounds (one warm-up round first, not kept); the order of the sides
    rotates every round, so none is always first after another's work."""
    names = list(sides)
    times: dict[str, list[Any]] = {n: [] for n in names}
    for r in range(rounds + 1):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            took = sides[name](r)
            if r:
                times[name].append(took)
    return times


# -- (a) upload throughput ---------------------------------------------------------------------------------
def raw_client(store: Any) -> Any:
    """A plain boto3 client on the same server and credentials: boto3's defaults but for the checksums
    (botocore's newer CRC trailers are refused by Swift, as for the engine's own client)."""
    import boto3
    from botocore.config import Config

    c = store.config
    return boto3.session.Session().client(
        "s3", endpoint_url=c.endpoint, region_name=c.region, aws_access_key_id=c.access_key,
        aws_secret_access_key=c.secret_key,
        config=Config(signature_version="s3v4", s3={"addressing_style": c.addressing},
                      request_checksum_calculation="when_required", response_checksum_validation="when_required"))


def upload_sides(store: Any, before: Any, raw: Any, data: bytes) -> dict[str, Callable[[int], float]]:
    """name -> one upload of ``data`` (its seconds; the object deleted afterwards, untimed)."""
    bucket = store.config.bucket

    def timed(send: Callable[[str], Any]) -> Callable[[int], float]:
        def one(r: int) -> float:
            key = f"bench/{uuid.uuid4().hex}"
            t0 = time.perf_counter()
            send(key)
            took = time.perf_counter() - t0
            raw.delete_object(Bucket=bucket, Key=key)
            return took
        return one

    return {"engine": timed(lambda k: store.put(k, data, "video/mp4")),
            "engine, 16 MiB threshold": timed(lambda k: before.put(k, data, "video/mp4")),
            "boto3 upload_fileobj": timed(lambda k: raw.upload_fileobj(io.BytesIO(data), bucket, k)),
            "boto3 put_object": timed(lambda k: raw.put_object(Bucket=bucket, Key=k, Body=data))}


def measure_upload(store: Any, before: Any, raw: Any, data: bytes, rounds: int) -> dict[str, Any]:
    times = interleaved(upload_sides(store, before, raw, data), rounds)
    med = {n: statistics.median(t) for n, t in times.items()}
    mbps = {n: len(data) / s / 1e6 for n, s in med.items()}
    raws = ("boto3 upload_fileobj", "boto3 put_object")
    return {"bytes": len(data), "rounds": rounds, "median_ms": {n: round(s * 1000, 2) for n, s in med.items()},
            "mb_per_s": {n: round(v, 1) for n, v in mbps.items()},
            "engine_over": {b: round(mbps["engine"] / mbps[b], 3) for b in raws},
            "before_over": {b: round(mbps["engine, 16 MiB threshold"] / mbps[b], 3) for b in raws},
            "engine_over_before": round(mbps["engine"] / mbps["engine, 16 MiB threshold"], 3),
            "goal_met": all(mbps["engine"] / mbps[b] >= 0.5 for b in raws),
            "multipart": len(data) > store.multipart_threshold, "multipart_before": len(data) > before.multipart_threshold}


def profile_upload(store: Any, data: bytes, rounds: int = 3) -> dict[str, float]:
    """Where the engine's upload of ``data`` spends its time (medians, ms): the digests it computes, and each
    request it makes (their sum for the parts, which overlap), timed by wrapping the client's methods."""
    import base64

    spent: dict[str, list[float]] = {}

    def wrap(name: str) -> None:
        real = getattr(store.client, name)

        def timed(**kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return real(**kwargs)
            finally:
                spent.setdefault(name, []).append(time.perf_counter() - t0)
        setattr(store.client, name, timed)

    for name in ("put_object", "create_multipart_upload", "upload_part", "complete_multipart_upload"):
        wrap(name)
    walls, digests = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        hashlib.sha256(data).hexdigest()
        base64.b64encode(hashlib.md5(data, usedforsecurity=False).digest())
        digests.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ref = store.put(f"bench/{uuid.uuid4().hex}", data, "video/mp4")
        walls.append(time.perf_counter() - t0)
        store.delete(ref)
    out = {"wall": statistics.median(walls), "sha256+md5": statistics.median(digests)}
    for name, ts in spent.items():
        per_put = len(ts) // rounds
        out[name + (f" (x{per_put}, summed)" if per_put > 1 else "")] = statistics.median(
            sum(ts[i * per_put:(i + 1) * per_put]) for i in range(rounds))
    for name in ("put_object", "create_multipart_upload", "upload_part", "complete_multipart_upload"):
        if name in store.client.__dict__:
            del store.client.__dict__[name]
    return {k: round(v * 1000, 1) for k, v in out.items()}


# -- (b) completion: last denoise step to a downloadable URL ----------------------------------------------------
def completion_sides(stores: dict[str, Any], data: bytes, secret: bytes) -> dict[str, Callable[[int], float]]:
    """name -> one job completed with ``data`` and its URL made (seconds), then the URL fetched and checked."""
    from engine.store import keys

    want = hashlib.sha256(data).hexdigest()

    def side(js: Any) -> Callable[[int], float]:
        def one(r: int) -> float:
            uid = uuid.uuid4().hex
            js.accept(uid, WORKFLOW, 1.0)
            t0 = time.perf_counter()
            assert js.finish(uid, WORKFLOW, keys.COMPLETED, "video_encode", result=data)
            st, ref = js.status(uid), js.result_ref(uid)  # what the result URL route reads
            assert st is not None and st.state == keys.COMPLETED
            if ref is not None:
                url = js.objects.presign_get(ref, 3600).url
            else:  # the Redis path: the platform signs its own URL (an HMAC), no store call
                url = hmac.new(secret, f"{uid}:{int(time.time()) + 3600}".encode(), "sha256").hexdigest()
            took = time.perf_counter() - t0
            if ref is not None:
                with urllib.request.urlopen(url, timeout=30) as got:
                    body = got.read()
            else:
                body = js.result(uid)
            assert body is not None and hashlib.sha256(body).hexdigest() == want, "not downloadable"
            js.drop_results([uid])
            return took
        return one

    return {name: side(js) for name, js in stores.items()}


def measure_completion(stores: dict[str, Any], data: bytes, rounds: int, common_s: float) -> dict[str, Any]:
    times = interleaved(completion_sides(stores, data, os.urandom(32)), rounds)
    med = {n: statistics.median(t) for n, t in times.items()}
    span = {n: common_s + s for n, s in med.items()}
    return {"bytes": len(data), "rounds": rounds, "completion_ms": {n: round(s * 1000, 2) for n, s in med.items()},
            "completion_p90_ms": {n: round(sorted(t)[int(0.9 * (len(t) - 1))] * 1000, 2) for n, t in times.items()},
            "added_ms": round((med["store"] - med["redis"]) * 1000, 2),
            "completion_store_over_redis": round(med["store"] / med["redis"], 2),
            "span_s": {n: round(s, 4) for n, s in span.items()},
            "span_store_over_redis": round(span["store"] / span["redis"], 4),
            "goal_met": span["store"] / span["redis"] <= 1.1,
            # the shortest rest-of-span under which the store would still be within 1.1x of Redis
            "break_even_common_s": round(max(0.0, (med["store"] - 1.1 * med["redis"]) / 0.1), 4)}


# -- (b), corroborated on the real path: a node and a Proxy per side ------------------------------------------
def start_engine(folder: Path, tmp: Path, store_url: str | None) -> dict[str, Any]:
    """redis, etcd, one ``onepiece node`` serving wan2.1-t2v (one instance per stage) and one ``onepiece proxy``,
    the commands an operator runs; ``store_url``: the object store (every output to it), else Redis-only."""
    import subprocess

    from engine.embedded import EtcdServer, RedisServer
    from engine.store import JobStore
    from engine.worker.config import default_assignment

    tmp.mkdir()
    redis, etcd = RedisServer("redis-server", tmp / "redis").start(), EtcdServer("etcd", tmp / "etcd").start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONEPIECE_")}
    env.update(ONEPIECE_REDIS_URL=redis.url, ONEPIECE_ETCD_URL=etcd.url, ONEPIECE_DEVICE="cpu",
               ONEPIECE_PROXY_TOKEN=os.environ["ONEPIECE_PROXY_TOKEN"], ONEPIECE_CALIBRATE_S="0",
               ONEPIECE_OBJECT_STORE=store_url or "none", ONEPIECE_OBJECT_INLINE_BYTES="0", OMP_NUM_THREADS="1")
    (tmp / "assignment.json").write_text(default_assignment({WORKFLOW: str(folder / WORKFLOW)}).to_json())
    cli = [sys.executable, "-m", "engine.cli"]
    node = subprocess.Popen([*cli, "node", "--node", "bench", "--run-dir", str(tmp), "--assignment",
                             str(tmp / "assignment.json"), "--ring-prefix", f"od-{os.getpid()}-{tmp.name}-",
                             "--ring-bytes", str(16 << 20), "--ring-slots", "64"],
                            env=env, stdout=open(tmp / "node.log", "w"), stderr=subprocess.STDOUT, text=True)
    proxy = subprocess.Popen([*cli, "proxy", "--port", "0"], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    assert proxy.stdout is not None
    line = proxy.stdout.readline()
    if not line.startswith("proxy: "):
        raise RuntimeError(f"the proxy did not start: {line}")
    return {"services": [redis, etcd], "procs": [node, proxy], "url": line.split(": ", 1)[1].strip(),
            "store": JobStore.from_url(redis.url)}


def stop_engine(engine: dict[str, Any]) -> None:
    import subprocess

    for proc in engine["procs"]:
        proc.send_signal(2)
    for proc in engine["procs"]:
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    engine["store"].close()
    for s in engine["services"]:
        s.stop()


def call(url: str, method: str, path: str, body: Any = None, timeout: float = 120) -> tuple[int, Any]:
    """The Proxy's HTTP API with the benchmark's token: (status, JSON)."""
    import urllib.error

    from engine.proxy.auth import auth_headers

    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, method=method, headers={
        **auth_headers(os.environ["ONEPIECE_PROXY_TOKEN"]), "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def real_job(engine: dict[str, Any]) -> dict[str, float]:
    """One default wan2.1-t2v job through the engine; from its events: the last denoise step (its last progress
    event) and video_encode's end to the completed event, and the URL call made once it completed."""
    from engine.proxy.auth import auth_headers
    from engine.store import keys

    deadline = time.monotonic() + 600  # the workers load their models first: 503 until one serves each stage
    while True:
        code, doc = call(engine["url"], "POST", "/v1/requests", {"workflow": WORKFLOW, "params": {
            "prompt": "a lighthouse at dusk"}, "inputs": {}})
        if code != 503 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert code == 202, (code, doc)
    uid = doc["uid"]
    while (st := call(engine["url"], "GET", f"/v1/requests/{uid}?wait=30")[1])["state"] not in keys.TERMINAL:
        pass
    assert st["state"] == keys.COMPLETED, st
    t0 = time.perf_counter()
    code, got = call(engine["url"], "GET", f"/v1/requests/{uid}/result/url")  # 409 on the Redis path
    url_s = time.perf_counter() - t0
    req = urllib.request.Request(got["url"]) if code == 200 else urllib.request.Request(
        engine["url"] + f"/v1/requests/{uid}/result", headers=auth_headers(os.environ["ONEPIECE_PROXY_TOKEN"]))
    with urllib.request.urlopen(req, timeout=60) as r:
        assert len(r.read()) > 0, "not downloadable"
    ev = engine["store"].events(uid)
    last_step = max(float(e["ts"]) for e in ev if e["type"] == keys.PROGRESS and e["stage"] == "denoise")
    encoded = max(float(e["ts"]) for e in ev if e["type"] == keys.STAGE_FINISHED and e["stage"] == "video_encode")
    done = next(float(e["ts"]) for e in ev if e["type"] == keys.COMPLETED)
    return {"span_s": done - last_step + url_s, "completion_s": done - encoded, "url_s": url_s,
            "url_status": code}


def measure_real_path(folder: Path, tmp: Path, store_url: str, jobs: int) -> dict[str, Any]:
    """``jobs`` jobs per side, alternating, on two engines running side by side (one warm-up job each)."""
    os.environ.setdefault("ONEPIECE_PROXY_TOKEN", os.urandom(16).hex())
    engines = {"store": start_engine(folder, tmp / "e-store", store_url),
               "redis": start_engine(folder, tmp / "e-redis", None)}
    try:
        for e in engines.values():
            while call(e["url"], "GET", "/readyz")[0] != 200:
                time.sleep(0.5)
        times = interleaved({n: (lambda r, e=e: real_job(e)) for n, e in engines.items()}, jobs)
    finally:
        for e in engines.values():
            stop_engine(e)
    out: dict[str, Any] = {"jobs": jobs, "per_job": times}
    for what in ("span_s", "completion_s", "url_s"):
        med = {n: statistics.median(j[what] for j in js) for n, js in times.items()}
        out[what] = {n: round(v, 4) for n, v in med.items()}
        out[what + "_store_over_redis"] = round(med["store"] / med["redis"], 3)
    out["goal_met"] = out["span_s_store_over_redis"] <= 1.1
    return out


def upload_figures(args: argparse.Namespace, store: Any, video: bytes) -> dict[str, Any]:
    """(a): the engine's upload against raw boto3 (and the threshold before), and where its time goes."""
    from engine.store.objects import ObjectStore

    store.ensure_bucket()
    before, raw = ObjectStore(store.config, multipart_threshold=BEFORE_THRESHOLD), raw_client(store)
    upload = []
    for data in [video, *(synthetic(s) for s in args.upload_sizes)]:
        upload.append(measure_upload(store, before, raw, data, args.rounds))
        print_upload(upload[-1])
    profile = {str(n): profile_upload(store, synthetic(n)) for n in args.profile_sizes}
    return {"upload": upload, "upload_profile_ms": profile, "part_size": store.part_size,
            "multipart_threshold": store.multipart_threshold, "multipart_threshold_before": BEFORE_THRESHOLD,
            "part_concurrency": store.part_concurrency}


def figures(args: argparse.Namespace, folder: Path, tmp: Path, video: bytes, common_s: float) -> dict[str, Any]:
    """(a), (b) and, with ``--real-path-jobs``, (b) on the real path, against one redis-server and one Swift
    (``--store``: (a) alone, against that store)."""
    from engine import envs
    from engine.embedded.s3 import SwiftS3Server
    from engine.embedded.services import RedisServer
    from engine.store import JobStore
    from engine.store.objects import ObjectStore

    if args.store:
        return {**upload_figures(args, ObjectStore.from_url(args.store), video), "store": "--store (given)"}
    redis_server = RedisServer(envs.REDIS_SERVER_BIN, tmp / "redis").start()
    s3 = SwiftS3Server(tmp / "s3").start()
    try:
        store = ObjectStore.from_url(s3.url)
        out = upload_figures(args, store, video)
        if args.upload_only:
            return {**out, "store": "embedded Swift s3api"}
        stores = {"store": JobStore.from_url(redis_server.url, ttl=600, objects=ObjectStore(store.config)),
                  "redis": JobStore.from_url(redis_server.url, ttl=600),
                  "store, default threshold": JobStore.from_url(
                      redis_server.url, ttl=600, objects=ObjectStore(store.config), inline_bytes=256 << 10)}
        completion = []
        for data in [video, *(synthetic(s) for s in args.completion_sizes)]:
            completion.append(measure_completion(stores, data, args.rounds, common_s))
            print_completion(completion[-1])
        for js in stores.values():
            js.close()
        real = measure_real_path(folder, tmp, s3.url, args.real_path_jobs) if args.real_path_jobs else None
    finally:
        s3.stop()
        redis_server.stop()
    return {**out, "store": "embedded Swift s3api", "completion": completion, "real_path": real}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.stages.tiny import models_or_tiny

    with models_or_tiny(args.models, [WORKFLOW]) as folder, tempfile.TemporaryDirectory(prefix="od-") as tmp:
        video, made = default_video(Path(folder))
        print(f"default video: {made['size']}, {made['bytes']:,} bytes; {made['after_last_step_s']:.3f} s from "
              f"the last denoise step to the video", flush=True)
        return {"video": made, **figures(args, Path(folder), Path(tmp), video, made["after_last_step_s"])}


def print_upload(row: dict[str, Any]) -> None:
    m = row["mb_per_s"]
    print(f"upload {row['bytes']:>10,} B: " + "  ".join(f"{n} {v:.1f} MB/s" for n, v in m.items())
          + f"  engine/upload_fileobj {row['engine_over']['boto3 upload_fileobj']:.2f}x"
          + f"  engine/put_object {row['engine_over']['boto3 put_object']:.2f}x", flush=True)


def print_completion(row: dict[str, Any]) -> None:
    c = row["completion_ms"]
    print(f"completion {row['bytes']:>10,} B: " + "  ".join(f"{n} {v:.1f} ms" for n, v in c.items())
          + f"  (+{row['added_ms']:.1f} ms, {row['completion_store_over_redis']:.1f}x);"
          f" last step to URL {row['span_s']['store']:.3f} s vs {row['span_s']['redis']:.3f} s:"
          f" {row['span_store_over_redis']:.3f}x", flush=True)


def _sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> int:
    from engine.bench.figures import provenance
    from engine.bench.harness import write_result

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--models", default=None, help="a folder with wan2.1-t2v/ (default: tiny models built here)")
    p.add_argument("--upload-sizes", type=_sizes, default=UPLOAD_SIZES, help="bytes, comma-separated")
    p.add_argument("--profile-sizes", type=_sizes, default=[16 * MiB, 24 * MiB, 64 * MiB, 256 * MiB])
    p.add_argument("--upload-only", action="store_true", help="the upload figures alone (a)")
    p.add_argument("--store", default=None, help="an ONEPIECE_OBJECT_STORE URL to measure (a) against, "
                   "instead of the embedded Swift (implies --upload-only)")
    p.add_argument("--completion-sizes", type=_sizes, default=COMPLETION_SIZES)
    p.add_argument("--real-path-jobs", type=int, default=5,
                   help="jobs a side through a node and a Proxy per side (0: none)")
    p.add_argument("--out", type=Path, default=None,
                   help="default: benchmarks/object_delivery/<date>.json (<date>-upload.json with --upload-only)")
    args = p.parse_args()
    args.upload_only = args.upload_only or bool(args.store)
    args.out = args.out or REPO / "benchmarks" / "object_delivery" / (
        f"{dt.date.today()}{'-upload' if args.upload_only else ''}.json")
    before = provenance()
    result = run(args)
    if result.get("real_path") is not None:
        r = result["real_path"]
        print(f"real path, {r['jobs']} jobs a side: last step to URL {r['span_s']} ({r['span_s_store_over_redis']}x); "
              f"video_encode's end to completed {r['completion_s']} ({r['completion_s_store_over_redis']}x)")
    for size, prof in result["upload_profile_ms"].items():
        print(f"profile {int(size):>10,} B: " + "  ".join(f"{k} {v} ms" for k, v in prof.items()))
    return write_result(result, before, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
