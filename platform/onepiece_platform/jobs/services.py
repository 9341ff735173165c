"""Submitting a job: an Idempotency-Key repeat, validation and per-request limits, ledger row, quota,
engine; in that order.

Why this order: a repeat of an Idempotency-Key answers the earlier job before
anything is checked again; everything that can refuse a request without the
engine (malformed input, an oversized upload, a per-user limit, the user's
quota) runs before the engine is asked, so nothing reaches the engine that the
platform would refuse; the ledger row, with the UID the platform minted, is
written before the quota is counted and the engine asked: the row claims the
Idempotency-Key (a concurrent repeat can never submit twice), and no engine
event can name a UID the ledger does not know. A refusal after the row
(quota, engine) deletes it again.
The request's content is checked by the workflow spec
(:meth:`engine.workflow.spec.WorkflowSpec.validate_request`), the same check the
Proxy's intake runs, with this platform's upload limits.
"""

from __future__ import annotations

import datetime as dt
import logging
import uuid
from dataclasses import dataclass, replace
from typing import Any

from django.db import IntegrityError, OperationalError, transaction
from django.db.models import Q, Sum
from django.db.models.functions import Coalesce
from django.utils import timezone

from engine.workflow import InvalidRequest, images, request_workflow
from engine.workflow.options import Options, Priority
from onepiece_platform import conf
from onepiece_platform.accounts.models import PRIORITIES, lowest, tier_of
from onepiece_platform.engine_link.client import EngineError, EngineRejected, get_engine
from onepiece_platform.engine_link.models import Rejection
from onepiece_platform.jobs.models import NON_TERMINAL, Job, JobInput, OutputUpload
from onepiece_platform.quotas import counters
from onepiece_platform.quotas.models import Limits, limits_for

log = logging.getLogger(__name__)


class Invalid(Exception):
    """A request the platform refuses outright (400, or 413 for size); ``field`` names the culprit."""

    def __init__(self, field: str, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.field = field
        self.message = message
        self.status = status


class IdempotencyInProgress(Exception):
    """A request with this Idempotency-Key is being submitted right now (409)."""


@dataclass(frozen=True)
class OutputOptions:
    """What happens to a job's output: ``retention`` (seconds it is kept after the job finishes; None: the key
    tier's default, :func:`check_retention`); ``upload_url``, the client's presigned PUT URL it is uploaded to
    once the job completes (:mod:`onepiece_platform.webhooks.uploads`), and ``keep_output``: keep our copy
    after that upload succeeded (else it is deleted then)."""

    retention: int | None = None
    upload_url: str = ""
    keep_output: bool = False


def vet_upload_url(url: str) -> str:
    """``url`` if the egress policy lets the platform PUT to it (the webhooks' policy:
    :func:`onepiece_platform.webhooks.ssrf.vet`); else a 400 naming ``output_upload_url``."""
    from onepiece_platform.webhooks import ssrf

    try:
        ssrf.vet(url)
    except ssrf.UnsafeUrl as exc:
        raise Invalid("output_upload_url", f"output_upload_url: {exc}") from None
    return url


@dataclass(frozen=True)
class Submitted:
    job: Job
    created: bool  # False: an Idempotency-Key repeat answered with the earlier job


# Idempotency-Key scopes: the route and operation a key names a request of (Job.idempotency_scope).
SCOPE_JOBS = "jobs.create"
SCOPE_VIDEOS = "videos.create"
MAX_IDEMPOTENCY_KEY = 200


def remix_scope(source_uid: str) -> str:
    """A remix's key names a remix of that one video: the same key on another source is another request."""
    return f"videos.remix:{source_uid}"


def idempotency_key(headers: Any) -> str:
    """The request's Idempotency-Key, whole: a longer one is refused, never cut (two keys that share their
    first 200 characters are two requests)."""
    key = str(headers.get("Idempotency-Key", ""))
    if len(key) > MAX_IDEMPOTENCY_KEY:
        raise Invalid("Idempotency-Key", f"Idempotency-Key is longer than {MAX_IDEMPOTENCY_KEY} characters")
    return key


def _repeat(earlier: Job, workflow: str, api: str, scope: str) -> Submitted:
    """An Idempotency-Key repeat answers the first job only for the same route, operation and workflow: a key
    is the caller's name for one request, and a video route must never answer with an image job, a remix
    with its source (or with another source's remix). A deleted video's key is spent: 409, never the
    deleted id."""
    if earlier.workflow != workflow or earlier.api != api or earlier.idempotency_scope != scope:
        raise Invalid("Idempotency-Key", "this Idempotency-Key was used for a different request "
                      f"({earlier.idempotency_scope or earlier.api} {earlier.workflow}); use a new key", 409)
    if earlier.hidden:
        raise Invalid("Idempotency-Key", "the video made with this Idempotency-Key was deleted; use a new key", 409)
    return Submitted(earlier, False)


def priority_ceiling(user: Any, api_key: Any) -> tuple[str, str]:
    """(the highest priority the request may use, whose limit that is): the user's tier
    (:func:`~onepiece_platform.accounts.models.tier_of`: the operator's setting, else high for staff and
    normal for others), or with an API key :attr:`ApiKey.max_priority_allowed` (the same tier, or the
    key's own setting where lower)."""
    if api_key is not None:
        return api_key.max_priority_allowed, "this API key"
    return tier_of(user), "this account"


def check_priority(user: Any, api_key: Any, priority: object) -> str:
    """The request's priority once it is one of ``low``, ``normal``, ``high`` (else 400) and no higher than
    :func:`priority_ceiling` (else 403); both name ``priority``. A request that names none (None) runs at
    the highest its ceiling allows, up to ``normal``."""
    ceiling, whose = priority_ceiling(user, api_key)
    if priority is None:
        return lowest(ceiling, "normal")
    if not isinstance(priority, str) or priority not in PRIORITIES:
        raise Invalid("priority", f"priority must be one of {', '.join(PRIORITIES)}")
    if PRIORITIES.index(priority) > PRIORITIES.index(ceiling):
        raise Invalid("priority", f"priority {priority} is over what {whose} may use (at most {ceiling})", 403)
    return priority


def retention_bounds(user: Any, api_key: Any) -> tuple[int, int, str]:
    """(default, ceiling, tier) of the output retention, in seconds, for a request with ``api_key`` (or from a
    session): ``OUTPUT_RETENTION_S`` of the key's tier (:func:`priority_ceiling`), the ceiling cut to
    ``LEDGER_RETENTION_DAYS`` (the ledger's clean-up deletes the row and its objects then)."""
    tier = priority_ceiling(user, api_key)[0]
    table = conf.get("OUTPUT_RETENTION_S")
    bounds = table.get(tier) or table["normal"]
    ceiling = min(int(bounds["max"]), int(conf.get("LEDGER_RETENTION_DAYS")) * 86400)
    return min(int(bounds["default"]), ceiling), ceiling, tier


def check_retention(user: Any, api_key: Any, retention: object) -> dt.timedelta:
    """How long the request's output is kept after its job finishes: ``retention`` seconds (a positive
    integer, at most the ceiling of the key's tier: else a 400 naming ``retention``), or, when None, the
    tier's default (:func:`retention_bounds`)."""
    default, ceiling, tier = retention_bounds(user, api_key)
    if retention is None:
        return dt.timedelta(seconds=default)
    if isinstance(retention, bool) or not isinstance(retention, int) or retention < 1:
        raise Invalid("retention", "retention must be a whole number of seconds, 1 or more")
    if retention > ceiling:
        raise Invalid("retention", f"retention {retention} s is over the ceiling of the {tier} tier "
                      f"({ceiling} s)")
    return dt.timedelta(seconds=retention)


def inherited_retention(user: Any, api_key: Any, source: dt.timedelta | None) -> int | None:
    """The retention (seconds) of a request made from an earlier job (a remix) that names none: the source's,
    where it is within the ceiling of this request's key tier; else None (the tier's default)."""
    if source is None:
        return None
    seconds = int(source.total_seconds())
    return seconds if 1 <= seconds <= retention_bounds(user, api_key)[1] else None


def inherited_priority(user: Any, api_key: Any, source: str) -> str:
    """The priority of a request made from an earlier job (a remix): the source's, capped by what this
    request's key (or account) may use now."""
    return lowest(source if source in PRIORITIES else "normal", priority_ceiling(user, api_key)[0])


def resolve(workflow: str, params: dict[str, Any], inputs: dict[str, bytes], limits: Limits) -> tuple[dict[str, Any], float]:
    """(resolved params, estimated GPU-seconds) once the request passes the workflow spec's check (the
    one the Proxy runs, with this platform's upload limits) and the user's limits; raises :class:`Invalid`."""
    try:
        # the loaded model's defaults and limits, as the Proxy checks them (the spec's own where unknown)
        spec = request_workflow(workflow)
        spec = spec.bound(get_engine().limits(spec.name))
        resolved = spec.validate_request(params, inputs, conf.get("MAX_UPLOAD_BYTES"), conf.get("MAX_IMAGE_PIXELS"))
    except images.ImageTooLarge as exc:
        raise Invalid(exc.field, str(exc), 413) from None
    except InvalidRequest as exc:
        raise Invalid(exc.field, str(exc)) from None
    pixels = int(resolved.get("height", 0)) * int(resolved.get("width", 0))
    if pixels > limits.max_pixels:
        raise Invalid("size", f"{pixels} pixels is over your limit of {limits.max_pixels}")
    if int(resolved.get("num_frames", 0)) > limits.max_frames:
        raise Invalid("num_frames", f"num_frames is over your limit of {limits.max_frames}")
    if int(resolved.get("num_inference_steps", 0)) > limits.max_steps:
        raise Invalid("num_inference_steps", f"num_inference_steps is over your limit of {limits.max_steps}")
    return resolved, spec.estimate_gpu_seconds(resolved)


# A finished job's charge may still move (a stage time read after the row was finished): the seed of
# restarted counters gives a per-job record to jobs finished this recently, so such a move is exact.
SEED_FINISHED_WITHIN = dt.timedelta(minutes=15)


def _ledger_seed(user_id: int, exclude: int, day: str) -> counters.Seed:
    """(the jobs whose per-job records the seed writes, GPU-seconds charged on ``day``) from the ledger:
    seeds for missing Redis counters. ``exclude`` is the row being submitted: it is not charged yet.

    Two reads, not one snapshot: a job may finish between them. So ``day``'s spend is the movable jobs'
    charges as the first read has them (their records say the same, and a later settlement moves both by
    its difference) plus the charges of the rest, which no longer move: a job is movable by a fixed
    cutoff, and one that was cannot stop being so between the reads."""
    mine = Job.objects.filter(owner_id=user_id, uid__isnull=False).exclude(pk=exclude).exclude(quota_day="")
    movable = Q(state__in=NON_TERMINAL) | Q(quota_day=day, finished_at__gte=timezone.now() - SEED_FINISHED_WITHIN)
    rows = [(u, float(est if measured is None else measured), int(version), int(state in NON_TERMINAL), qday)
            for u, est, measured, version, state, qday in mine.filter(movable).values_list(
                "uid", "cost_estimate_gpu_s", "cost_measured_gpu_s", "charge_version", "state", "quota_day")]
    settled = mine.filter(quota_day=day).exclude(movable).aggregate(
        s=Sum(Coalesce("cost_measured_gpu_s", "cost_estimate_gpu_s")))["s"] or 0.0
    return [row[:4] for row in rows], float(settled) + sum(row[1] for row in rows if row[4] == day)


def keep_inputs(job: Job, inputs: dict[str, bytes]) -> None:
    """The request's uploads beside its row until it finishes (the ledger deletes them then)."""
    JobInput.objects.bulk_create(JobInput(job=job, name=name, data=bytes(data)) for name, data in inputs.items())


def _rejected(workflow: str, reason: str, status: int) -> None:
    """Count a turned-away submission for the dashboard's traffic view; never fails the request."""
    try:
        Rejection.objects.create(workflow=workflow, reason=reason, status=status)
    except Exception:  # the answer to the client matters more than the count
        log.exception("could not record a rejection")


def _reserve(job: Job, cost: float, limits: Limits) -> None:
    """Count ``job`` against its owner's quota for today; a refusal deletes the row again."""
    day = counters.today()
    try:
        counters.reserve(job.owner_id, job.uid, cost, limits,
                         lambda: _ledger_seed(job.owner_id, job.pk, day), day=day)
    except BaseException as exc:
        job.delete()
        if isinstance(exc, counters.QuotaExceeded):
            _rejected(job.workflow, Rejection.QUOTA, 429)
        raise
    # recorded before the engine is asked: the seed of restarted counters counts reserved jobs only
    Job.objects.filter(pk=job.pk).update(quota_day=day)
    job.quota_day = day


def _ask_engine(job: Job, inputs: dict[str, bytes]) -> None:
    """Submit the reserved ``job`` to the engine under its UID; a refusal deletes the row and gives the
    reservation back."""
    try:
        get_engine().submit(job.workflow, job.params, inputs, job.request_options(), uid=job.uid)
    except (EngineRejected, EngineError) as exc:
        job.delete()
        counters.unreserve(job.owner_id, job.quota_day, job.uid)
        if isinstance(exc, EngineError):
            _rejected(job.workflow, Rejection.ENGINE_UNREACHABLE, 503)
        elif exc.status == 503:
            _rejected(job.workflow, Rejection.ENGINE_BUSY, 503)
        raise


def _create_row(job: Job, inputs: dict[str, bytes], scope: str, output: OutputOptions) -> Submitted | None:
    """Write ``job`` (with its inputs and its output upload) in one transaction; None when written, else the
    earlier job whose Idempotency-Key it repeats (or :class:`IdempotencyInProgress`)."""
    key = job.idempotency_key
    try:
        # the row claims the Idempotency-Key before anything is counted or sent
        with transaction.atomic():
            job.save(force_insert=True)
            keep_inputs(job, inputs)  # to submit it again if the engine loses it (engine_link/resubmit.py)
            if output.upload_url:  # due once the job completes (webhooks.uploads)
                OutputUpload.objects.create(job=job, url=output.upload_url, keep_output=output.keep_output,
                                            next_attempt_at=timezone.now())
    except IntegrityError:
        if not key:  # not a key clash: a real error, never "someone's earlier job"
            raise
        earlier = Job.objects.filter(owner=job.owner, idempotency_key=key).first()
        if earlier is None or (earlier.submitting and not earlier.terminal):
            raise IdempotencyInProgress(key) from None
        return _repeat(earlier, job.workflow, job.api, scope)
    return None


def submit(user: Any, workflow: str, params: dict[str, Any], inputs: dict[str, bytes],
           idempotency_key: str = "", api: str = "native", deadline_s: float | None = None,
           api_key: Any = None, webhook_url: str = "", scope: str = SCOPE_JOBS,
           priority: str | None = None, output: OutputOptions | None = None) -> Submitted:
    """Raises Invalid, QuotaExceeded, IdempotencyInProgress, EngineRejected, EngineError.

    ``scope``: the route and operation an ``idempotency_key`` belongs to (``SCOPE_*``, :func:`remix_scope`).

    ``api_key``: the key the request came with (its webhook endpoint gets the job's completion event);
    ``webhook_url``: a per-request receiver of that event, vetted by the caller.
    ``priority``: ``low``, ``normal`` or ``high``, within the user's tier and the key's cap
    (:func:`check_priority`; None: the highest allowed, up to normal); every stage serves higher priority
    first, with aging (engine.dispatch.order), and the ledger row records it.
    ``output``: the output's retention within the key tier's ceiling (:func:`check_retention`), and the
    client's ``output_upload_url`` (vetted here: :func:`vet_upload_url`) with ``keep_output``.
    """
    if idempotency_key:
        earlier = Job.objects.filter(owner=user, idempotency_key=idempotency_key).first()
        if earlier is not None:
            if earlier.submitting and not earlier.terminal:
                raise IdempotencyInProgress(idempotency_key)
            return _repeat(earlier, workflow, api, scope)
    output = output or OutputOptions()
    priority = check_priority(user, api_key, priority)
    retention = check_retention(user, api_key, output.retention)
    if output.upload_url:
        vet_upload_url(output.upload_url)
    limits = limits_for(user.pk)
    resolved, cost = resolve(workflow, params, inputs, limits)
    try:  # checked before the row is written: a row's options always make an Options (Job.request_options)
        model_params, options = Options.split(resolved, priority, deadline_s)
    except InvalidRequest as exc:
        raise Invalid(exc.field, str(exc)) from None
    options = replace(options, priority=Priority.NORMAL, deadline_s=None)  # those two are the row's columns
    # The platform names the job: the row holds its UID before the engine can write an event about it.
    job = Job(uid=uuid.uuid4().hex, owner=user, workflow=workflow, params=model_params, options=options.to_json(),
              api=api,
              cost_estimate_gpu_s=cost, idempotency_key=idempotency_key,
              idempotency_scope=scope if idempotency_key else "", submitting=True, api_key=api_key,
              webhook_url=webhook_url, deadline_s=deadline_s, priority=priority, retention=retention)
    repeat = _create_row(job, inputs, scope, output)
    if repeat is not None:
        return repeat
    _reserve(job, cost, limits)
    _ask_engine(job, inputs)
    try:
        Job.objects.filter(pk=job.pk).update(submitting=False, updated_at=timezone.now())
        job.submitting = False
    except OperationalError:
        # The engine has accepted the job: answer that. The flag clears with the ledger's first event of
        # the job (ledger.apply_event); a database that refused this one write (SQLite's table lock under a
        # concurrent writer) must not turn accepted work into an error a client would submit again.
        log.warning("job %s accepted, but its submitting flag could not be cleared now; the ledger will",
                    job.uid, exc_info=True)
    return Submitted(job, True)
