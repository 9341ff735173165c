"""The one interface through which the web layer acts on the engine.

The rule (docs/seams.md): the web layer *acts* on jobs (submit, status, wait,
cancel, result) only through an :class:`EngineClient`; it *reads* the engine's
shared state (the event stream, in-flight counts, the cluster's etcd keys) only
through the engine's public readers (:class:`engine.store.JobStore`,
:mod:`engine.coord.keys`), never by building a Redis or etcd key itself. It
never touches rings or workers. The client is chosen in settings by dotted path
(``ONEPIECE['ENGINE_CLIENT']``) like Django's cache backends:

* :class:`onepiece_platform.engine_link.proxy.ProxyEngineClient`: the Proxy's
  HTTP API (production, ``onepiece up``);
* :class:`onepiece_platform.engine_link.local.LocalEngineClient`: an
  in-process engine front over the real job store (Redis) with no workers,
  for tests and development; events are produced by whoever plays the workers.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass
from typing import Any

from django.utils.module_loading import import_string

from engine.store.keys import TERMINAL
from engine.workflow.options import DEFAULT as DEFAULT_OPTIONS
from engine.workflow.options import Options
from onepiece_platform import conf
from onepiece_platform.keyed import Keyed


@dataclass(frozen=True)
class Accepted:
    uid: str
    cost_gpu_s: float
    predicted_wait_s: float = 0.0


@dataclass(frozen=True)
class EngineStatus:
    """The engine's view of one job (its Redis status hash)."""

    uid: str
    state: str
    workflow: str
    stage: str
    progress: int
    detail: str = ""
    # an unfinished job's ETA as the Proxy estimates it (eta_s, eta_p90_s, provisional, queue_ahead;
    # engine.proxy.eta), None where the engine gives none
    eta: dict[str, Any] | None = None


@dataclass(frozen=True)
class ResultUrl:
    """A presigned GET for a completed job's output in the object store (engine.proxy.result_url): fetched
    from the store itself (Range included), by anyone holding it, until ``expires_at`` (Unix seconds)."""

    url: str
    expires_at: int
    size: int
    sha256: str
    content_type: str


class EngineError(Exception):
    """The engine could not be reached or answered nonsense (the API answers 503)."""


class EngineRejected(Exception):
    """The engine refused a submission.

    ``status`` is 400 (invalid: ``field`` names the culprit) or 503 (over
    capacity: ``retry_after`` seconds); the API passes both through unchanged.
    """

    def __init__(self, status: int, message: str, field: str = "", retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field
        self.retry_after = retry_after


def api_params(params: dict[str, Any], options: Options) -> dict[str, Any]:
    """A request's ``params`` as the engine's API takes them: the model's, and among them the options it
    takes there (``preview_every``, ``quality``, ``lora``: engine.workflow.options.PARAM_OPTIONS)."""
    return {**params, **options.params()}


class EngineClient(abc.ABC):
    """Submit, status, cancel and result of engine jobs. Implementations are thread-safe."""

    @abc.abstractmethod
    def submit(self, workflow: str, params: dict[str, Any], inputs: dict[str, bytes],
               options: Options = DEFAULT_OPTIONS, uid: str | None = None) -> Accepted:
        """Hand one request to the engine, named ``uid`` (32 hex digits) when given, else by the engine: its
        model ``params`` and its ``options`` (engine.workflow.options: priority, deadline, previews, quality,
        adapters; who may ask for which priority is checked before). ``params`` may also carry options as the
        engine's API takes them among its params (:func:`api_params`); those ``options`` sets win.

        Raises :class:`EngineRejected` (400 invalid, 409 ``uid`` already taken, 503 over capacity) or
        :class:`EngineError` (unreachable). Returns the job's UID.
        """

    @abc.abstractmethod
    def status(self, uid: str) -> EngineStatus | None:
        """The job's state, or None when the engine does not know the UID (never seen, or expired/lost)."""

    @abc.abstractmethod
    def cancel(self, uid: str) -> bool:
        """Ask every stage to drop the job; True if the engine knew it (finished or not)."""

    @abc.abstractmethod
    def result(self, uid: str) -> bytes | None:
        """The result bytes of a completed job, or None (not completed, expired or lost)."""

    @abc.abstractmethod
    def drop_result(self, uid: str) -> bool:
        """Delete a finished job's result bytes now instead of at their TTL; True if there were any.
        False too for a job still running (its result is yet to be written: cancel it first) or unknown."""

    def result_url(self, uid: str, expires_s: int = 3600) -> ResultUrl | None:
        """A presigned URL of a completed job's output in the engine's object store, good for ``expires_s``
        seconds; None when there is none (no object store, the job not completed, the output gone): the
        caller then serves :meth:`result` itself. This default knows of no store."""
        return None

    def wait(self, uid: str, timeout: float) -> EngineStatus | None:
        """The job's status once it is finished or ``timeout`` seconds have passed (None: unknown).

        This default asks :meth:`status` with a growing pause (20 ms to 0.5 s); an engine that can
        answer when the job ends (the Proxy's long poll) overrides it."""
        deadline = time.monotonic() + max(0.0, timeout)
        pause = 0.02
        while True:
            st = self.status(uid)
            left = deadline - time.monotonic()
            if st is None or st.state in TERMINAL or left <= 0:
                return st
            time.sleep(min(pause, left))
            pause = min(0.5, pause * 2)

    def limits(self, workflow: str) -> dict[str, dict[str, Any]] | None:
        """The loaded model's parameter limits and defaults for ``workflow`` (engine.workflow.limits), or
        None when the engine does not say: the workflow spec's own then apply (and the engine still
        refuses, naming the field, what its model cannot run). This default knows of none."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Release connections (optional)."""


_engines: Keyed[EngineClient] = Keyed(lambda key: import_string(key[0])(), lambda e: e.close())


def get_engine() -> EngineClient:
    """The configured client, one per (class, proxy URL)."""
    return _engines.get((conf.get("ENGINE_CLIENT"), conf.get("PROXY_URL")))


def reset_engines() -> None:
    _engines.clear()
