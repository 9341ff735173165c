"""Where a finished output should go: Redis (inline) or the object store, by size (issue 38, item 1).

For each output size, the same job-store calls as a last stage's worker and a download make, both ways in one
run, interleaved (one store call, then one Redis call, round after round), against a real redis-server and the
embedded Swift s3api server (the store ``onepiece up`` starts):

- ``finish``: ``JobStore.finish(..., completed, result=bytes)``: the time a worker takes to complete a job,
  through the store (upload with Content-MD5 and the sha256, then the reference in Redis) or inline (the bytes
  in Redis, in the same Lua transition);
- ``read``: ``JobStore.result(uid)``: the bytes back, as the Proxy's result route reads them.

It prints, per size, the medians and the ratios store / Redis (``--json``: the figures with provenance).

Measured here, Redis is faster at every size: the ratio falls from ~80x (1 KiB) towards ~3x (16 MiB and up)
and never crosses 1, so "faster" alone would keep every output in Redis, which the issue rules out for large
ones. What the figures do show is a knee: below it the store's time is its fixed cost per object (a request
through Swift's four servers, ~17 ms here) whatever the size, so moving those bytes to Redis saves that whole
cost; above it the store's time grows with the bytes and the ratio falls. ``knee_bytes`` is the largest size
whose store ``finish`` is within ``--tolerance`` of the smallest size's: ``ONEPIECE_OBJECT_INLINE_BYTES`` is
chosen from it. Run it on a quiet host; it takes under a minute with the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SIZES = [1 << 10, 4 << 10, 16 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 4 << 20, 16 << 20,
         32 << 20]


def _round(stores: dict[str, Any], data: bytes, times: dict[str, dict[str, list[float]]]) -> None:
    """One job finished and read back through each store, in turn."""
    from engine.store import keys

    for name, js in stores.items():
        uid = uuid.uuid4().hex
        js.accept(uid, "sd-t2i", 1.0)
        t0 = time.perf_counter()
        assert js.finish(uid, "sd-t2i", keys.COMPLETED, "image_encode", result=data)
        t1 = time.perf_counter()
        got = js.result(uid)
        t2 = time.perf_counter()
        assert got is not None and len(got) == len(data), name
        times[name]["finish"].append(t1 - t0)
        times[name]["read"].append(t2 - t1)
        js.drop_results([uid])


def measure(stores: dict[str, Any], size: int, rounds: int) -> dict[str, Any]:
    data = b"\x89PNG\r\n\x1a\n" + os.urandom(size - 8)
    times: dict[str, dict[str, list[float]]] = {n: {"finish": [], "read": []} for n in stores}
    _round(stores, data, {n: {"finish": [], "read": []} for n in stores})  # warm: connections, pools
    for _ in range(rounds):
        _round(stores, data, times)
    med = {n: {op: statistics.median(v) * 1000 for op, v in t.items()} for n, t in times.items()}
    return {"bytes": size, "rounds": rounds, "median_ms": med,
            "ratio_store_over_redis": {op: med["store"][op] / med["redis"][op] for op in ("finish", "read")},
            "added_ms": {op: med["store"][op] - med["redis"][op] for op in ("finish", "read")}}


def run(sizes: list[int], rounds: int, tolerance: float) -> dict[str, Any]:
    from engine import envs
    from engine.embedded.s3 import SwiftS3Server
    from engine.embedded.services import RedisServer
    from engine.store import JobStore
    from engine.store.objects import ObjectStore

    with tempfile.TemporaryDirectory(prefix="object-inline-") as tmp:
        redis_server = RedisServer(envs.REDIS_SERVER_BIN, Path(tmp) / "redis").start()
        s3 = SwiftS3Server(Path(tmp) / "s3").start()
        try:
            stores = {"store": JobStore.from_url(redis_server.url, ttl=600, objects=ObjectStore.from_url(s3.url)),
                      "redis": JobStore.from_url(redis_server.url, ttl=600)}
            rows = [measure(stores, size, rounds) for size in sizes]
            for js in stores.values():
                js.close()
        finally:
            s3.stop()
            redis_server.stop()
    fixed = rows[0]["median_ms"]["store"]["finish"]
    within = [r["bytes"] for r in rows if r["median_ms"]["store"]["finish"] <= (1 + tolerance) * fixed]
    crossed = [r["bytes"] for r in rows if r["ratio_store_over_redis"]["finish"] <= 1.0]
    return {"rows": rows, "store_fixed_ms": fixed, "tolerance": tolerance, "knee_bytes": max(within),
            "smallest_size_where_store_is_not_slower": min(crossed) if crossed else None}


def _sizes(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--sizes", type=_sizes, default=SIZES, help="comma-separated byte counts")
    p.add_argument("--tolerance", type=float, default=0.25,
                   help="the knee: the largest size whose store finish is within this share of the smallest's")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    from engine.bench.figures import provenance

    result: dict[str, Any] = {"provenance": provenance(), **run(args.sizes, args.rounds, args.tolerance)}
    result["load_average_after"] = os.getloadavg()
    if args.json:
        print(json.dumps(result, indent=1, default=str))
        return 0
    print(f"{'bytes':>10} {'finish store':>13} {'redis':>8} {'ratio':>7} {'read store':>11} {'redis':>8} {'ratio':>7}")
    for r in result["rows"]:
        m, q = r["median_ms"], r["ratio_store_over_redis"]
        print(f"{r['bytes']:>10} {m['store']['finish']:>10.2f} ms {m['redis']['finish']:>5.2f} ms {q['finish']:>6.1f}x "
              f"{m['store']['read']:>8.2f} ms {m['redis']['read']:>5.2f} ms {q['read']:>6.1f}x")
    print(f"store's fixed cost {result['store_fixed_ms']:.1f} ms; knee (finish within {args.tolerance:.0%} of it): "
          f"{result['knee_bytes']} bytes; smallest size where the store is not slower than Redis: "
          f"{result['smallest_size_where_store_is_not_slower']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
