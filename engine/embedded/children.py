"""How ``onepiece up`` (and the test fixtures) start the processes they own.

Every child gets three things:

- its own session (``start_new_session``): Ctrl-C in the terminal reaches the launcher alone,
  which then stops its children in order (web first, redis and etcd last);
- ``SIGTERM`` when its parent dies, however it dies (``PR_SET_PDEATHSIG``): a launcher killed with
  ``SIGKILL`` or by the OOM killer no longer leaves redis, etcd, the workers and the web process
  running with nobody to stop them. The signal goes when the *thread* that started the child ends,
  so children are started from the launcher's main thread;
- the state folder's lock (:mod:`engine.embedded.statelock`) while it lives, when the process holds
  one: the lock is ``flock(2)`` on an open file that children inherit (``pass_fds``), so the next
  ``onepiece up`` is refused, naming them, for as long as any of them still runs, instead of starting
  a second redis over the same data folder. The descriptor's number travels in ``ONEPIECE_STATE_LOCK_FD``,
  so a child that starts processes of its own (the node its stage workers) passes it on.

The parent-death signal is set between ``fork`` and ``exec`` (``preexec_fn``) through ``prctl``,
resolved in the parent, and the child exits at once if its parent died before the signal was set
(the one race ``PR_SET_PDEATHSIG`` leaves open). ``preexec_fn`` runs Python in the forked child, which
the standard library calls unsafe while other threads run; here it only calls a function resolved
before the fork, and every spawn in ``onepiece up`` and the node happens before their threads start
(a test that restarts redis under load is the exception, and a stuck start would time out, not hang).
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
from collections.abc import Callable, Sequence
from typing import Any

from engine import envs

PR_SET_PDEATHSIG = 1
LOCK_FD_ENV = "ONEPIECE_STATE_LOCK_FD"

_inherited_fds: tuple[int, ...] = ()
_prctl: Any = None


def hold_in_children(fd: int | None) -> None:
    """Children started from now on inherit ``fd`` (the state folder's lock); ``None`` stops that."""
    global _inherited_fds
    _inherited_fds = () if fd is None else (fd,)


def _held() -> tuple[int, ...]:
    """The lock descriptor to hand on: this process's own, or the one its parent handed it."""
    if _inherited_fds:
        return _inherited_fds
    raw = envs.STATE_LOCK_FD
    if not raw.isdigit():
        return ()
    try:  # still the lock file (not closed, its number not reused for something else)
        return (int(raw),) if os.readlink(f"/proc/self/fd/{raw}").endswith("/lock") else ()
    except OSError:
        return ()


def _die_with_parent() -> Callable[[], None]:
    global _prctl
    if _prctl is None:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl, parent, sig = _prctl, os.getpid(), int(signal.SIGTERM)

    def preexec() -> None:  # in the child, between fork and exec: no imports, no locks
        if prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0 or os.getppid() != parent:
            os._exit(125)

    return preexec


def popen(argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(argv, **kwargs)`` as a child of this process: its own session, ``SIGTERM``
    when this process dies, the state lock inherited (see the module's docstring). ``stdin`` defaults
    to ``/dev/null``: a child never reads the launcher's terminal."""
    kwargs.setdefault("stdin", subprocess.DEVNULL)
    held = _held()
    if held:
        kwargs["env"] = {**(kwargs.get("env") or os.environ), LOCK_FD_ENV: str(held[0])}
    pass_fds = tuple(kwargs.pop("pass_fds", ())) + held
    return subprocess.Popen(list(argv), start_new_session=True, preexec_fn=_die_with_parent(),
                            pass_fds=pass_fds, **kwargs)
