"""POSIX shared-memory regions: one host, native atomics, futex wake-ups.

Segments live in /dev/shm as ``onepiece-<name>`` (the prefix lets tests and
operators find leaks). The owner creates and unlinks; others attach.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from urllib.parse import ParseResult

from engine.transport import _atomics as _a
from engine.transport._atomics import cas64 as _cas64
from engine.transport._atomics import load64 as _load64
from engine.transport._atomics import store64 as _store64
from engine.transport.errors import RegionError, RegionExists
from engine.transport.layout import REMOTE
from engine.transport.region import MemoryRegion

SHM_DIR = "/dev/shm"
PREFIX = "onepiece-"


def shm_path(name: str) -> str:
    if not name or "/" in name or len(name) > 200:
        raise RegionError(f"invalid shared-memory name {name!r}: use 1-200 characters without '/'")
    return os.path.join(SHM_DIR, PREFIX + name)


def process_start_time(pid: int) -> int:
    """The kernel's start time of ``pid`` (clock ticks since boot), 0 if it does not exist.

    Together with the pid it identifies a process even when pids are reused.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return 0
    # the command name may contain spaces and parentheses: split after the last ')'
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):  # zombie or dead: it can no longer write
        return 0
    return int(fields[19])


class ShmRegion(MemoryRegion):
    # producers write the owner's pages with CPU stores: nothing travels but cache lines
    payload_integrity = True

    def __init__(self, name: str, fd: int, size: int, owner: bool, path: str | None = None) -> None:
        """Map ``fd`` (-1: anonymous memory private to this process, used by the TCP agent)."""
        self.name = name
        self.size = size
        self.owner = owner
        self._path = path
        # MAP_POPULATE faults every page in now, not one page per message on the first lap
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        self._mm = mmap.mmap(fd, size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
        if fd >= 0:
            os.close(fd)
        anchor = ctypes.c_char.from_buffer(self._mm)
        self.base = ctypes.addressof(anchor)
        del anchor  # release the export so close() can unmap
        self._view = memoryview(self._mm)
        self._last_word = size - 8
        self._closed = False

    # one-sided operations -------------------------------------------------
    def read_into(self, offset: int, out: memoryview) -> None:
        n = len(out)
        self._check(offset, n)
        out[:] = self._view[offset : offset + n]

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        n = len(data) if not isinstance(data, memoryview) else data.nbytes
        self._check(offset, n)
        self._view[offset : offset + n] = data

    def _word(self, offset: int) -> int:
        if offset & 7 or offset < 0 or offset + 8 > self.size:
            raise RegionError(f"region {self.name!r}: bad 64-bit word offset {offset}")
        return self.base + offset

    # the checks are inlined: these four are on every message's path
    def cas(self, offset: int, expected: int, desired: int) -> int:
        if offset & 7 or not 0 <= offset <= self._last_word:
            self._word(offset)
        return _cas64(self.base + offset, expected, desired)

    def fetch_add(self, offset: int, delta: int) -> int:
        if offset & 7 or not 0 <= offset <= self._last_word:
            self._word(offset)
        return _a.faa64(self.base + offset, delta)

    def load(self, offset: int) -> int:
        if offset & 7 or not 0 <= offset <= self._last_word:
            self._word(offset)
        return _load64(self.base + offset)

    def store(self, offset: int, value: int) -> None:
        if offset & 7 or not 0 <= offset <= self._last_word:
            self._word(offset)
        _store64(self.base + offset, value)

    def local_view(self) -> memoryview:
        return self._view

    def notify(self, offset: int) -> None:
        addr = self._word(offset & ~7) + (offset & 7)
        _a.faa32(addr, 1)
        _a.futex_wake(addr, 1 << 30)

    def wait(self, offset: int, expected: int, timeout: float) -> bool:
        addr = self._word(offset & ~7) + (offset & 7)
        return bool(_a.futex_wait(addr, expected & 0xFFFFFFFF, max(timeout, 0.0)))

    def load32(self, offset: int) -> int:
        return _a.load32(self._word(offset & ~7) + (offset & 7))

    def identity(self) -> tuple[int, int]:
        pid = os.getpid()
        return pid, process_start_time(pid)

    def peer_alive(self, pid: int, start_time: int) -> bool:
        if pid & REMOTE:
            return True  # not ours to judge: the remote backend's agent tracks it
        return pid > 0 and process_start_time(pid) == start_time

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._view.release()
        try:
            self._mm.close()
        except BufferError:
            # a zero-copy view handed out by a ring is still alive; the mapping
            # goes away with the last reference, the name below regardless
            pass
        if self.owner and self._path:
            try:
                os.unlink(self._path)
            except FileNotFoundError:
                pass


def open_segment(name: str, size: int | None) -> tuple[int, int, str]:
    """(fd, size, path) of the segment ``name``: created exclusively with ``size`` bytes, or,
    with ``size`` None, the existing one (a restarted owner re-opening what its predecessor left)."""
    path = shm_path(name)
    if size is None:
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise RegionError(f"no shared-memory region {name!r} ({path}): is its consumer running?") from None
        return fd, os.fstat(fd).st_size, path
    if size <= 0:
        raise RegionError(f"region size must be positive, got {size}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    except FileExistsError:
        raise RegionExists(f"shared-memory region {name!r} already exists ({path})") from None
    try:
        os.ftruncate(fd, size)
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        raise RegionError(f"cannot size region {name!r} to {size} bytes: {exc}") from exc
    return fd, size, path


def create(u: ParseResult, size: int) -> ShmRegion:
    name = u.netloc or u.path.lstrip("/")
    fd, size, path = open_segment(name, size)
    return ShmRegion(name, fd, size, owner=True, path=path)


def attach(u: ParseResult) -> ShmRegion:
    name = u.netloc or u.path.lstrip("/")
    fd, size, path = open_segment(name, None)
    return ShmRegion(name, fd, size, owner=False, path=path)


def reopen(u: ParseResult) -> ShmRegion:
    """Take over a region whose owner died (same host): it is ours to unlink now."""
    region = attach(u)
    region.owner = True
    return region
