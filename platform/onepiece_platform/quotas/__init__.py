"""Per-user quotas: the limits in the database, the running counters in Redis."""
