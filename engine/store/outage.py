"""What "the result store is away" looks like, for the servers in front of it.

Redis stopped, restarting (loading its data), unreachable or demoted to a replica is
a condition of the moment, never a fault of the request: the Proxy and the web
platform answer it 503 with ``Retry-After`` (ARCHITECTURE: overload is 503 or 429,
never a 500). Importing this module imports redis: only servers that talk to Redis do.
"""

from __future__ import annotations

import redis.exceptions

# ConnectionError covers refused and reset connections and a rejected password (AuthenticationError);
# ReadOnlyError is a fail-over's demoted primary.
UNAVAILABLE: tuple[type[Exception], ...] = (
    redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, redis.exceptions.BusyLoadingError,
    redis.exceptions.ReadOnlyError,
)
# a restarted redis-server answers within a few seconds
RETRY_AFTER_S = 5
