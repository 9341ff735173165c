"""Every ``ONEPIECE_*`` environment variable, in one typed registry.

Read lazily (``envs.STATE_DIR`` evaluates the environment at access time), so
importing this module has no side effects and tests can monkeypatch the
environment. Add a variable here, never ``os.environ`` elsewhere: this module is the
only reader of ``ONEPIECE_*`` in engine/ and platform/ (tests/test_envs_readers.py
checks), each with its one default; writing one into a child's environment is fine.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _path(name: str, default: str) -> Callable[[], Path]:
    return lambda: Path(os.environ.get(name, default)).expanduser()


def _str(name: str, default: str | None) -> Callable[[], str | None]:
    return lambda: os.environ.get(name, default)


def _int(name: str, default: int) -> Callable[[], int]:
    return lambda: int(os.environ.get(name, str(default)))


def _bytes(name: str, default: int) -> Callable[[], int]:
    """A byte count: digits, 0 or more; ValueError naming the variable otherwise."""

    def read() -> int:
        raw = os.environ.get(name, str(default)).strip()
        if not (raw.isascii() and raw.isdigit()):
            raise ValueError(f"{name} must be a byte count (digits, 0 or more), not {raw!r}")
        return int(raw)

    return read


def _float(name: str, default: float) -> Callable[[], float]:
    return lambda: float(os.environ.get(name, str(default)))


_VARS: dict[str, Callable[[], Any]] = {
    # Where `onepiece up` keeps its state: service data dirs, tiny models, logs.
    "STATE_DIR": _path("ONEPIECE_STATE_DIR", ".onepiece"),
    # External services; when unset, `onepiece up` starts embedded ones.
    "REDIS_URL": _str("ONEPIECE_REDIS_URL", None),
    "ETCD_URL": _str("ONEPIECE_ETCD_URL", None),
    # The engine's etcd key prefix (engine.coord.keys.default_root; every process of a cluster uses the same).
    "ETCD_ROOT": _str("ONEPIECE_ETCD_ROOT", None),
    # TLS to etcd (an https:// URL): the CA to verify it with (else the system's), the client certificate.
    "ETCD_CA": _str("ONEPIECE_ETCD_CA", None),
    "ETCD_CERT": _str("ONEPIECE_ETCD_CERT", None),
    "ETCD_KEY": _str("ONEPIECE_ETCD_KEY", None),
    # Binaries of the embedded services.
    "REDIS_SERVER_BIN": _str("ONEPIECE_REDIS_SERVER_BIN", "redis-server"),
    "ETCD_BIN": _str("ONEPIECE_ETCD_BIN", "etcd"),
    # Host the embedded services and servers bind to.
    "BIND_HOST": _str("ONEPIECE_BIND_HOST", "127.0.0.1"),
    # Default data-plane backend for links between hosts: shm | tcp | verbs.
    "TRANSPORT": _str("ONEPIECE_TRANSPORT", "shm"),
    # RDMA device for the verbs transport (default: the first one), its port and GID index.
    "RDMA_DEVICE": _str("ONEPIECE_RDMA_DEVICE", None),
    "RDMA_PORT": _int("ONEPIECE_RDMA_PORT", 1),
    "RDMA_GID_INDEX": _int("ONEPIECE_RDMA_GID_INDEX", 0),
    # Ring buffer defaults.
    "RING_BYTES": _int("ONEPIECE_RING_BYTES", 64 << 20),
    "RING_SLOTS": _int("ONEPIECE_RING_SLOTS", 1024),
    "RING_LOCK_TIMEOUT_S": _float("ONEPIECE_RING_LOCK_TIMEOUT_S", 0.5),
    # How long a ring consumer polls before it sleeps on the doorbell (microseconds).
    "RING_SPIN_US": _float("ONEPIECE_RING_SPIN_US", 50.0),
    # Read by the web platform's settings (platform/onepiece_platform/settings/*.py read every ONEPIECE_*
    # variable here): the Proxy the platform submits to, which engine client class it uses (a dotted path),
    # how many reverse-proxy hops the production settings trust for client addresses (the local ones trust
    # none), the SQLite ledger path of `onepiece up` (unset: db.sqlite3 in the state folder), the
    # supervisor's status file `onepiece up` writes (unset: no supervisor), and whether production webhooks
    # must be https ("0": http allowed), and whether `onepiece up`'s local settings let webhooks and output uploads
    # reach private, loopback and link-local addresses ("0": refused, as production refuses them).
    "PROXY_URL": _str("ONEPIECE_PROXY_URL", "http://127.0.0.1:8100"),
    "ENGINE_CLIENT": _str("ONEPIECE_ENGINE_CLIENT", "onepiece_platform.engine_link.proxy.ProxyEngineClient"),
    "TRUSTED_PROXY_HOPS": _int("ONEPIECE_TRUSTED_PROXY_HOPS", 1),
    "SQLITE_PATH": _str("ONEPIECE_SQLITE_PATH", None),
    "SUPERVISOR_STATUS": _str("ONEPIECE_SUPERVISOR_STATUS", ""),
    "WEBHOOK_REQUIRE_HTTPS": _str("ONEPIECE_WEBHOOK_REQUIRE_HTTPS", "1"),
    "WEBHOOK_ALLOW_PRIVATE": _str("ONEPIECE_WEBHOOK_ALLOW_PRIVATE", "1"),
    # Set by the processes that start children, read by the children: the state folder's lock descriptor an
    # embedded service inherits (engine.embedded.children), a stage worker's configuration (engine.worker.proc).
    "STATE_LOCK_FD": _str("ONEPIECE_STATE_LOCK_FD", ""),
    "WORKER_CONFIG": _str("ONEPIECE_WORKER_CONFIG", ""),
    # ... and a stage worker's CPU thread budget, which its TaskManager sets (engine.worker.threads; unset: torch's).
    "THREAD_BUDGET": _str("ONEPIECE_THREAD_BUDGET", ""),
    # CPU threads per stage instance: "auto" (the node's usable cores shared among its instances; 1-2 on
    # CUDA) or a positive integer. See engine.worker.threads.
    "THREADS_PER_INSTANCE": _str("ONEPIECE_THREADS_PER_INSTANCE", "auto"),
    # How many nice levels below the node each stage worker runs (0..19; 0: off), so the Proxy, the
    # reconciler and the web process are not queued behind a denoise step. See engine.worker.priority.
    "WORKER_NICE": _str("ONEPIECE_WORKER_NICE", "10"),
    # Step-level batching per stage (engine.worker.batching): "denoise=8,sd-t2i/denoise=4" requests share a
    # step at most; unset stages take their spec's max_batch. ONEPIECE_BATCH_WAIT_MS: how long a new batch
    # waits after its oldest request for more (default 0: later requests join at the next step).
    "MAX_BATCH": _str("ONEPIECE_MAX_BATCH", None),
    "BATCH_WAIT_MS": _str("ONEPIECE_BATCH_WAIT_MS", None),
    # ONEPIECE_MAX_HELD: STAGE=H,... requests a batching stage keeps active at once (default twice its max batch)
    "MAX_HELD": _str("ONEPIECE_MAX_HELD", None),
    # Seconds each stage's warm-up calibration may spend (engine.worker.calibrate): "S" every stage's,
    # "S,denoise=T,sd-t2i/vae_decode=U" per stage; 0: off (default engine.worker.config.DEFAULT_CALIBRATE_S).
    "CALIBRATE_S": _str("ONEPIECE_CALIBRATE_S", None),
    # Benchmarks only: comma-separated modules whose SPEC is registered beside engine.workflow.specs' (the
    # single-stage sd-t2i of `onepiece bench e2e`, engine.bench.single_stage); unset for every user deployment.
    "BENCH_WORKFLOWS": _str("ONEPIECE_BENCH_WORKFLOWS", None),
    # Device for stage executors: auto | cpu | cuda.
    "DEVICE": _str("ONEPIECE_DEVICE", "auto"),
    # Where final outputs go (engine.store.objects): an S3 URL with the bucket (http://HOST:PORT/BUCKET[/PREFIX],
    # s3://BUCKET; credentials in it or from AWS_* / the AWS credential files), or "none" (unset: none) for
    # the bytes in Redis. `onepiece up --object-store` sets it for the processes it starts.
    "OBJECT_STORE": _str("ONEPIECE_OBJECT_STORE", None),
    # With an object store, outputs under this many bytes stay in Redis (as with no store): the store's fixed
    # cost per object (~17 ms with the embedded Swift) dwarfs Redis's below its knee, measured by
    # benchmarks/object_inline.py (256 KiB here). Inline results are lost with Redis; 0 sends every output
    # to the store. Read by the last stage's workers (engine.worker.proc).
    "OBJECT_INLINE_BYTES": _bytes("ONEPIECE_OBJECT_INLINE_BYTES", 256 << 10),
    # Outputs up to this many bytes go to the object store in one PUT, larger ones in 8 MiB parts, four in
    # flight (engine.store.objects). On the embedded Swift one PUT measured 0.61-0.71x of raw boto3's put_object
    # from 16 to 256 MiB, parts 0.41-0.48x at 24-128 MiB (benchmarks/object_delivery.md). Parts buy a retry of
    # one part instead of the whole, and parallel streams (a remote AWS S3 may upload faster in parts: measure,
    # then e.g. 16777216). At most 5 GiB (S3's largest single PUT). Read where an ObjectStore is made.
    "OBJECT_MULTIPART_BYTES": _bytes("ONEPIECE_OBJECT_MULTIPART_BYTES", 256 << 20),
    # The object store's endpoint as clients reach it (http(s)://host[:port]), read by the web platform: result
    # URLs are presigned GETs from it; unset, the platform's own signed URLs (onepiece_platform.jobs.result_urls).
    # `onepiece up` sets it to its embedded store when that listens on loopback.
    "OBJECT_STORE_PUBLIC_URL": _str("ONEPIECE_OBJECT_STORE_PUBLIC_URL", None),
    # The Python that runs the embedded S3 server (engine.embedded.s3): one with the `swift` package. Unset:
    # <this venv>/s3-venv/bin/python (./quickstart makes it), else this interpreter if it has swift.
    "S3_PYTHON": _str("ONEPIECE_S3_PYTHON", None),
    # Seconds results, status hashes and cancel flags live in Redis.
    "RESULT_TTL_S": _int("ONEPIECE_RESULT_TTL_S", 3600),
    # A worker publishes progress events at most this often (milliseconds).
    "PROGRESS_INTERVAL_MS": _int("ONEPIECE_PROGRESS_INTERVAL_MS", 250),
    # This node's name in etcd (default: the host name).
    "NODE_NAME": _str("ONEPIECE_NODE_NAME", None),
    # The Workflow Set a node (its home) or a Proxy belongs to; requests stay inside one set.
    "WORKFLOW_SET": _str("ONEPIECE_WORKFLOW_SET", "default"),
    # TTL of a node's etcd lease; the TaskManager refreshes it every third of this.
    "NODE_LEASE_TTL_S": _int("ONEPIECE_NODE_LEASE_TTL_S", 10),
    # How stale a worker's or the Proxy's cached route table may get (seconds).
    "ROUTE_REFRESH_S": _float("ONEPIECE_ROUTE_REFRESH_S", 1.0),
    # Default ResultDeliver policy: round-robin | least-outstanding | cost-aware.
    "DELIVER": _str("ONEPIECE_DELIVER", "least-outstanding"),
    # Proxy: port, bound on accepted unfinished requests per workflow, ring send timeout.
    "PROXY_PORT": _int("ONEPIECE_PROXY_PORT", 8100),
    "PROXY_MAX_QUEUE": _int("ONEPIECE_PROXY_MAX_QUEUE", 64),
    # The shared secret every caller of the Proxy sends (``Authorization: Bearer ...``; the web platform,
    # Celery, `onepiece bench e2e`). `onepiece proxy` refuses to start without it; `onepiece up` generates
    # one into its state folder. See engine.proxy.auth.
    "PROXY_TOKEN": _str("ONEPIECE_PROXY_TOKEN", None),
    # `onepiece up --debug` sets this for the web platform's local settings (Django DEBUG; never in
    # production: error pages then show settings and service URLs).
    "DEBUG": _str("ONEPIECE_DEBUG", ""),
    "PROXY_SEND_TIMEOUT_S": _float("ONEPIECE_PROXY_SEND_TIMEOUT_S", 2.0),
    # Read deadlines of the servers that face callers (the web port and the Proxy): a request's head
    # (request line and headers) must arrive within HEADER_TIMEOUT_S of its first byte (of the connection,
    # on a new one), its body within BODY_TIMEOUT_S of its head; else 408 (or, idle, a close). A client
    # trickling bytes cannot hold a connection and its memory. See onepiece_platform.ops.httpguard,
    # onepiece_platform.ops.bodylimit and engine.proxy.deadlines.
    "HEADER_TIMEOUT_S": _float("ONEPIECE_HEADER_TIMEOUT_S", 15.0),
    "BODY_TIMEOUT_S": _float("ONEPIECE_BODY_TIMEOUT_S", 60.0),
    # Stretched stage times for benchmarks and tests (unset in production): "denoise=0.2,sd-t2i/vae_decode=0.05"
    # makes each run of a stage take at least that many seconds; ONEPIECE_STAGE_STRETCH "denoise=4" multiplies
    # its compute time. The worker sleeps the difference (see engine.worker.config.StageTiming).
    "STAGE_TIME_S": _str("ONEPIECE_STAGE_TIME_S", None),
    "STAGE_STRETCH": _str("ONEPIECE_STAGE_STRETCH", None),
    # ... and ONEPIECE_STEP_TIME_S "denoise=0.05" adds that much after each denoising step (time grows with steps)
    "STEP_TIME_S": _str("ONEPIECE_STEP_TIME_S", None),
    # LoRA adapters (engine.adapters): the store folder every node, the Proxy and the platform read (default
    # <state dir>/adapters), and how many adapters a denoise instance keeps loaded (its LRU; --max-adapters).
    "ADAPTER_STORE": _str("ONEPIECE_ADAPTER_STORE", None),
    "MAX_ADAPTERS": _int("ONEPIECE_MAX_ADAPTERS", 8),
    # The quality levels' step-cache settings, per workflow, over the defaults (engine.stages.caching), JSON:
    # {"flux.1-dev": {"high": {"cache_interval": 4}}}
    "QUALITY_MAP": _str("ONEPIECE_QUALITY_MAP", None),
}


# Where the web platform's settings look for Redis and etcd when ONEPIECE_REDIS_URL / ONEPIECE_ETCD_URL are
# unset (a developer's local services); the engine's commands instead start embedded services or refuse.
LOCAL_REDIS_URL = "redis://127.0.0.1:6379/0"
LOCAL_ETCD_URL = "http://127.0.0.1:2379"


def __getattr__(name: str) -> Any:
    try:
        return _VARS[name]()
    except KeyError:
        raise AttributeError(f"no OnePiece setting {name!r}; known: {sorted(_VARS)}") from None


def __dir__() -> list[str]:
    return sorted(_VARS)
