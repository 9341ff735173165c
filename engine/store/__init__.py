"""Result store and job-event stream (Redis); see :mod:`engine.store.jobs`, with jobs' previews
(:mod:`engine.store.previews`) and instances' counters (:mod:`engine.store.instances`).

Importing this package does not import redis: :class:`JobStore.from_url` does.
"""

from engine.store.jobs import JobStatus, JobStore
from engine.store.previews import Preview

__all__ = ["JobStatus", "JobStore", "Preview"]
