"""The verbs transport's start-up self-test: what it checks and decides, without a device.

``engine.transport.verbs`` runs :func:`run_checks` once per process and device, through a loopback
queue pair on the device itself, before any region takes traffic. Everything here is device-free so
that it runs (and is tested) on hosts without RDMA:

- :func:`atomic_path`: the device's reported atomic capability (``ibv_device_attr.atomic_caps``)
  decides where the owner's own updates of its words go. ``IBV_ATOMIC_GLOB``: the NIC's atomics are
  atomic with the CPU's, so the owner keeps its CPU atomics (and the rings' native fast paths).
  ``IBV_ATOMIC_HCA``: the NIC's atomics are atomic only with other operations through the same NIC,
  so the owner's CAS / fetch-add / store go through the NIC too (loopback atomics). ``IBV_ATOMIC_NONE``
  (or an unknown value): refused.
- :func:`detect_byte_order`: the byte order in which the device returns an atomic's old value into
  the requester's buffer, determined from a known asymmetric value, never assumed.
- :func:`refusal_message`: the one line a node prints when a check fails, naming the check.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Protocol

from engine.transport.errors import TransportError

# enum ibv_atomic_cap (infiniband/verbs.h)
IBV_ATOMIC_NONE, IBV_ATOMIC_HCA, IBV_ATOMIC_GLOB = 0, 1, 2
CPU, NIC = "cpu", "nic"  # where the owner's own atomics run

# the checks, in the order they run; each failure names one
CHECK_DEVICE = "device"  # pyverbs imports and the configured device opens
CHECK_CAPABILITY = "atomic-capability"  # the device reports remote atomics (HCA or GLOB)
CHECK_LOOPBACK = "loopback-qp"  # a queue pair connected to another on the same device reaches RTS
CHECK_COMPLETION = "completion"  # each posted operation completes, successfully, in time
CHECK_BYTE_ORDER = "byte-order"  # the fetch-add returns the known old value in one byte order
CHECK_FETCH_ADD = "fetch-add"  # the word then holds old + delta, in the host's order
CHECK_CAS = "compare-and-swap"  # a matching CAS returns the old value and swaps
CHECK_CAS_MISMATCH = "cas-mismatch"  # a CAS with a stale compare value returns the current one, swaps nothing
CHECK_READ_BACK = "read-back"  # an RDMA READ of the word returns its bytes as the CPU sees them

# known asymmetric values: no byte order reads either of them as itself
PROBE_OLD = 0x0123456789ABCDEF
PROBE_DELTA = 0x0000010000000011  # carries into an upper byte: an add in the wrong byte order shows
PROBE_SWAP = 0xF0E1D2C3B4A59687
MASK64 = (1 << 64) - 1

_CAPABILITY_NAMES = {IBV_ATOMIC_NONE: "IBV_ATOMIC_NONE", IBV_ATOMIC_HCA: "IBV_ATOMIC_HCA",
                     IBV_ATOMIC_GLOB: "IBV_ATOMIC_GLOB"}


def refusal_message(check: str, detail: str, device: str | None = None) -> str:
    """One line: which check failed (and on which device), why, and what to do instead."""
    where = f" on device {device!r}" if device else ""
    why = " ".join(str(detail).split())
    return (f"RDMA self-test failed at check {check!r}{where}: {why}; the verbs transport is not usable here "
            f"(run with --transport tcp / ONEPIECE_TRANSPORT=tcp, see docs/operations.md, 'RDMA hosts')")


class SelfTestFailed(TransportError):
    """The verbs self-test failed; ``str()`` is the one-line refusal naming the check."""

    def __init__(self, check: str, detail: str, device: str | None = None) -> None:
        super().__init__(refusal_message(check, detail, device))
        self.check, self.detail, self.device = check, detail, device


def atomic_path(capability: int, device: str | None = None) -> str:
    """``CPU`` (GLOB), ``NIC`` (HCA), or SelfTestFailed naming ``atomic-capability``."""
    if capability == IBV_ATOMIC_GLOB:
        return CPU
    if capability == IBV_ATOMIC_HCA:
        return NIC
    name = _CAPABILITY_NAMES.get(capability, f"unknown value {capability!r}")
    raise SelfTestFailed(CHECK_CAPABILITY, f"the device reports atomic capability {name}: the rings need remote "
                         f"compare-and-swap and fetch-add (IBV_ATOMIC_HCA or IBV_ATOMIC_GLOB)", device)


def detect_byte_order(expected_old: int, returned: bytes, device: str | None = None,
                      check: str = CHECK_BYTE_ORDER) -> str:
    """``"little"`` or ``"big"``: the order in which ``returned`` (an atomic's 8 result bytes) holds
    ``expected_old``; SelfTestFailed naming ``check`` when it is neither."""
    little, big = expected_old.to_bytes(8, "little"), expected_old.to_bytes(8, "big")
    if little == big:
        raise ValueError(f"{expected_old:#018x} reads the same in both byte orders: probe with an asymmetric value")
    returned = bytes(returned)
    if returned == little:
        return "little"
    if returned == big:
        return "big"
    raise SelfTestFailed(check, f"the atomic returned bytes {returned.hex()} ({len(returned)} bytes), which are "
                         f"the old value {expected_old:#018x} in neither byte order (little {little.hex()}, "
                         f"big {big.hex()})", device)


class ProbeWord(Protocol):
    """One 8-byte word in registered memory, reached both ways: by the CPU and through the NIC."""

    def put(self, value: int) -> None:
        """CPU store, host byte order."""

    def get(self) -> int:
        """CPU load, host byte order."""

    def fetch_add(self, delta: int) -> bytes:
        """ATOMIC FETCH_AND_ADD through the NIC; the 8 bytes it returned."""

    def cas(self, compare: int, swap: int) -> bytes:
        """ATOMIC CMP_AND_SWP through the NIC; the 8 bytes it returned."""

    def read(self) -> bytes:
        """RDMA READ of the word through the NIC; its 8 bytes."""


@dataclass(frozen=True)
class SelfTestResult:
    """What a device passed with: where the owner's atomics run and how results come back."""

    device: str
    capability: int
    path: str  # CPU or NIC
    byte_order: str  # of the 8 bytes an atomic returns: "little" or "big"

    def summary(self) -> str:
        cap = _CAPABILITY_NAMES.get(self.capability, str(self.capability))
        owner = "CPU atomics" if self.path == CPU else "loopback NIC atomics"
        return (f"RDMA self-test passed on {self.device!r} ({cap}; the owner's updates use {owner}; atomic "
                f"results are {self.byte_order}-endian)")


def run_checks(word: ProbeWord, device: str | None = None) -> str:
    """Fetch-add, CAS (matching and stale) and RDMA READ on ``word``; the byte order of atomic results.
    Raises SelfTestFailed naming the first check that fails."""
    old, new = PROBE_OLD, (PROBE_OLD + PROBE_DELTA) & MASK64
    word.put(old)
    order = detect_byte_order(old, word.fetch_add(PROBE_DELTA), device)
    if (held := word.get()) != new:
        raise SelfTestFailed(CHECK_FETCH_ADD, f"after adding {PROBE_DELTA:#x} to {old:#018x} the word holds "
                             f"{held:#018x}, expected {new:#018x}", device)
    got = int.from_bytes(word.cas(new, PROBE_SWAP), order)
    held = word.get()
    if got != new or held != PROBE_SWAP:
        raise SelfTestFailed(CHECK_CAS, f"CAS({new:#018x} -> {PROBE_SWAP:#018x}) returned {got:#018x} and left "
                             f"{held:#018x}; expected {new:#018x} and {PROBE_SWAP:#018x}", device)
    got = int.from_bytes(word.cas(old, 0), order)
    held = word.get()
    if got != PROBE_SWAP or held != PROBE_SWAP:
        raise SelfTestFailed(CHECK_CAS_MISMATCH, f"CAS with stale compare {old:#018x} returned {got:#018x} and "
                             f"left {held:#018x}; expected both {PROBE_SWAP:#018x}", device)
    raw = bytes(word.read())
    if raw != PROBE_SWAP.to_bytes(8, sys.byteorder):
        raise SelfTestFailed(CHECK_READ_BACK, f"RDMA READ returned bytes {raw.hex()}, the CPU holds "
                             f"{PROBE_SWAP.to_bytes(8, sys.byteorder).hex()}", device)
    return order
