"""Where a high-priority request's time goes under overload: per stage, its wait and its run, from the job
store's events, against the same requests unloaded (issue 28's priority figure, `benchmarks/e2e.md`).

Against a running ``onepiece up --workflows sd-t2i``:

    python benchmarks/priority_probe.py --proxy URL --state DIR --rate 75 --seconds 6

First 15 high requests one after the other (unloaded), then Poisson arrivals at ``--rate`` for ``--seconds``,
each high with probability 0.25 and else low (``bench e2e``'s ``priority_2x`` mix; take twice the capacity
``bench e2e`` measured). Prints, for the high requests of each run, the median and p90 of the wait before and
the run of each stage (``stage_started`` to ``stage_finished``), and of the whole job.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from pathlib import Path

from engine.bench.e2e import PARAMS, AsyncClient
from engine.store import JobStore, keys


def store_of(state: Path) -> JobStore:
    """The job store of the ``onepiece up`` whose state folder is ``state`` (its log names Redis's port)."""
    password = (state / "secrets" / "redis-password").read_text().strip()
    line = next(x for x in (state / "up.log").read_text().splitlines() if x.startswith("redis:"))
    port = line.rsplit(":", 1)[1].split("/")[0]
    return JobStore.from_url(f"redis://:{password}@127.0.0.1:{port}/0")


async def submit_all(proxy: str, token: str, rate: float | None, seconds: float) -> list[tuple[str, str]]:
    """(uid, priority) of every accepted request; ``rate`` None: 15 high ones one after the other."""
    client, rng, accepted = AsyncClient(proxy, token), random.Random(3), []

    async def one(priority: str) -> None:
        status, doc = await client.submit("sd-t2i", PARAMS["sd-t2i"], None, priority=priority)
        if status == 202:
            accepted.append((doc["uid"], priority))
            await client.wait(doc["uid"], 120)

    try:
        if rate is None:
            for _ in range(15):
                await one("high")
            return accepted
        tasks, start, t = [], time.perf_counter(), 0.0
        while (t := t + rng.expovariate(rate)) < seconds:
            if (delay := start + t - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one("high" if rng.random() < 0.25 else "low")))
        await asyncio.gather(*tasks)
        return accepted
    finally:
        await client.close()


def split(store: JobStore, uid: str) -> dict[str, float]:
    """Seconds of each stage's wait (since the previous stage ended, or the acceptance) and run."""
    events = store.events(uid)
    accepted = float(next(e["ts"] for e in events if e["type"] == keys.ACCEPTED))
    out, prev, began = {}, accepted, accepted
    for e in events:
        ts = float(e["ts"])
        if e["type"] == keys.STAGE_STARTED:
            out[e["stage"] + ".wait"], began = ts - prev, ts
        elif e["type"] == keys.STAGE_FINISHED:
            out[e["stage"] + ".run"], prev = ts - began, ts
        elif e["type"] == keys.COMPLETED:
            out["total"] = ts - accepted
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--proxy", required=True)
    p.add_argument("--state", required=True, type=Path, help="onepiece up's state folder")
    p.add_argument("--rate", type=float, required=True, help="offered requests/s of the loaded run")
    p.add_argument("--seconds", type=float, default=6.0)
    args = p.parse_args()
    token = (args.state / "secrets" / "proxy-token").read_text().strip()
    store = store_of(args.state)
    for label, rate in (("unloaded", None), (f"{args.rate:g} rps", args.rate)):
        rows = [split(store, uid) for uid, pr in asyncio.run(submit_all(args.proxy, token, rate, args.seconds))
                if pr == "high"]
        print(f"{label}: {len(rows)} high jobs, median / p90 ms")
        for k in sorted({k for r in rows for k in r}):
            v = sorted(r[k] for r in rows if k in r)
            print(f"  {k:20s} {1e3 * statistics.median(v):8.1f} {1e3 * v[int(0.9 * (len(v) - 1))]:8.1f}")


if __name__ == "__main__":
    main()
