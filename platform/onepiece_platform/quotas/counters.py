"""Atomic per-user counters in Redis: running jobs and GPU-seconds spent today (UTC).

Contract:
  * ``reserve`` checks both limits and takes both in one Lua script, so two
    concurrent submits can never both pass a limit that admits only one;
  * every reservation has a per-job record (``running``, ``charged``, ``version``)
    next to the counters, so ``settle`` is idempotent: the running slot is freed
    once however often a job is settled, and the day's spend moves by the
    difference between the new charge and what that job was charged before.
    A reconciler killed between the ledger's commit and Redis settles again
    after its restart without counting a charge twice; a late stage time that
    corrects a finished job's measured cost moves the spend by exactly the
    correction; an older settle arriving after a newer one is ignored;
  * Redis is transient: a counter that is missing (Redis restarted) is seeded
    from the database ledger inside the same script (only if absent), together
    with the per-job records of the user's unfinished jobs, so a restart neither
    forgets running jobs nor counts them twice.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from onepiece_platform import conf
from onepiece_platform.quotas.models import Limits
from onepiece_platform.redis_conn import get_redis

_DAY_TTL_S = 2 * 86400

# KEYS: running, spent, this job's record. ARGV: max jobs, budget, cost, seed spent, ttl, job-record prefix,
# seeded 0/1, then (uid, charge, charge version, running 0/1) of the user's jobs whose record the seed writes.
# Unseeded and a counter missing: {-1, 'seed'} (nothing taken), and the caller reads the ledger and asks again.
_RESERVE = """
local ttl = tonumber(ARGV[5])
if ARGV[7] == '0' and (redis.call('EXISTS', KEYS[1]) == 0 or redis.call('EXISTS', KEYS[2]) == 0) then
  return {-1, 'seed'}
end
if redis.call('EXISTS', KEYS[1]) == 0 then
  local running, adjust = 0, 0
  for i = 8, #ARGV, 4 do
    local jk = ARGV[6] .. ARGV[i]
    local charge, version, run = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
    if redis.call('EXISTS', jk) == 1 and tonumber(redis.call('HGET', jk, 'version')) >= version then
      -- settled between the ledger read and now: count what its record says, not what the seed read
      running = running + tonumber(redis.call('HGET', jk, 'running'))
      adjust = adjust + tonumber(redis.call('HGET', jk, 'charged')) - charge
    else
      redis.call('HSET', jk, 'running', run, 'charged', charge, 'version', version)
      redis.call('EXPIRE', jk, ttl)
      running = running + run
    end
  end
  redis.call('SET', KEYS[1], running)
  if redis.call('EXISTS', KEYS[2]) == 0 then redis.call('SET', KEYS[2], tonumber(ARGV[4]) + adjust, 'EX', ttl) end
end
if redis.call('EXISTS', KEYS[2]) == 0 then redis.call('SET', KEYS[2], ARGV[4], 'EX', ttl) end
if redis.call('EXISTS', KEYS[3]) == 1 then return {1, ''} end
local running = tonumber(redis.call('GET', KEYS[1]))
local spent = tonumber(redis.call('GET', KEYS[2]))
if running >= tonumber(ARGV[1]) then return {0, 'concurrent'} end
if spent + tonumber(ARGV[3]) > tonumber(ARGV[2]) then return {0, 'gpu_seconds'} end
redis.call('INCR', KEYS[1])
redis.call('INCRBYFLOAT', KEYS[2], ARGV[3])
redis.call('HSET', KEYS[3], 'running', 1, 'charged', ARGV[3], 'version', 0)
redis.call('EXPIRE', KEYS[3], ttl)
return {1, ''}
"""

# KEYS: running, spent, the job's record. ARGV: charge, version, ttl.
_SETTLE = """
if redis.call('EXISTS', KEYS[3]) == 0 then
  -- reserved before Redis restarted: the seed counted it from the ledger, or will; a tombstone tells a
  -- later seed that it is no longer running and what it was charged
  redis.call('HSET', KEYS[3], 'running', 0, 'charged', ARGV[1], 'version', ARGV[2])
  redis.call('EXPIRE', KEYS[3], ARGV[3])
  return 0
end
if tonumber(redis.call('HGET', KEYS[3], 'version')) >= tonumber(ARGV[2]) then return 0 end
if tonumber(redis.call('HGET', KEYS[3], 'running')) == 1 then
  if redis.call('EXISTS', KEYS[1]) == 1 and tonumber(redis.call('GET', KEYS[1])) > 0 then
    redis.call('DECR', KEYS[1])
  end
end
local delta = tonumber(ARGV[1]) - tonumber(redis.call('HGET', KEYS[3], 'charged'))
if redis.call('EXISTS', KEYS[2]) == 1 and delta ~= 0 then redis.call('INCRBYFLOAT', KEYS[2], delta) end
redis.call('HSET', KEYS[3], 'running', 0, 'charged', ARGV[1], 'version', ARGV[2])
return 1
"""

# KEYS: running, spent, the job's record: a reservation taken back (the engine refused the job).
_UNRESERVE = """
if redis.call('EXISTS', KEYS[3]) == 0 then return 0 end
if tonumber(redis.call('HGET', KEYS[3], 'running')) == 1 then
  if redis.call('EXISTS', KEYS[1]) == 1 and tonumber(redis.call('GET', KEYS[1])) > 0 then
    redis.call('DECR', KEYS[1])
  end
  if redis.call('EXISTS', KEYS[2]) == 1 then
    redis.call('INCRBYFLOAT', KEYS[2], -tonumber(redis.call('HGET', KEYS[3], 'charged')))
  end
end
redis.call('DEL', KEYS[3])
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


def _job_prefix() -> str:
    return f"{conf.get('REDIS_PREFIX')}:quota:job:"


def _keys(user_id: int, day: str, uid: str = "") -> list[str]:
    p = conf.get("REDIS_PREFIX")
    return [f"{p}:quota:{user_id}:running", f"{p}:quota:{user_id}:gpu:{day}", _job_prefix() + uid]


def seconds_to_midnight(now: dt.datetime | None = None) -> int:
    now = now or dt.datetime.now(dt.UTC)
    midnight = (now + dt.timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    return max(1, int((midnight - now).total_seconds()) + 1)


def today() -> str:
    """The day key a reservation made now is charged to."""
    return _day()


Seed = tuple[Sequence[tuple[str, float, int, int]], float]


def reserve(user_id: int, uid: str, cost: float, limits: Limits,
            seed: Callable[[], Seed] | None = None, day: str | None = None) -> str:
    """Take one running slot and ``cost`` GPU-seconds of ``day``'s budget for job ``uid``; returns the day.

    ``seed()`` is called only if Redis lacks a counter (it restarted, or the day is new): it returns
    (``jobs``, ``spent``) from the ledger, ``spent`` the charges of ``day`` and ``jobs`` (uid, charge,
    charge version, running 0/1) of the user's other jobs whose charge may still move (the unfinished
    ones, and those finished lately: a stage time may still arrive), read together so that each job's
    charge in ``spent`` is the one in ``jobs``. Each gets its per-job record, so a settlement after the
    restart moves the spend by exactly its correction. A repeat for the same ``uid`` takes nothing.
    Raises :class:`QuotaExceeded` (nothing taken) when a limit would be passed.
    """
    day = day or _day()
    head = (*_keys(user_id, day, uid), limits.max_concurrent_jobs, limits.gpu_seconds_per_day, float(cost))
    ok, reason = get_redis().eval(_RESERVE, 3, *head, 0.0, _DAY_TTL_S, _job_prefix(), 0)
    if int(ok) == -1:  # a counter is missing: seed it from the ledger (read only now, not on every submit)
        jobs, spent = seed() if seed is not None else ((), 0.0)
        flat = [v for u, c, ver, run in jobs for v in (u, float(c), int(ver), int(run))]
        ok, reason = get_redis().eval(_RESERVE, 3, *head, float(spent), _DAY_TTL_S, _job_prefix(), 1, *flat)
    if ok:
        return day
    if reason == b"concurrent":
        raise QuotaExceeded("concurrent", f"at most {limits.max_concurrent_jobs} jobs may run at once",
                            int(conf.get("CONCURRENCY_RETRY_AFTER_S")))
    raise QuotaExceeded("gpu_seconds", f"this job's {cost:.1f} GPU-seconds would pass today's "
                        f"{limits.gpu_seconds_per_day:g}", seconds_to_midnight())


def settle(user_id: int, day: str, uid: str, charge: float, version: int) -> bool:
    """A finished job: free its running slot (once) and make its charge ``charge`` (the ``version``-th
    charge the ledger set; older versions are ignored). Idempotent. True if the counters moved."""
    return bool(get_redis().eval(_SETTLE, 3, *_keys(user_id, day, uid), float(charge), int(version), _DAY_TTL_S))


def unreserve(user_id: int, day: str, uid: str) -> None:
    """Take back a reservation whose job never reached the engine."""
    get_redis().eval(_UNRESERVE, 3, *_keys(user_id, day, uid))


def usage(user_id: int) -> tuple[int, float]:
    """(running, GPU-seconds today) as the counters say (0 when absent)."""
    r = get_redis()
    running, spent = r.mget(_keys(user_id, _day())[:2])
    return int(running or 0), float(spent or 0.0)
