"""Memory regions with one-sided operations, and the factory that picks a backend.

A region is a flat byte range owned by one process (the consumer of a ring) and
accessed by others through one-sided operations only: read, write, 64-bit
compare-and-swap and fetch-add. Backends:

- ``shm``: POSIX shared memory on one host; atomics are native C calls.
- ``tcp``: the same operations emulated over TCP by an agent thread in the owner.
- ``verbs``: RDMA through pyverbs (RC queue pairs, RDMA WRITE/READ, ATOMIC CMP_AND_SWP).

Addresses are ``shm://NAME``, ``tcp://HOST:PORT/NAME`` and ``verbs://HOST:PORT/NAME``
(for verbs the TCP address is where connection information is exchanged).
"""

from __future__ import annotations

import abc
import importlib
from urllib.parse import urlparse

from engine.transport.errors import OutOfBounds, RegionError, RegionMismatch


class MemoryRegion(abc.ABC):
    """One-sided access to a region of ``size`` bytes.

    Contract: 64-bit operations take 8-byte-aligned offsets and are atomic with
    respect to each other across every process attached to the region. ``write``
    of a whole 8-byte-aligned word is atomic too; longer writes are not.
    """

    name: str
    size: int
    # Whether every byte a producer writes arrives in the owner's memory as written, checked by the
    # transport itself (not by the ring's checksum): what a ring needs for RingConfig.verify_payload=False.
    payload_integrity: bool = False

    @abc.abstractmethod
    def read_into(self, offset: int, out: memoryview) -> None:
        """Copy ``len(out)`` bytes at ``offset`` into ``out``."""

    def read(self, offset: int, n: int) -> bytes:
        buf = bytearray(n)
        self.read_into(offset, memoryview(buf))
        return bytes(buf)

    @abc.abstractmethod
    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Copy ``data`` into the region at ``offset``."""

    @abc.abstractmethod
    def cas(self, offset: int, expected: int, desired: int) -> int:
        """Compare-and-swap the 64-bit word at ``offset``; returns the previous value."""

    @abc.abstractmethod
    def fetch_add(self, offset: int, delta: int) -> int:
        """Atomically add ``delta`` (mod 2**64) to the word at ``offset``; returns the previous value."""

    @abc.abstractmethod
    def load(self, offset: int) -> int:
        """Atomic 64-bit read."""

    @abc.abstractmethod
    def store(self, offset: int, value: int) -> None:
        """Atomic 64-bit write."""

    def local_view(self) -> memoryview | None:
        """A writable zero-copy view of the whole region, or None where it is remote."""
        return None

    def notify(self, offset: int) -> None:  # noqa: B027 - optional hook
        """Wake a process sleeping in :meth:`wait` on the 32-bit word at ``offset``, if the backend can."""

    def wait(self, offset: int, expected: int, timeout: float) -> bool:
        """Sleep until the 32-bit word at ``offset`` differs from ``expected`` or ``timeout`` passes.

        Backends without a wake-up mechanism sleep briefly and return True.
        """
        import time

        time.sleep(min(timeout, 0.0005))
        return True

    def identity(self) -> tuple[int, int]:
        """(pid, start time) that identifies this end to the region's owner; see :meth:`peer_alive`."""
        return 0, 0

    def peer_alive(self, pid: int, start_time: int) -> bool:
        """Whether a producer registered with ``pid`` / ``start_time`` may still write.

        The default (remote producers) is True until the backend learns otherwise.
        """
        return True

    @abc.abstractmethod
    def close(self) -> None:
        """Detach; the owner also destroys the region."""

    def _check(self, offset: int, n: int) -> None:
        if offset < 0 or n < 0 or offset + n > self.size:
            raise OutOfBounds(f"region {self.name!r}: [{offset}, {offset + n}) outside [0, {self.size})")

    def __enter__(self) -> MemoryRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_BACKENDS = {
    "shm": "engine.transport.shm",
    "tcp": "engine.transport.tcp",
    "verbs": "engine.transport.verbs",
}


def _backend(scheme: str):
    try:
        return importlib.import_module(_BACKENDS[scheme])
    except KeyError:
        raise RegionError(f"unknown transport {scheme!r}; choose one of {sorted(_BACKENDS)}") from None


def create_region(address: str, size: int) -> MemoryRegion:
    """Create (own) a region at ``address``; for tcp/verbs this also starts serving it."""
    u = urlparse(address)
    return _backend(u.scheme).create(u, size)


def reopen_region(address: str) -> MemoryRegion:
    """Take over the region at ``address`` that a dead owner on this host left behind (ring recovery);
    for tcp/verbs this serves it again at the same address."""
    u = urlparse(address)
    return _backend(u.scheme).reopen(u)


def attach_region(address: str, *, expected_size: int | None = None) -> MemoryRegion:
    """Attach to a region created elsewhere; refuses a size other than ``expected_size``."""
    u = urlparse(address)
    region = _backend(u.scheme).attach(u)
    if expected_size is not None and region.size != expected_size:
        region.close()
        raise RegionMismatch(f"region {address!r} has {region.size} bytes, expected {expected_size}")
    return region
