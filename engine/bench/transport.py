"""``onepiece bench transport``: the ring against memcpy, pyzmq and multiprocessing, in one run.

Every figure is measured between two processes (except memcpy, the one-copy
limit, which is a single process copying into pre-faulted shared memory), and
the transports are interleaved: for each size and repetition, each transport
runs once, and the report takes the median over repetitions. Ratios are
against memcpy and pyzmq measured in the same run, because this machine is
shared and noisy; absolute numbers from another run are not comparable.

One-way throughput: the sender sends ``count`` messages back to back, the
receiver takes each one (zero-copy for the ring and zmq), and reports when it
has them all. Round trip: one message of the size out, 8 bytes back.

``fused`` is the ring producer's native copy-and-checksum alone (one process, no
consumer), record after record through pre-faulted shared memory of the ring's
size: what the producer's pass over the bytes costs by itself.

Ring variants: ``ring`` sends and receives one message per call; ``ring-batch``
sends with ``send_many`` and receives with ``recv_many`` (up to BATCH messages
per call; no round trip, which is one message); ``ring-hdr`` is ``ring`` over a
ring created with ``verify_payload=False`` (headers checked, payloads not read
by the consumer: see docs/ring-protocol.md for the risk).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
TRANSPORTS = ["memcpy", "fused", "ring", "ring-batch", "ring-hdr", "zmq-ipc", "mp-queue"]
RINGS = ("ring", "ring-batch", "ring-hdr")
BATCH = 64  # messages per send_many / recv_many call in ring-batch
ACK = b"ack-ack!"


@dataclass
class Record:
    transport: str
    size_bytes: int
    gbps: float | None
    msgs_per_s: float | None
    rtt_p50_us: float | None
    rtt_p99_us: float | None
    extra: dict[str, Any] = field(default_factory=dict)


def _count(size: int, budget: int) -> int:
    return max(6, min(20_000, budget // size))


def _rtt_count(size: int) -> int:
    return max(6, min(2_000, (128 << 20) // size))


def _ring_config(size: int, transport: str = "ring"):
    from engine.transport.ring import RingConfig

    buf = max(8 << 20, 4 * (size + 4096))
    return RingConfig(slots=4096, buffer_bytes=buf, max_producers=8, lock_timeout=2.0,
                      verify_payload=transport != "ring-hdr")


# --------------------------------------------------------------------------------------------
# child side (runs in a spawned process)


def _child(transport: str, mode: str, size: int, count: int, names: dict[str, str], ready: Any) -> None:
    """The peer: receives ``count`` messages over ``transport``, acknowledging each (latency) or the last
    (throughput)."""
    if transport in RINGS:
        _ring_child(transport, mode, size, count, names, ready)
    elif transport == "zmq-ipc":
        _zmq_child(mode, count, names, ready)
    elif transport == "mp-queue":
        _queue_child(mode, count, names, ready)
    else:
        raise ValueError(transport)


def _ring_child(transport: str, mode: str, size: int, count: int, names: dict[str, str], ready: Any) -> None:
    from engine.transport.ring import RingConsumer, attach_producer

    inbox = RingConsumer.create(names["in"], _ring_config(size, transport))
    ready.set()
    out = attach_producer(names["out"], 0)
    if mode == "throughput" and transport == "ring-batch":
        got = 0
        while got < count:
            b = inbox.recv_many(BATCH, 60)
            assert b, "bench: ring receive timed out"
            got += len(b)
            b.release()
        out.send(ACK)
    elif mode == "throughput":
        for _ in range(count):
            d = inbox.recv(60)
            assert d is not None, "bench: ring receive timed out"
            d.release()
        out.send(ACK)
    else:
        for _ in range(count):
            d = inbox.recv(60)
            assert d is not None, "bench: ring receive timed out"
            d.release()
            out.send(ACK)
    out.flush(30)
    out.close()
    out.region.close()
    time.sleep(0.05)
    inbox.close()


def _zmq_child(mode: str, count: int, names: dict[str, str], ready: Any) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.connect(names["zmq"])
    ready.set()
    if mode == "throughput":
        for _ in range(count):
            sock.recv(copy=False)
        sock.send(ACK)
    else:
        for _ in range(count):
            sock.recv(copy=False)
            sock.send(ACK)
    sock.close(linger=1000)
    ctx.term()


def _queue_child(mode: str, count: int, names: dict[str, Any], ready: Any) -> None:
    q_in, q_out = names["q_in"], names["q_out"]
    ready.set()
    if mode == "throughput":
        for _ in range(count):
            q_in.get()
        q_out.put(ACK)
    else:
        for _ in range(count):
            q_in.get()
            q_out.put(ACK)


def _producer_child(address: str, pid: int, size: int, count: int, go: Any, ready: Any, nice: int) -> None:
    from engine.transport.ring import attach_producer

    if nice:
        os.nice(nice)  # as a deployment gives the consumer its own core

    p = attach_producer(address, pid, send_timeout=60)
    payload = os.urandom(size)
    ready.release()
    go.wait(60)
    for _ in range(count):
        p.send(payload)
    p.flush(60)
    p.close()
    p.region.close()


# --------------------------------------------------------------------------------------------
# parent side


class _Run:
    """One transport at one size: spawn the peer, measure, tear down."""

    def __init__(self, transport: str, size: int, uid: str) -> None:
        self.transport, self.size, self.uid = transport, size, uid
        self.payload = os.urandom(size)

    def measure(self, mode: str, count: int) -> list[float]:
        """Seconds: one figure for ``count`` messages (throughput), or one per round trip (latency)."""
        ctx = mp.get_context("spawn")
        ready = ctx.Event()
        cleanup: list[Callable[[], None]] = []
        names = self._listen(ctx, cleanup)
        proc = ctx.Process(target=_child, args=(self.transport, mode, self.size, count, names, ready), daemon=True)
        proc.start()
        try:
            if not ready.wait(60):
                raise RuntimeError(f"bench peer for {self.transport} did not start")
            send, send_many, wait_ack = self._ends(names, cleanup)
            return self._timed(mode, count, send, send_many, wait_ack)
        finally:
            proc.join(60)
            if proc.is_alive():
                proc.kill()
            for fn in cleanup:
                fn()

    def _listen(self, ctx: Any, cleanup: list[Callable[[], None]]) -> dict[str, Any]:
        """The parent's receiving end, open before the peer starts; what the peer needs to reach it."""
        names: dict[str, Any] = {}
        if self.transport in RINGS:
            from engine.transport.ring import RingConfig, RingConsumer

            names = {"in": f"shm://bench-{self.uid}-in", "out": f"shm://bench-{self.uid}-out"}
            self._back = RingConsumer.create(names["out"], RingConfig(slots=4096, buffer_bytes=1 << 20,
                                                                      max_producers=2))
            cleanup.append(self._back.close)
        elif self.transport == "zmq-ipc":
            import zmq

            zctx = zmq.Context()
            self._sock = sock = zctx.socket(zmq.PAIR)
            path = os.path.join(tempfile.gettempdir(), f"onepiece-bench-{self.uid}.sock")
            names = {"zmq": f"ipc://{path}"}
            sock.bind(names["zmq"])
            cleanup += [lambda: sock.close(linger=0), zctx.term, lambda: os.path.exists(path) and os.unlink(path)]
        elif self.transport == "mp-queue":
            names = {"q_in": ctx.Queue(), "q_out": ctx.Queue()}
        return names

    def _ends(self, names: dict[str, Any], cleanup: list[Callable[[], None]]) -> tuple[Any, Any, Any]:
        """(send one, send a batch (rings only), wait for the peer's acknowledgement), once the peer is up."""
        if self.transport in RINGS:
            from engine.transport.ring import attach_producer

            prod = attach_producer(names["in"], 0, send_timeout=60)
            cleanup.insert(0, lambda: (prod.close(), prod.region.close()))
            back = self._back

            def wait_ack() -> None:
                d = back.recv(60)
                assert d is not None, "bench: no ack on the ring"
                d.release()
            return prod.send, prod.send_many, wait_ack
        if self.transport == "zmq-ipc":
            sock, copy = self._sock, self.size < 65536

            def send(b: bytes) -> None:
                sock.send(b, copy=copy)

            def zmq_ack() -> None:
                sock.recv()
            return send, None, zmq_ack
        q_in, q_out = names["q_in"], names["q_out"]

        def queue_ack() -> None:
            q_out.get()
        return q_in.put, None, queue_ack

    def _timed(self, mode: str, count: int, send: Any, send_many: Any, wait_ack: Any) -> list[float]:
        payload = self.payload
        if mode == "throughput" and self.transport == "ring-batch":
            batch = [payload] * min(BATCH, count)
            t0 = time.perf_counter()
            left = count
            while left:
                send_many(batch if left >= len(batch) else batch[:left])
                left -= min(left, len(batch))
            wait_ack()
            return [time.perf_counter() - t0]
        if mode == "throughput":
            t0 = time.perf_counter()
            for _ in range(count):
                send(payload)
            wait_ack()
            return [time.perf_counter() - t0]
        times = []
        for _ in range(count):
            t0 = time.perf_counter()
            send(payload)
            wait_ack()
            times.append(time.perf_counter() - t0)
        return times


def _memcpy(size: int, count: int) -> float:
    """Seconds for ``count`` single-threaded copies of ``size`` bytes into pre-faulted shared memory."""
    from engine.transport.region import create_region

    region = create_region(f"shm://bench-memcpy-{os.getpid()}-{size}", size)
    try:
        dst = region.local_view()
        src = memoryview(os.urandom(size))
        dst[:] = src  # fault the pages in, as the ring's pages are after its first lap
        t0 = time.perf_counter()
        for _ in range(count):
            dst[:] = src
        return time.perf_counter() - t0
    finally:
        region.close()


def _fused(size: int, count: int) -> float:
    """Seconds for ``count`` native copy-and-checksums of ``size`` bytes (what a producer's send does to the
    payload), record after record through pre-faulted shared memory of the bench's ring size, as a producer
    writes its ring (memcpy instead copies into the same bytes every time)."""
    from engine.transport.region import create_region
    from engine.transport.ring.base import _ring_send

    if _ring_send is None:
        raise RuntimeError("the native fast paths are not built for this CPU")
    from engine.transport._atomics import ring_record_checksum

    buf = _ring_config(size).buffer_bytes
    span = (64 + size + 63) // 64 * 64
    region = create_region(f"shm://bench-fused-{os.getpid()}-{size}", buf)
    try:
        ring = region.local_view()
        ring[:] = bytes(buf)  # fault the pages in, as the ring's pages are after its first lap
        places = [ring[k * span + 64 : k * span + 64 + size] for k in range(buf // span)]
        src = memoryview(os.urandom(size))
        header = os.urandom(40)
        t0 = time.perf_counter()
        for i in range(count):
            ring_record_checksum(header, src, places[i % len(places)])
        elapsed = time.perf_counter() - t0
        for v in places:
            v.release()
        return elapsed
    finally:
        region.close()


def cas_rate(contenders: int, n: int = 300_000) -> float:
    """CAS operations per second on one shared word, summed over ``contenders`` processes."""
    from engine.transport.region import create_region

    name = f"shm://bench-cas-{os.getpid()}-{contenders}"
    region = create_region(name, 4096)
    try:
        ctx = mp.get_context("spawn")
        start = ctx.Event()
        out = ctx.Queue()
        procs = [ctx.Process(target=_cas_child, args=(name, n, start, out)) for _ in range(contenders)]
        for p in procs:
            p.start()
        time.sleep(0.3)
        start.set()
        results = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
        # aggregate rate over the window in which all ran
        first = min(r[0] for r in results)
        last = max(r[1] for r in results)
        assert region.load(0) == contenders * n, "lost CAS increments"
        return contenders * n / (last - first)
    finally:
        region.close()


def _cas_child(name: str, n: int, start: Any, out: Any) -> None:
    from engine.transport.region import attach_region

    r = attach_region(name)
    start.wait(30)
    t0 = time.time()
    cas, load = r.cas, r.load
    done = 0
    while done < n:
        v = load(0)
        if cas(0, v, v + 1) == v:
            done += 1
    out.put((t0, time.time()))
    r.close()


def multi_producer_rate(producers: int, size: int, total: int, nice: int = 0, batch: bool = False) -> float:
    """Messages per second into one ring from ``producers`` processes (the parent consumes, with
    ``recv_many`` when ``batch``); each producer sends one message per call."""
    from engine.transport.ring import RingConsumer

    address = f"shm://bench-mp-{os.getpid()}-{producers}-{size}"
    c = RingConsumer.create(address, _ring_config(size))
    ctx = mp.get_context("spawn")
    go, ready = ctx.Event(), ctx.Semaphore(0)
    per = total // producers
    procs = [ctx.Process(target=_producer_child, args=(address, i, size, per, go, ready, nice))
             for i in range(producers)]
    try:
        for p in procs:
            p.start()
        for _ in procs:
            ready.acquire(timeout=60)
        got = 0
        go.set()
        t0 = time.perf_counter()
        while got < per * producers:
            if batch:
                b = c.recv_many(BATCH, 60)
                assert b, "bench: multi-producer receive timed out"
                got += len(b)
                b.release()
                continue
            d = c.recv(60)
            assert d is not None, "bench: multi-producer receive timed out"
            d.release()
            got += 1
        elapsed = time.perf_counter() - t0
        for p in procs:
            p.join(60)
        return got / elapsed
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        c.close()


def run_benchmark(
    sizes: list[int], transports: list[str], repeat: int, budget: int, progress: Callable[[str], None]
) -> list[Record]:
    results: dict[tuple[str, int], dict[str, list[float]]] = {}
    uid = 0
    for size in sizes:
        count = _count(size, budget)
        for rep in range(repeat):
            order = transports[rep % len(transports):] + transports[: rep % len(transports)]
            for t in order:
                progress(f"{t} {size} B rep {rep + 1}/{repeat}")
                slot = results.setdefault((t, size), {"tput": [], "rtt": []})
                if t == "memcpy":
                    slot["tput"].append(_memcpy(size, count) / count)
                    continue
                if t == "fused":
                    slot["tput"].append(_fused(size, count) / count)
                    continue
                uid += 1
                run = _Run(t, size, f"{os.getpid()}-{uid}")
                slot["tput"].append(run.measure("throughput", count)[0] / count)
                if t == "ring-batch":
                    continue  # a round trip is one message: the same as ring's
                uid += 1
                run = _Run(t, size, f"{os.getpid()}-{uid}")
                slot["rtt"].extend(run.measure("rtt", _rtt_count(size)))
    records = []
    for (t, size), m in results.items():
        per_msg = statistics.median(m["tput"])
        rtts = sorted(m["rtt"])
        rec = Record(
            transport=t,
            size_bytes=size,
            gbps=size / per_msg / 1e9,
            msgs_per_s=1 / per_msg,
            rtt_p50_us=statistics.median(rtts) * 1e6 if rtts else None,
            rtt_p99_us=rtts[min(len(rtts) - 1, int(len(rtts) * 0.99))] * 1e6 if rtts else None,
        )
        records.append(rec)
    by = {(r.transport, r.size_bytes): r for r in records}
    for r in records:
        mem, zmq_ = by.get(("memcpy", r.size_bytes)), by.get(("zmq-ipc", r.size_bytes))
        if mem and mem.gbps:
            r.extra["gbps_vs_memcpy"] = r.gbps / mem.gbps
        if zmq_ and zmq_.msgs_per_s:
            r.extra["msgs_vs_zmq"] = r.msgs_per_s / zmq_.msgs_per_s
            if r.rtt_p50_us and zmq_.rtt_p50_us:
                r.extra["rtt_p50_vs_zmq"] = r.rtt_p50_us / zmq_.rtt_p50_us
        if r.rtt_p50_us and r.rtt_p99_us:
            r.extra["p99_vs_own_p50"] = r.rtt_p99_us / r.rtt_p50_us
    return records


def format_table(records: list[Record]) -> str:
    head = (f"{'transport':<10} {'size':>9} {'GB/s':>8} {'msgs/s':>11} {'rtt p50 us':>11} {'rtt p99 us':>11} "
            f"{'x memcpy':>9} {'x zmq msgs':>10} {'x zmq rtt':>9}")
    lines = [head, "-" * len(head)]

    def f(v: float | None, fmt: str) -> str:
        return format(v, fmt) if v is not None else "-"

    for r in records:
        lines.append(
            f"{r.transport:<10} {_human(r.size_bytes):>9} {f(r.gbps, '8.3f')} {f(r.msgs_per_s, '11.0f')} "
            f"{f(r.rtt_p50_us, '11.1f')} {f(r.rtt_p99_us, '11.1f')} {f(r.extra.get('gbps_vs_memcpy'), '9.2f')} "
            f"{f(r.extra.get('msgs_vs_zmq'), '10.2f')} {f(r.extra.get('rtt_p50_vs_zmq'), '9.2f')}"
        )
    return "\n".join(lines)


def _human(n: int) -> str:
    for unit, k in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``onepiece bench transport``."""
    p.add_argument("--json", action="store_true", help="print a JSON list of records instead of a table")
    p.add_argument("--sizes", nargs="+", help="message sizes in bytes (default: 4 KiB, 64 KiB, 1, 16, 64 MiB)")
    p.add_argument("--transports", nargs="+",
                   choices=["memcpy", "fused", "ring", "ring-batch", "ring-hdr", "zmq-ipc", "mp-queue"],
                   help="fused: the producer's copy-and-checksum alone; ring-batch: send_many/recv_many; "
                   "ring-hdr: a ring that checks record headers only")
    p.add_argument("--repeat", type=int, default=3, help="interleaved repetitions per size (median reported)")
    p.add_argument("--budget-mib", type=int, default=512, help="bytes per throughput run, in MiB")
    p.add_argument("--skip-contention", action="store_true", help="skip the CAS and multi-producer figures")


def main(args: Any) -> int:
    import sys

    quiet = args.json
    sizes = [int(s) for s in args.sizes] if args.sizes else SIZES
    transports = args.transports or TRANSPORTS

    def progress(msg: str) -> None:
        print(f"bench: {msg}", file=sys.stderr, flush=True)

    records = run_benchmark(sizes, transports, args.repeat, args.budget_mib << 20, progress)
    if not args.skip_contention:
        progress("CAS alone")
        alone = cas_rate(1)
        progress("CAS with two contending processes")
        two = cas_rate(2)
        records.append(Record("cas", 8, None, alone, None, None, {"contenders": 1}))
        records.append(Record("cas", 8, None, two, None, None, {"contenders": 2}))
        for size in (4 << 10, 1 << 20):
            # long enough that the producers' staggered start-up is noise: ~0.2 s or more per run here
            total = 100_000 if size <= 4096 else 3_000
            progress(f"ring, 1 vs 4 producers, {_human(size)}")
            one = statistics.median(multi_producer_rate(1, size, total) for _ in range(args.repeat))
            four = statistics.median(multi_producer_rate(4, size, total) for _ in range(args.repeat))
            records.append(Record("ring-1p", size, one * size / 1e9, one, None, None, {"producers": 1}))
            records.append(Record("ring-4p", size, four * size / 1e9, four, None, None,
                                  {"producers": 4, "vs_one_producer": four / one}))
            # On a host with fewer cores than processes, the scheduler gives the consumer a
            # 1/(N+1) share; with producers at lower priority it keeps its core, as in a deployment.
            one_n = statistics.median(multi_producer_rate(1, size, total, nice=10) for _ in range(args.repeat))
            four_n = statistics.median(multi_producer_rate(4, size, total, nice=10) for _ in range(args.repeat))
            records.append(Record("ring-4p-niced", size, four_n * size / 1e9, four_n, None, None,
                                  {"producers": 4, "vs_one_producer": four_n / one_n, "producer_nice": 10}))
            # the consumer takes what is ready with recv_many (producers still send one at a time)
            one_b = statistics.median(multi_producer_rate(1, size, total, batch=True) for _ in range(args.repeat))
            four_b = statistics.median(multi_producer_rate(4, size, total, batch=True) for _ in range(args.repeat))
            records.append(Record("ring-4p-batch", size, four_b * size / 1e9, four_b, None, None,
                                  {"producers": 4, "vs_one_producer": four_b / one_b, "one_producer": one_b}))
    if quiet:
        print(json.dumps([{**{k: v for k, v in asdict(r).items() if k != "extra"}, **r.extra} for r in records],
                         indent=1))
    else:
        print(format_table([r for r in records if r.transport in TRANSPORTS]))
        for r in records:
            if r.transport == "cas":
                print(f"CAS from Python, {r.extra['contenders']} process(es): {r.msgs_per_s / 1e6:.2f} million/s")
            elif r.transport.startswith("ring-4p"):
                how = {"ring-4p-niced": " (producers niced)", "ring-4p-batch": " (consumer recv_many)"}.get(
                    r.transport, "")
                print(f"ring, 4 producers vs 1{how}, {_human(r.size_bytes)}: {r.msgs_per_s:.0f} vs "
                      f"{r.msgs_per_s / r.extra['vs_one_producer']:.0f} msgs/s = {r.extra['vs_one_producer']:.2f}x")
    return 0
