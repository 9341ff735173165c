"""The verbs transport's start-up self-test: its device-free logic here, its device path where there is one.

The pure parts (byte-order detection, the GLOB/HCA/NONE decision, the one-line refusal, the check sequence
run against words in plain memory that misbehave the ways a device could) run on every machine; the node's
refusal runs here too (this machine has no RDMA device, so the 'device' check fails). The device path skips
with the reason "no RDMA device" where there is none.
"""

from __future__ import annotations

import sys

import pytest

from engine.transport.errors import NoRdmaDevice
from engine.transport.verbs_selftest import (
    CPU,
    IBV_ATOMIC_GLOB,
    IBV_ATOMIC_HCA,
    IBV_ATOMIC_NONE,
    MASK64,
    NIC,
    PROBE_OLD,
    SelfTestFailed,
    atomic_path,
    detect_byte_order,
    refusal_message,
    run_checks,
)

VALUE = 0x0123456789ABCDEF


def test_the_byte_order_of_a_result_is_read_from_the_bytes_returned() -> None:
    assert detect_byte_order(VALUE, bytes.fromhex("efcdab8967452301")) == "little"
    assert detect_byte_order(VALUE, bytes.fromhex("0123456789abcdef")) == "big"


@pytest.mark.parametrize("returned", [bytes(8), bytes.fromhex("0123456789abcdee"), bytes.fromhex("efcdab89"),
                                      bytes.fromhex("67452301efcdab89")])
def test_a_result_in_neither_byte_order_fails_the_byte_order_check(returned: bytes) -> None:
    with pytest.raises(SelfTestFailed) as info:
        detect_byte_order(VALUE, returned, device="mlx5_0")
    assert info.value.check == "byte-order" and info.value.device == "mlx5_0"
    assert returned.hex() in str(info.value) and "neither byte order" in str(info.value)


def test_a_symmetric_probe_value_is_refused_as_a_probe() -> None:
    with pytest.raises(ValueError, match="asymmetric"):
        detect_byte_order(0x0101010101010101, bytes.fromhex("0101010101010101"))


def test_the_atomic_capability_decides_where_the_owners_atomics_run() -> None:
    assert atomic_path(IBV_ATOMIC_GLOB) == CPU  # coherent with the CPU: CPU atomics may stay
    assert atomic_path(IBV_ATOMIC_HCA) == NIC  # atomic only through the NIC: loopback atomics
    for cap, named in ((IBV_ATOMIC_NONE, "IBV_ATOMIC_NONE"), (7, "unknown value 7")):
        with pytest.raises(SelfTestFailed) as info:
            atomic_path(cap, "rxe0")
        assert info.value.check == "atomic-capability" and named in str(info.value)


def test_the_refusal_is_one_line_naming_the_check_and_the_device() -> None:
    line = refusal_message("cas-mismatch", "CAS returned 0x5\nand left 0x6\n", "mlx5_1")
    assert "\n" not in line
    assert "check 'cas-mismatch'" in line and "device 'mlx5_1'" in line and "returned 0x5 and left 0x6" in line
    assert "--transport tcp" in line  # what to do instead
    assert str(SelfTestFailed("cas-mismatch", "CAS returned 0x5\nand left 0x6\n", "mlx5_1")) == line


class SoftWord:
    """A ProbeWord in plain memory, returning atomic results in ``returns`` order, misbehaving as ``fault``
    says: what the self-test must tell apart from a working device."""

    def __init__(self, returns: str = "little", fault: str | None = None) -> None:
        self.mem, self.returns, self.fault = bytearray(8), returns, fault

    def put(self, value: int) -> None:
        self.mem[:] = value.to_bytes(8, sys.byteorder)

    def get(self) -> int:
        return int.from_bytes(self.mem, sys.byteorder)

    def _result(self, old: int) -> bytes:
        return bytes(8) if self.fault == "garbled-result" else old.to_bytes(8, self.returns)  # type: ignore[arg-type]

    def fetch_add(self, delta: int) -> bytes:
        old = self.get()
        if self.fault == "adds-in-the-other-byte-order":
            other = "big" if sys.byteorder == "little" else "little"
            self.mem[:] = ((int.from_bytes(self.mem, other) + delta) & MASK64).to_bytes(8, other)
        elif self.fault != "drops-the-add":
            self.put((old + delta) & MASK64)
        return self._result(old)

    def cas(self, compare: int, swap: int) -> bytes:
        old = self.get()
        if (old == compare and self.fault != "never-swaps") or self.fault == "always-swaps":
            self.put(swap)
        return self._result(old)

    def read(self) -> bytes:
        return bytes(reversed(self.mem)) if self.fault == "reads-reversed" else bytes(self.mem)


@pytest.mark.parametrize("order", ["little", "big"])
def test_a_working_device_passes_with_the_byte_order_it_returns(order: str) -> None:
    assert run_checks(SoftWord(returns=order)) == order


@pytest.mark.parametrize(("fault", "check"), [
    ("garbled-result", "byte-order"),
    ("adds-in-the-other-byte-order", "fetch-add"),
    ("drops-the-add", "fetch-add"),
    ("never-swaps", "compare-and-swap"),
    ("always-swaps", "cas-mismatch"),
    ("reads-reversed", "read-back"),
])
@pytest.mark.parametrize("order", ["little", "big"])
def test_each_misbehaviour_fails_the_check_that_names_it(order: str, fault: str, check: str) -> None:
    with pytest.raises(SelfTestFailed) as info:
        run_checks(SoftWord(returns=order, fault=fault), device="mlx5_0")
    assert info.value.check == check, str(info.value)
    assert "\n" not in str(info.value) and f"check {check!r}" in str(info.value)


def _has_rdma_device() -> str | None:
    """None where a device opens, else the reason there is none."""
    from engine.transport.verbs import open_device

    try:
        open_device().close()
    except NoRdmaDevice as exc:
        return str(exc)
    return None


@pytest.mark.timeout(120)
def test_the_node_refuses_to_start_with_one_line_naming_the_failed_check(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    from engine.cli import main

    if _has_rdma_device() is None:
        pytest.skip("this host has an RDMA device: the node's self-test may pass, so it would start")
    monkeypatch.delenv("ONEPIECE_RDMA_DEVICE", raising=False)
    rc = main(["node", "--etcd-url", "http://127.0.0.1:1", "--redis-url", "redis://127.0.0.1:1",
               "--run-dir", str(tmp_path), "--transport", "verbs"])
    out = capsys.readouterr().out
    assert rc == 2, out
    (line,) = out.splitlines()  # one line, and nothing started before it
    assert line.startswith("error: RDMA self-test failed at check 'device'"), line
    assert "no RDMA device" in line or "pyverbs is not installed" in line


def test_the_device_passes_its_self_test_and_the_owner_uses_the_path_it_decided(ring_name: str) -> None:
    reason = _has_rdma_device()
    if reason is not None:
        pytest.skip(f"no RDMA device ({reason})")
    from engine.transport.region import attach_region, create_region
    from engine.transport.verbs import preflight

    result = preflight()
    assert result.byte_order in ("little", "big") and result.path in (CPU, NIC)
    print(result.summary())
    owner = create_region(f"verbs://127.0.0.1:0/{ring_name}", 1 << 16)
    peer = attach_region(owner.address)
    try:
        # NIC path: no CPU atomics on this memory, so the rings' native fast paths (keyed on base) stay off
        assert hasattr(owner, "base") == (result.path == CPU)
        owner.store(64, PROBE_OLD)
        assert peer.fetch_add(64, 3) == PROBE_OLD
        assert owner.cas(64, PROBE_OLD + 3, 7) == PROBE_OLD + 3
        assert peer.cas(64, 7, 9) == 7 and owner.fetch_add(64, 1) == 9 and peer.load(64) == 10
    finally:
        peer.close()
        owner.close()
