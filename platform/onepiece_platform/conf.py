"""The platform's namespaced settings (``settings.ONEPIECE``) with defaults, read at access time.

Like DRF's ``api_settings``: one dict in the settings module, defaults here,
so tests can override a single key with ``settings.ONEPIECE = {...}``.
Environment variables are read in the settings modules only, never here.
"""

from __future__ import annotations

from typing import Any

from django.conf import settings

DEFAULTS: dict[str, Any] = {
    # How the web layer reaches the engine (see onepiece_platform.engine_link.client).
    "ENGINE_CLIENT": "onepiece_platform.engine_link.proxy.ProxyEngineClient",
    "PROXY_URL": "http://127.0.0.1:8100",
    "PROXY_TIMEOUT_S": 10.0,
    # The Proxy's shared secret (ONEPIECE_PROXY_TOKEN; engine.proxy.auth), sent with every call.
    "PROXY_TOKEN": "",
    # Production: refuse an empty, short or placeholder SECRET_KEY (system check onepiece.E001, and the
    # ASGI/WSGI entries at start-up).
    "STRICT_SECRETS": False,
    # Failed API-key authentications allowed per client address and window before 429.
    "AUTH_FAILURES_LIMIT": 20,
    "AUTH_FAILURES_WINDOW_S": 60,
    # Proxies in front that append to X-Forwarded-For (0: use the socket's address). Behind an ingress,
    # REMOTE_ADDR is the ingress itself, and one attacker would lock every client out.
    "TRUSTED_PROXY_HOPS": 0,
    # Bounds checked before any engine work.
    "MAX_UPLOAD_BYTES": 16 << 20,
    "MAX_IMAGE_PIXELS": 4096 * 4096,
    # Limits of a user without a Quota row.
    "DEFAULT_QUOTA": {
        "max_concurrent_jobs": 4,
        "gpu_seconds_per_day": 3600.0,
        "max_pixels": 1280 * 720,
        "max_frames": 129,
        "max_steps": 100,
    },
    # Retry-After for a user at their concurrent-jobs limit.
    "CONCURRENCY_RETRY_AFTER_S": 5,
    # A job the engine no longer knows, older than this, is failed by the reconciler's sweep.
    "LOST_AFTER_S": 30.0,
    # A job whose engine state died with Redis is submitted again under its UID at most this many times
    # (engine_link/resubmit.py), then failed as lost.
    "RESUBMIT_MAX": 2,
    # An engine event for a UID the ledger does not know is held and retried this long, then dead-lettered.
    "HOLD_UNKNOWN_S": 60.0,
    # The reconciler applies events in batches, one transaction each (engine_link/reconciler.py): at most
    # this many events, and no more once a batch has taken RECONCILER_BATCH_S (on SQLite a batch holds the
    # write lock, and the web process's writes wait for it); under load a batch fills for up to
    # RECONCILER_LINGER_MS first (the ledger then lags the stream by that much; reads refresh anyway).
    "RECONCILER_BATCH": 200,
    "RECONCILER_BATCH_S": 0.25,
    "RECONCILER_LINGER_MS": 100,
    # /v1/images/generations waits this long for its image.
    "IMAGE_WAIT_S": 120.0,
    # Ledger rows of finished jobs are deleted by the clean-up task after this many days.
    "LEDGER_RETENTION_DAYS": 30,
    # How long a job's output is kept after it finished, per key tier (the priority tier: accounts.models,
    # PriorityTier, capped by the API key's max_priority): the default a request gets, and the ceiling of the
    # ``retention`` (seconds) it may ask for; over the ceiling is a 400 naming retention. A ceiling above
    # LEDGER_RETENTION_DAYS is cut to it (the row and its objects go then anyway). The Celery task
    # onepiece.expire_outputs (every 5 minutes: CELERY_BEAT_SCHEDULE) deletes outputs whose retention ended.
    "OUTPUT_RETENTION_S": {
        "low": {"default": 86400, "max": 7 * 86400},
        "normal": {"default": 7 * 86400, "max": 30 * 86400},
        "high": {"default": 30 * 86400, "max": 30 * 86400},
    },
    # The status file of the supervisor that started this process's siblings (``onepiece up`` writes
    # <state>/processes.json: engine.embedded.supervisor), shown by /readyz and the dashboard; "" where
    # something else supervises the processes (compose, Kubernetes, systemd report on their own).
    "SUPERVISOR_STATUS": "",
    # The engine's object store for outputs (ONEPIECE_OBJECT_STORE; engine.store.objects): the platform reads
    # results the engine put there when it reads the job store itself ("" or "none": results in Redis).
    "OBJECT_STORE": "",
    # The endpoint clients reach that store at (ONEPIECE_OBJECT_STORE_PUBLIC_URL: http(s)://host[:port]): result
    # URLs are then presigned GETs from it (jobs.result_urls); "" where clients cannot reach the store: the
    # platform's own signed URLs, streaming from it. `onepiece up` sets its embedded store's loopback endpoint.
    "OBJECT_STORE_PUBLIC_URL": "",
    # etcd key prefix of the cluster (engine.coord.keys): None is ONEPIECE_ETCD_ROOT, else /onepiece, as
    # for the engine's processes; tests use their own.
    "ETCD_ROOT": None,
    # Redis key prefix for the platform's own counters.
    "REDIS_PREFIX": "onepiece:web",
    # Completion webhooks (onepiece_platform.webhooks). Private, loopback and link-local receivers are
    # refused unless allowed (onepiece up's local settings allow them); production requires https.
    "WEBHOOK_ALLOW_PRIVATE": False,
    "WEBHOOK_REQUIRE_HTTPS": False,
    # One attempt, connect to last byte; a slower receiver's attempt fails and is retried.
    "WEBHOOK_TIMEOUT_S": 10.0,
    # Waits after the 1st, 2nd, ... failed attempt (the last repeats), each stretched by up to JITTER,
    # never past MAX_AGE_S after the event: the final attempt is made then, and the delivery fails.
    "WEBHOOK_RETRY_DELAYS_S": (5, 30, 120, 600, 1800, 3600, 7200, 14400, 28800),
    "WEBHOOK_RETRY_JITTER": 0.2,
    "WEBHOOK_MAX_AGE_S": 86400.0,
    # A claimed delivery is due again this long after its claim (its worker died): above TIMEOUT_S.
    "WEBHOOK_LEASE_S": 60.0,
    # The delivery worker looks for due rows this often when idle; attempts in flight per worker.
    "WEBHOOK_POLL_S": 1.0,
    "WEBHOOK_CONCURRENCY": 8,
    # A request's output_upload_url (the client's presigned PUT URL): the webhook delivery worker uploads the
    # output there under the webhooks' egress policy above (onepiece_platform.webhooks.uploads). An output over
    # MAX_BYTES is not sent (S3 takes at most 5 GiB in one PUT); one attempt may take TIMEOUT_S; a failed one
    # is retried after RETRY_DELAYS_S (the last repeats; jitter as webhooks') up to ATTEMPTS in all, and a
    # claimed upload is due again LEASE_S after its claim (its worker died): above TIMEOUT_S.
    "OUTPUT_UPLOAD_MAX_BYTES": 5 << 30,
    "OUTPUT_UPLOAD_TIMEOUT_S": 600.0,
    "OUTPUT_UPLOAD_RETRY_DELAYS_S": (5, 30, 120, 600, 1800),
    "OUTPUT_UPLOAD_ATTEMPTS": 6,
    "OUTPUT_UPLOAD_LEASE_S": 900.0,
}


def get(name: str) -> Any:
    """``settings.ONEPIECE[name]``, else the default; ``KeyError`` for an unknown name."""
    if name not in DEFAULTS:
        raise KeyError(f"no ONEPIECE setting {name!r}; known: {sorted(DEFAULTS)}")
    return getattr(settings, "ONEPIECE", {}).get(name, DEFAULTS[name])
