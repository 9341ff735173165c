"""The zero-loss multi-producer, single-consumer double ring buffer.

The protocol is in docs/ring-protocol.md (and, as a Promela model, in
engine/transport/model/ring.pml). In short: producers reserve a slot and a
byte span with one CAS on TAIL, claim the slot with a CAS on its state word,
write header + payload, and commit with a second CAS; the consumer steals a
slot whose producer stalls past the lock timeout, which fences that producer
(its commit CAS fails) and quarantines the span until the producer
acknowledges or dies. Records carry (producer, epoch, seq) and an xxh3
checksum; producers keep messages until the consumer acknowledges them and
resend what was dropped; the consumer drops duplicates.

Everything goes through :class:`~engine.transport.region.MemoryRegion`, so the
same code runs over shared memory, the TCP emulation and RDMA verbs.
"""


from __future__ import annotations

from engine.transport.region import attach_region
from engine.transport.ring.base import RingConfig, RingStats
from engine.transport.ring.consumer import Batch, Delivery, RingConsumer
from engine.transport.ring.producer import Reservation, RingProducer

__all__ = [
    "Batch",
    "Delivery",
    "Reservation",
    "RingConfig",
    "RingConsumer",
    "RingProducer",
    "RingStats",
    "attach_producer",
    "create_ring",
]


def create_ring(address: str, config: RingConfig | None = None) -> RingConsumer:
    """Create a ring at ``address`` (``shm://NAME`` or ``tcp://HOST:PORT/NAME``) and return its consumer."""
    return RingConsumer.create(address, config)


def attach_producer(address: str, producer_id: int | None = None, **kwargs: float) -> RingProducer:
    """Attach to the ring at ``address`` as a producer."""
    return RingProducer(attach_region(address), producer_id, **kwargs)

