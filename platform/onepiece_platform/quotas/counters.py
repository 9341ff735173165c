"""Atomic per-user counters in Redis: running jobs and GPU-seconds spent today (UTC).

Contract:
  * ``reserve`` checks both limits and takes both in one Lua script, so two
    concurrent submits can never both pass a limit that admits only one;
  * ``release`` is called exactly once per reserved job (by the ledger's
    terminal transition, which happens once) and replaces the estimate with
    the measured cost when there is one;
  * Redis is transient: a counter that is missing (Redis restarted) is seeded
    from the database ledger inside the same script (SET only if absent), so a
    restart neither forgets running jobs nor double-counts them.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from onepiece_platform import conf
from onepiece_platform.quotas.models import Limits
from onepiece_platform.redis_conn import get_redis

_DAY_TTL_S = 2 * 86400

_RESERVE = """
if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('SET', KEYS[1], ARGV[4]) end
if redis.call('EXISTS', KEYS[2]) == 0 then redis.call('SET', KEYS[2], ARGV[5], 'EX', ARGV[6]) end
local running = tonumber(redis.call('GET', KEYS[1]))
local spent = tonumber(redis.call('GET', KEYS[2]))
if running >= tonumber(ARGV[1]) then return {0, 'concurrent'} end
if spent + tonumber(ARGV[3]) > tonumber(ARGV[2]) then return {0, 'gpu_seconds'} end
redis.call('INCR', KEYS[1])
redis.call('INCRBYFLOAT', KEYS[2], ARGV[3])
return {1, ''}
"""

_RELEASE = """
if redis.call('EXISTS', KEYS[1]) == 1 and tonumber(redis.call('GET', KEYS[1])) > 0 then
  redis.call('DECR', KEYS[1])
end
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('INCRBYFLOAT', KEYS[2], ARGV[1]) end
return 1
"""


@dataclass(frozen=True)
class QuotaExceeded(Exception):
    """The user is over a counter limit; ``retry_after`` in whole seconds."""

    reason: str
    message: str
    retry_after: int

    def __str__(self) -> str:
        return self.message


def _day(now: dt.datetime | None = None) -> str:
    return (now or dt.datetime.now(dt.UTC)).strftime("%Y%m%d")


def _keys(user_id: int, day: str) -> list[str]:
    p = conf.get("REDIS_PREFIX")
    return [f"{p}:quota:{user_id}:running", f"{p}:quota:{user_id}:gpu:{day}"]


def seconds_to_midnight(now: dt.datetime | None = None) -> int:
    now = now or dt.datetime.now(dt.UTC)
    midnight = (now + dt.timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    return max(1, int((midnight - now).total_seconds()) + 1)


def reserve(user_id: int, cost: float, limits: Limits, seed_running: int, seed_spent: float) -> str:
    """Take one running slot and ``cost`` GPU-seconds of today's budget; returns the day key used.

    ``seed_*`` are the ledger's figures, used only if Redis has no counter.
    Raises :class:`QuotaExceeded` (nothing taken) when a limit would be passed.
    """
    day = _day()
    ok, reason = get_redis().eval(_RESERVE, 2, *_keys(user_id, day), limits.max_concurrent_jobs,
                                  limits.gpu_seconds_per_day, float(cost), int(seed_running), float(seed_spent),
                                  _DAY_TTL_S)
    if ok:
        return day
    if reason == b"concurrent":
        raise QuotaExceeded("concurrent", f"at most {limits.max_concurrent_jobs} jobs may run at once",
                            int(conf.get("CONCURRENCY_RETRY_AFTER_S")))
    raise QuotaExceeded("gpu_seconds", f"this job's {cost:.1f} GPU-seconds would pass today's "
                        f"{limits.gpu_seconds_per_day:g}", seconds_to_midnight())


def release(user_id: int, day: str, estimate: float, measured: float | None) -> None:
    """Free the running slot; correct the day's spend from the estimate to ``measured`` (if known)."""
    delta = 0.0 if measured is None else float(measured) - float(estimate)
    get_redis().eval(_RELEASE, 2, *_keys(user_id, day), delta)


def usage(user_id: int) -> tuple[int, float]:
    """(running, GPU-seconds today) as the counters say (0 when absent)."""
    r = get_redis()
    running, spent = r.mget(_keys(user_id, _day()))
    return int(running or 0), float(spent or 0.0)
