"""One-sided operations behave the same on every backend, and bad access is refused clearly."""

from __future__ import annotations

import threading

import pytest

from engine.transport.errors import OutOfBounds, RegionError, RegionExists, RegionMismatch
from engine.transport.region import attach_region, create_region
from engine.transport.ring import RingConfig, RingConsumer, RingProducer


@pytest.fixture(params=["shm", "tcp"])
def region_pair(request, ring_name):
    if request.param == "shm":
        owner = create_region(f"shm://{ring_name}", 1 << 16)
        peer = attach_region(f"shm://{ring_name}")
    else:
        owner = create_region(f"tcp://127.0.0.1:0/{ring_name}", 1 << 16)
        peer = attach_region(owner.address)
    yield owner, peer
    peer.close()
    owner.close()


def test_one_sided_ops_are_visible_to_the_owner(region_pair) -> None:
    owner, peer = region_pair
    assert peer.size == owner.size == 1 << 16
    peer.write(100, b"hello")
    assert bytes(owner.local_view()[100:105]) == b"hello"
    assert peer.read(100, 5) == b"hello"
    assert peer.cas(64, 0, 7) == 0
    assert peer.cas(64, 0, 9) == 7  # failed CAS returns the current value
    assert owner.load(64) == 7
    assert peer.fetch_add(64, 5) == 7
    assert peer.fetch_add(64, (1 << 64) - 1) == 12  # -1
    assert owner.load(64) == 11
    peer.store(128, 2**64 - 1)
    assert owner.load(128) == 2**64 - 1


def test_cas_is_atomic_between_owner_and_peer(region_pair) -> None:
    owner, peer = region_pair
    n = 300

    def bump(region) -> None:
        for _ in range(n):
            while True:
                v = region.load(0)
                if region.cas(0, v, v + 1) == v:
                    break

    t = threading.Thread(target=bump, args=(peer,), name="onepiece-test-bump")
    t.start()
    bump(owner)
    t.join()
    assert owner.load(0) == 2 * n


def test_out_of_bounds_and_misaligned_access_is_refused(region_pair) -> None:
    _owner, peer = region_pair
    with pytest.raises(OutOfBounds):
        peer.write(peer.size - 2, b"xyz")
    with pytest.raises(OutOfBounds):
        peer.read(-1, 4)
    with pytest.raises(RegionError):
        peer.cas(3, 0, 1)


def test_attach_to_missing_shm_region_names_it(ring_name) -> None:
    with pytest.raises(RegionError, match=ring_name):
        attach_region(f"shm://{ring_name}")


@pytest.mark.parametrize("scheme", ["shm", "tcp"])
def test_creating_a_region_twice_is_a_typed_error(scheme: str, ring_name: str) -> None:
    prefix = "shm://" if scheme == "shm" else "tcp://127.0.0.1:0/"
    owner = create_region(f"{prefix}{ring_name}", 1 << 12)
    try:
        with pytest.raises(RegionExists, match=ring_name):
            create_region(f"{prefix}{ring_name}", 1 << 12)
    finally:
        owner.close()


def test_unknown_transport_is_refused() -> None:
    with pytest.raises(RegionError, match="unknown transport"):
        create_region("carrier-pigeon://x", 10)


def test_attach_with_wrong_size_is_refused(ring_name) -> None:
    with create_region(f"shm://{ring_name}", 8192), pytest.raises(RegionMismatch, match="expected 4096"):
        attach_region(f"shm://{ring_name}", expected_size=4096)


def test_producer_refuses_a_region_without_a_ring(ring_name) -> None:
    with create_region(f"shm://{ring_name}", 1 << 16) as owner:
        with pytest.raises(RegionMismatch, match="no OnePiece ring"):
            RingProducer(attach_region(f"shm://{ring_name}"))
        del owner


def test_producer_refuses_another_ring_version(ring_name) -> None:
    from engine.transport import layout as L

    c = RingConsumer.create(f"shm://{ring_name}", RingConfig(slots=8, buffer_bytes=1 << 14, max_producers=2))
    try:
        c.region.store(L.C_VERSION, 99)
        with pytest.raises(RegionMismatch, match="version 99"):
            RingProducer(attach_region(f"shm://{ring_name}"))
    finally:
        c.close()


def test_consumer_refuses_a_region_of_the_wrong_size(ring_name) -> None:
    region = create_region(f"shm://{ring_name}", 1 << 16)
    try:
        with pytest.raises(RegionMismatch, match="needs"):
            RingConsumer(region, RingConfig(slots=8, buffer_bytes=1 << 14, max_producers=2))
    finally:
        region.close()


def test_verbs_backend_needs_an_rdma_device(ring_name) -> None:
    from engine.transport.errors import NoRdmaDevice
    from engine.transport.verbs import open_device

    try:
        ctx = open_device()
    except NoRdmaDevice as exc:
        pytest.skip(f"no RDMA device on this machine ({exc})")
    ctx.close()
    owner = create_region(f"verbs://127.0.0.1:0/{ring_name}", 1 << 16)
    peer = attach_region(owner.address)
    try:
        assert peer.cas(64, 0, 5) == 0 and owner.load(64) == 5
        peer.write(128, b"rdma")
        assert bytes(owner.local_view()[128:132]) == b"rdma"
    finally:
        peer.close()
        owner.close()
