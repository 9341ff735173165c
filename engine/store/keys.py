"""Redis key names, job states and event types shared by the Proxy, the workers and the web layer.

One module so that every reader and writer agrees on the names; nothing here
touches the network.
"""

from __future__ import annotations

import enum

PREFIX = "onepiece"
EVENTS = f"{PREFIX}:events"  # one stream for every job's events (the web layer tails it)
# the terminal events alone (uid and state), written by the same script: what the Proxies' long polls wait
# for, without reading a dozen events per job to find one
ENDINGS = f"{PREFIX}:endings"



class JobState(enum.StrEnum):
    """A job's state (the status hash's ``state`` field; the platform's ledger uses the same names, its
    ``TextChoices`` generated from these); the last four are terminal."""

    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


QUEUED, IN_PROGRESS, COMPLETED = JobState.QUEUED, JobState.IN_PROGRESS, JobState.COMPLETED
FAILED, CANCELLED, EXPIRED = JobState.FAILED, JobState.CANCELLED, JobState.EXPIRED
TERMINAL = frozenset({COMPLETED, FAILED, CANCELLED, EXPIRED})

# event types (the stream's ``type`` field); terminal events carry the state's name
ACCEPTED = "accepted"
STAGE_STARTED = "stage_started"
STAGE_FINISHED = "stage_finished"
STAGE_STOPPED = "stage_stopped"  # a stage gave up between steps (cancel, deadline); detail says where
PROGRESS = "progress"
RETRIED = "retried"  # the node holding the job was lost; the job starts again from its first stage
TIMELINE = frozenset({STAGE_STARTED, STAGE_FINISHED, STAGE_STOPPED})  # recorded even after the terminal event
EVENT_TYPES = frozenset({ACCEPTED, STAGE_STARTED, STAGE_FINISHED, STAGE_STOPPED, PROGRESS, RETRIED, *TERMINAL})


def result_key(uid: str) -> str:
    """The final output's bytes (png, mp4), written once by the last stage."""
    return f"{PREFIX}:result:{uid}"


def result_ref_key(uid: str) -> str:
    """Where the final output is when an object store holds it (engine.store.objects): its key, size and
    sha256 as JSON, written by the transition to ``completed`` in place of :func:`result_key`'s bytes."""
    return f"{PREFIX}:result-ref:{uid}"


def preview_key(uid: str) -> str:
    """A stream of the job's live previews (stage, step, total, png), oldest first; written only for a
    request with ``preview_every`` (engine.stages.preview), expiring with the job."""
    return f"{PREFIX}:preview:{uid}"


def fragments_key(uid: str) -> str:
    """A stream of the job's streamed result, one entry per fragment in order, then an end marker
    (engine.store.fragments); written only by a stage that streams (video_encode), expiring with the result."""
    return f"{PREFIX}:fragments:{uid}"


def job_key(uid: str) -> str:
    """The status hash: state, workflow, stage, progress, created, updated, detail, cost."""
    return f"{PREFIX}:job:{uid}"


def input_key(uid: str) -> str:
    """The request as it entered the first stage (an encoded Workflow Message), kept until the job
    finishes so that a job whose node is lost can start again elsewhere."""
    return f"{PREFIX}:input:{uid}"


def cancel_key(uid: str) -> str:
    """Present while a cancel is pending; workers poll it between steps."""
    return f"{PREFIX}:cancel:{uid}"


def done_key(uid: str, stage: str) -> str:
    """Set once ``stage`` handed its output on: a redelivered input is then dropped."""
    return f"{PREFIX}:done:{uid}:{stage}"


def finished_key(workflow: str) -> str:
    """Counter of the workflow's completed jobs (every Proxy's admission reads how fast it grows: the rate
    at which the engine really finishes work; expired and failed jobs are not capacity)."""
    return f"{PREFIX}:finished:{workflow}"


def inflight_key(workflow: str) -> str:
    """Sorted set uid -> predicted GPU-seconds of the workflow's accepted, unfinished jobs."""
    return f"{PREFIX}:inflight:{workflow}"


def instance_key(instance: str) -> str:
    """A worker instance's counters (requests, busy seconds, last stage time)."""
    return f"{PREFIX}:instance:{instance}"
