"""Result store and job-event stream (Redis); see :mod:`engine.store.jobs`.

Importing this package does not import redis: :class:`JobStore.from_url` does.
"""

from engine.store.jobs import JobStatus, JobStore, Preview

__all__ = ["JobStatus", "JobStore", "Preview"]
