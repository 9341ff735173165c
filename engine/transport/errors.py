"""Typed errors of the data plane. Each message names the sizes, peer or region involved."""

from __future__ import annotations


class TransportError(Exception):
    """Base class for every data-plane error."""


class RegionError(TransportError):
    """A memory region could not be created, attached or accessed."""


class RegionExists(RegionError):
    """Create refused: a region of that name is already there (left by a previous owner: recover it)."""


class RegionMismatch(RegionError):
    """Attach refused: the region's magic, version or size is not what was expected."""


class OutOfBounds(RegionError):
    """A one-sided operation would touch bytes outside the region."""


class MessageTooLarge(TransportError):
    """The message cannot fit in the ring even when it is empty."""

    def __init__(self, size: int, limit: int, ring: str) -> None:
        super().__init__(
            f"message of {size} bytes does not fit ring {ring!r}: the largest record it can hold is "
            f"{limit} bytes; create the ring with more buffer bytes or split the message"
        )
        self.size, self.limit, self.ring = size, limit, ring


class RingFull(TransportError):
    """No space appeared within the send timeout although the consumer is alive."""


class ConsumerGone(TransportError):
    """The consumer stopped heartbeating or its process is dead."""


class RecordError(TransportError):
    """A record in the buffer is malformed (bad magic, length or checksum)."""


class PeerUnavailable(TransportError):
    """The remote side of a link cannot be reached (connect or I/O failed)."""


class NoRdmaDevice(TransportError):
    """pyverbs is missing or the host has no RDMA device."""
