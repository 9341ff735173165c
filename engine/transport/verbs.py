"""RDMA verbs regions through pyverbs: RC queue pairs, RDMA WRITE/READ, ATOMIC CMP_AND_SWP / FETCH_AND_ADD.

The owner registers its memory once and keeps a TCP control agent (the same
agent as the ``tcp`` backend) through which each peer exchanges queue-pair
information before taking traffic; doorbells also travel over it. Each peer
gets its own RC queue pair; when its control connection drops, the owner moves
that queue pair to the error state, so a fenced or dead peer can write nothing
more (the hardware's version of the ring's quarantine rule).

Before a process uses a device (owner or peer), it runs the self-test of
:mod:`engine.transport.verbs_selftest` on it once, through a loopback queue pair:
remote fetch-add and CAS on a known word, read back, the byte order of atomic
results determined (never assumed). ``IBV_ATOMIC_GLOB`` devices keep the owner's
CPU atomics; on ``IBV_ATOMIC_HCA`` devices (most current NICs) the owner's own
CAS / fetch-add / store go through the NIC as well (:class:`NicAtomicsServedRegion`),
so every update of a word is atomic with every other. ``onepiece node
--transport verbs`` runs it before it starts (:func:`preflight`) and refuses
with one line naming the failed check.

Requirements: the distribution's pyverbs matching its rdma-core (docs/operations.md,
"RDMA hosts"). Written after rdma-core's pyverbs examples; no machine in CI has an
RDMA device, so the device path's tests stop at "no RDMA device" (the self-test's
logic is tested without one).
"""

from __future__ import annotations

import struct
import sys
import threading
import time
from typing import Any

from engine import envs
from engine.transport._atomics import load64 as _load64
from engine.transport.errors import NoRdmaDevice, PeerUnavailable, RegionError
from engine.transport.region import MemoryRegion
from engine.transport.tcp import (
    OP_NOTIFY,
    OP_WAIT,
    TcpRegion,
    TcpServedRegion,
    served_backend,
)
from engine.transport.verbs_selftest import (
    CHECK_COMPLETION,
    CHECK_DEVICE,
    CHECK_LOOPBACK,
    CPU,
    MASK64,
    SelfTestFailed,
    SelfTestResult,
    atomic_path,
    run_checks,
)

OP_VERBS_CONNECT = 32
# qp_num, psn, lid, gid (16 bytes), [owner: addr, rkey, size]
PEER_INFO = struct.Struct("<IIH16s")
OWNER_INFO = struct.Struct("<IIH16sQIQ")
STAGING_BYTES = 16 << 20
SELFTEST_OP_TIMEOUT_S = 5.0  # each self-test operation completes within this, or the check fails


def _pyverbs() -> Any:
    try:
        import pyverbs.enums as e
        from pyverbs import addr, cq, device, mr, pd, qp, wr
    except ImportError as exc:
        raise NoRdmaDevice(
            "pyverbs is not installed: install the distribution's python3-pyverbs matching its rdma-core "
            "(docs/operations.md, 'RDMA hosts')"
        ) from exc
    return e, addr, cq, device, mr, pd, qp, wr


def _open() -> tuple[Any, str]:
    """(context, name) of the configured (or first) RDMA device; NoRdmaDevice when there is none."""
    _e, _addr, _cq, device, *_ = _pyverbs()
    from pyverbs.pyverbs_error import PyverbsError

    try:
        devices = device.get_device_list()
    except PyverbsError as exc:
        raise NoRdmaDevice(f"no RDMA device: {exc}") from exc
    if not devices:
        raise NoRdmaDevice("no RDMA device: the device list is empty")
    want = envs.RDMA_DEVICE
    names = [d.name.decode() for d in devices]
    name = want or names[0]
    if name not in names:
        raise NoRdmaDevice(f"RDMA device {name!r} not found; present: {names}")
    return device.Context(name=name), name


def open_device() -> Any:
    """Open the configured (or first) RDMA device; NoRdmaDevice when there is none. Not yet self-tested."""
    return _open()[0]


def _post_wait(ep: _Endpoint, e: Any, staging: Any, opcode: int, raddr: int, rkey: int, length: int,
               compare: int = 0, swap: int = 0, timeout: float | None = None) -> None:
    """Post one signaled work request on ``ep`` (data in / out of ``staging``) and poll its completion.
    PeerUnavailable on an error completion; TimeoutError when ``timeout`` passes first."""
    from pyverbs.wr import SGE, SendWR

    sge = SGE(staging.buf, length, staging.lkey)
    wr = SendWR(opcode=opcode, num_sge=1, sg=[sge], send_flags=e.IBV_SEND_SIGNALED)
    if opcode in (e.IBV_WR_ATOMIC_CMP_AND_SWP, e.IBV_WR_ATOMIC_FETCH_AND_ADD):
        wr.set_wr_atomic(rkey, raddr, compare, swap)
    else:
        wr.set_wr_rdma(rkey, raddr)
    ep.qp.post_send(wr)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        n, wcs = ep.cq.poll()
        if n:
            if wcs[0].status != e.IBV_WC_SUCCESS:
                raise PeerUnavailable(f"RDMA work completion status {wcs[0].status} (opcode {opcode})")
            return
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"no completion within {timeout}s (opcode {opcode})")


_RESULTS: dict[str, SelfTestResult] = {}  # device name -> its passed self-test (once per process)
_RESULTS_LOCK = threading.Lock()


def self_test(ctx: Any, name: str) -> SelfTestResult:
    """The device's self-test (run once per process and device, then remembered); SelfTestFailed
    naming the failed check."""
    with _RESULTS_LOCK:
        if name not in _RESULTS:
            _RESULTS[name] = _run_self_test(ctx, name)
        return _RESULTS[name]


def _run_self_test(ctx: Any, name: str) -> SelfTestResult:
    e, _addr, _cq, _device, mr, pd, *_ = _pyverbs()
    from pyverbs.pyverbs_error import PyverbsError

    try:
        capability = int(ctx.query_device().atomic_caps)
    except PyverbsError as exc:
        raise SelfTestFailed(CHECK_DEVICE, f"query_device failed: {exc}", name) from exc
    path = atomic_path(capability, name)
    owned: list[Any] = []
    try:
        try:
            owned.append(pd.PD(ctx))
            access = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_ATOMIC)
            owned.append(mr.MR(owned[0], 64, access))
        except PyverbsError as exc:
            raise SelfTestFailed(CHECK_DEVICE, f"cannot allocate a protection domain and memory region: {exc}",
                                 name) from exc
        try:
            owned.append(_Loopback(ctx, owned[0]))
        except PyverbsError as exc:
            raise SelfTestFailed(CHECK_LOOPBACK, f"cannot bring a loopback queue pair to RTS: {exc}", name) from exc
        order = run_checks(_DeviceWord(owned[2], owned[1], name), name)
    finally:
        for obj in reversed(owned):
            try:
                obj.close()
            except Exception:
                pass
    return SelfTestResult(device=name, capability=capability, path=path, byte_order=order)


def preflight() -> SelfTestResult:
    """What ``onepiece node --transport verbs`` runs before it starts: open the configured device and
    self-test it. SelfTestFailed (its ``str()`` one line naming the check) when either fails."""
    try:
        ctx, name = _open()
    except NoRdmaDevice as exc:
        raise SelfTestFailed(CHECK_DEVICE, str(exc), envs.RDMA_DEVICE or None) from exc
    try:
        return self_test(ctx, name)
    finally:
        ctx.close()


def _checked_device() -> tuple[Any, SelfTestResult]:
    """The configured device's context, self-tested (the context is closed again when the test fails)."""
    ctx, name = _open()
    try:
        return ctx, self_test(ctx, name)
    except BaseException:
        ctx.close()
        raise


class _Endpoint:
    """One RC queue pair with its completion queue, brought to RTS with a peer's info."""

    def __init__(self, ctx: Any, pd: Any) -> None:
        e, _addr, cq, _device, _mr, _pd, qp, _wr = _pyverbs()
        import random

        self.ctx, self.pd = ctx, pd
        self.cq = cq.CQ(ctx, 64)
        cap = qp.QPCap(max_send_wr=64, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        self.qp = qp.QP(pd, qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))
        self.psn = random.getrandbits(24)
        port = envs.RDMA_PORT
        self.lid = ctx.query_port(port).lid
        self.gid = ctx.query_gid(port, envs.RDMA_GID_INDEX)

    def info(self) -> tuple[int, int, int, bytes]:
        return self.qp.qp_num, self.psn, self.lid, bytes.fromhex(self.gid.gid.replace(":", ""))

    def connect(self, qpn: int, psn: int, lid: int, gid: bytes) -> None:
        e, addr, _cq, _device, _mr, _pd, qp, _wr = _pyverbs()
        from pyverbs.addr import GID

        attr = qp.QPAttr(port_num=envs.RDMA_PORT)
        attr.dest_qp_num = qpn
        attr.rq_psn = psn
        attr.sq_psn = self.psn
        attr.path_mtu = e.IBV_MTU_1024
        attr.max_dest_rd_atomic = 1
        attr.max_rd_atomic = 1
        attr.min_rnr_timer = 12
        attr.timeout = 14
        attr.retry_cnt = 7
        attr.rnr_retry = 7
        attr.qp_access_flags = (
            e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_ATOMIC
        )
        dgid = GID()
        hexgid = gid.hex()
        dgid.gid = ":".join(hexgid[i : i + 4] for i in range(0, 32, 4))
        gr = addr.GlobalRoute(dgid=dgid, sgid_index=envs.RDMA_GID_INDEX)
        attr.ah_attr = addr.AHAttr(port_num=envs.RDMA_PORT, is_global=1, gr=gr, dlid=lid)
        self.qp.to_rts(attr)

    def fence(self) -> None:
        """Move the queue pair to the error state: nothing more from this peer lands."""
        e, *_rest, qp, _wr = _pyverbs()
        attr = qp.QPAttr()
        attr.qp_state = e.IBV_QPS_ERR
        self.qp.modify(attr, e.IBV_QP_STATE)

    def close(self) -> None:
        for obj in (self.qp, self.cq):
            try:
                obj.close()
            except Exception:
                pass


class _Loopback:
    """Two RC queue pairs on one device connected to each other: the device's own way to its memory,
    for the self-test and for an HCA-atomics owner's updates of its words."""

    def __init__(self, ctx: Any, pd: Any) -> None:
        e, _addr, _cq, _device, mr, *_ = _pyverbs()
        self._e = e
        self._parts: list[Any] = []
        try:
            self.staging = mr.MR(pd, 64, e.IBV_ACCESS_LOCAL_WRITE)
            self._parts.append(self.staging)
            self.a, self.b = _Endpoint(ctx, pd), _Endpoint(ctx, pd)
            self._parts += [self.a, self.b]
            self.a.connect(*self.b.info())
            self.b.connect(*self.a.info())
        except BaseException:
            self.close()
            raise

    def post(self, opcode: int, raddr: int, rkey: int, compare: int = 0, swap: int = 0,
             timeout: float | None = None) -> bytes:
        """One 8-byte operation on the word at ``raddr``; the 8 bytes it returned (atomics, READ)."""
        _post_wait(self.a, self._e, self.staging, opcode, raddr, rkey, 8, compare, swap, timeout)
        return bytes(self.staging.read(8, 0))

    def close(self) -> None:
        for obj in reversed(self._parts):
            try:
                obj.close()
            except Exception:
                pass
        self._parts = []


class _DeviceWord:
    """The self-test's word (verbs_selftest.ProbeWord): a registered 8 bytes reached by the CPU and, through
    a loopback queue pair, by the NIC. An operation that does not complete fails the 'completion' check."""

    def __init__(self, loop: _Loopback, target: Any, device: str) -> None:
        self.loop, self.target, self.device = loop, target, device

    def put(self, value: int) -> None:
        self.target.write(value.to_bytes(8, sys.byteorder), 8, 0)

    def get(self) -> int:
        return int.from_bytes(bytes(self.target.read(8, 0)), sys.byteorder)

    def _op(self, opcode: int, compare: int = 0, swap: int = 0) -> bytes:
        from pyverbs.pyverbs_error import PyverbsError

        try:
            return self.loop.post(opcode, self.target.buf, self.target.rkey, compare, swap, SELFTEST_OP_TIMEOUT_S)
        except (PeerUnavailable, TimeoutError, PyverbsError) as exc:
            raise SelfTestFailed(CHECK_COMPLETION, str(exc), self.device) from exc

    def fetch_add(self, delta: int) -> bytes:
        return self._op(self.loop._e.IBV_WR_ATOMIC_FETCH_AND_ADD, delta, 0)

    def cas(self, compare: int, swap: int) -> bytes:
        return self._op(self.loop._e.IBV_WR_ATOMIC_CMP_AND_SWP, compare, swap)

    def read(self) -> bytes:
        return self._op(self.loop._e.IBV_WR_RDMA_READ)


class VerbsServedRegion(TcpServedRegion):
    """A region owned by this process, registered for remote RDMA access, on a device whose atomics are
    atomic with the CPU's (``IBV_ATOMIC_GLOB``): the owner keeps its CPU atomics. Made by :func:`serve`."""

    # RDMA's invariant CRC (ICRC, 32-bit) covers every packet from the sending HCA to the receiving one
    payload_integrity = True

    def __init__(self, name: str, size: int | None, host: str, port: int, ctx: Any,
                 selftest: SelfTestResult) -> None:
        e, _addr, _cq, _device, mr, pd, *_ = _pyverbs()
        self._ctx, self.selftest = ctx, selftest
        self._pd = pd.PD(self._ctx)
        super().__init__(name, size, host, port)
        access = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
                  | e.IBV_ACCESS_REMOTE_ATOMIC)
        self._mr_addr = self.base  # the registered address peers target (``base`` may be withdrawn below)
        self._mr = mr.MR(self._pd, self.size, access, address=self._mr_addr)
        self.address = self.address.replace("tcp://", "verbs://", 1)
        self._peers: dict[int, _Endpoint] = {}
        self._peers_lock = threading.Lock()
        self._extra_ops[OP_VERBS_CONNECT] = self._connect_peer
        self._on_disconnect.append(self._fence_peer)

    def _connect_peer(self, cid: int, off: int, a: int, b: int, payload: bytes) -> tuple[int, bytes]:
        qpn, psn, lid, gid = PEER_INFO.unpack(payload)
        ep = _Endpoint(self._ctx, self._pd)
        ep.connect(qpn, psn, lid, gid)  # connected before the peer takes traffic
        with self._peers_lock:
            self._peers[cid] = ep
        my_qpn, my_psn, my_lid, my_gid = ep.info()
        return 0, OWNER_INFO.pack(my_qpn, my_psn, my_lid, my_gid, self._mr_addr, self._mr.rkey, self.size)

    def _fence_peer(self, cid: int) -> None:
        with self._peers_lock:
            ep = self._peers.pop(cid, None)
        if ep is not None:
            ep.fence()
            ep.close()

    def close(self) -> None:
        super().close()
        for cid in list(self._peers):
            self._fence_peer(cid)
        for obj in (self._mr, self._pd, self._ctx):
            try:
                obj.close()
            except Exception:
                pass


class NicAtomicsServedRegion(VerbsServedRegion):
    """A served region on a device with HCA-only atomics (``IBV_ATOMIC_HCA``): the NIC's atomics are atomic
    with each other, not with the CPU's. So the owner's own CAS, fetch-add and store go through the NIC
    too, by a loopback queue pair, and every update of a word is atomic with every other. Loads stay CPU
    loads (an aligned 8-byte load sees a NIC atomic's write whole). The region withdraws ``base``: the
    rings' native fast paths, which apply CPU atomics at ``base``, stay off it (they take the Python steps,
    which call these methods)."""

    def __init__(self, name: str, size: int | None, host: str, port: int, ctx: Any,
                 selftest: SelfTestResult) -> None:
        super().__init__(name, size, host, port, ctx, selftest)
        e = _pyverbs()[0]
        self._cas_op, self._faa_op = e.IBV_WR_ATOMIC_CMP_AND_SWP, e.IBV_WR_ATOMIC_FETCH_AND_ADD
        self._loop_lock = threading.Lock()
        self._loop: _Loopback | None = None
        try:
            self._loop = _Loopback(self._ctx, self._pd)
        except BaseException:
            self.close()
            raise
        del self.base

    def _word(self, offset: int) -> int:
        if offset & 7 or offset < 0 or offset + 8 > self.size:
            raise RegionError(f"region {self.name!r}: bad 64-bit word offset {offset}")
        return self._mr_addr + offset

    def _nic(self, opcode: int, offset: int, compare: int, swap: int) -> int:
        addr = self._word(offset)
        with self._loop_lock:
            if self._loop is None:
                raise RegionError(f"region {self.name!r} is closed")
            raw = self._loop.post(opcode, addr, self._mr.rkey, compare, swap)
        return int.from_bytes(raw, self.selftest.byte_order)

    def cas(self, offset: int, expected: int, desired: int) -> int:
        return self._nic(self._cas_op, offset, expected & MASK64, desired & MASK64)

    def fetch_add(self, offset: int, delta: int) -> int:
        return self._nic(self._faa_op, offset, delta & MASK64, 0)

    def load(self, offset: int) -> int:
        return _load64(self._word(offset))

    def store(self, offset: int, value: int) -> None:
        # a CAS loop through the NIC: a CPU store could land between a peer's atomic read and write
        value &= MASK64
        old = self.load(offset)
        while (prev := self.cas(offset, old, value)) != old:
            old = prev

    def close(self) -> None:
        with self._loop_lock:
            loop, self._loop = self._loop, None
        if loop is not None:
            loop.close()
        super().close()


def serve(name: str, size: int | None, host: str, port: int) -> VerbsServedRegion:
    """Own and serve a region on the configured device, once it passed its self-test: with CPU atomics
    (GLOB) or loopback NIC atomics (HCA), as the test decided. SelfTestFailed names a failed check."""
    ctx, result = _checked_device()
    cls = VerbsServedRegion if result.path == CPU else NicAtomicsServedRegion
    return cls(name, size, host, port, ctx, result)


class VerbsRegion(MemoryRegion):
    """A peer's view of a :class:`VerbsServedRegion`: data and atomics by RDMA, doorbells over TCP."""

    def __init__(self, host: str, port: int, name: str) -> None:
        e, _addr, _cq, _device, mr, pd, *_ = _pyverbs()
        self._e = e
        self._ctx, selftest = _checked_device()
        self._order = selftest.byte_order  # of the 8 bytes this device returns for an atomic
        self._pd = pd.PD(self._ctx)
        self._ctl = TcpRegion(host, port, name)
        self.name, self.size = name, self._ctl.size
        self._staging = mr.MR(self._pd, min(STAGING_BYTES, max(self.size, 4096)), e.IBV_ACCESS_LOCAL_WRITE)
        self._ep = _Endpoint(self._ctx, self._pd)
        _, reply = self._ctl._call(OP_VERBS_CONNECT, 0, 0, 0, PEER_INFO.size, PEER_INFO.pack(*self._ep.info()))
        qpn, psn, lid, gid, self._raddr, self._rkey, _ = OWNER_INFO.unpack(reply)
        self._ep.connect(qpn, psn, lid, gid)
        self._lock = threading.Lock()

    def identity(self) -> tuple[int, int]:
        return self._ctl.identity()

    def _post(self, opcode: int, remote: int, length: int, compare: int = 0, swap: int = 0) -> None:
        try:
            _post_wait(self._ep, self._e, self._staging, opcode, self._raddr + remote, self._rkey, length,
                       compare, swap)
        except PeerUnavailable as exc:
            raise PeerUnavailable(f"region {self.name!r}: {exc}") from exc

    def read_into(self, offset: int, out: memoryview) -> None:
        n = len(out)
        self._check(offset, n)
        with self._lock:
            for a in range(0, n, self._staging.length):
                k = min(self._staging.length, n - a)
                self._post(self._e.IBV_WR_RDMA_READ, offset + a, k)
                out[a : a + k] = self._staging.read(k, 0)

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        mv = memoryview(data).cast("B")
        self._check(offset, len(mv))
        with self._lock:
            for a in range(0, len(mv), self._staging.length):
                chunk = mv[a : a + self._staging.length]
                self._staging.write(bytes(chunk), len(chunk), 0)
                self._post(self._e.IBV_WR_RDMA_WRITE, offset + a, len(chunk))

    def _word_op(self, opcode: int, offset: int, compare: int, swap: int) -> int:
        if offset & 7:
            raise RegionError(f"region {self.name!r}: bad 64-bit word offset {offset}")
        self._check(offset, 8)
        with self._lock:
            self._post(opcode, offset, 8, compare, swap)
            return int.from_bytes(bytes(self._staging.read(8, 0)), self._order)

    def cas(self, offset: int, expected: int, desired: int) -> int:
        return self._word_op(self._e.IBV_WR_ATOMIC_CMP_AND_SWP, offset, expected, desired)

    def fetch_add(self, offset: int, delta: int) -> int:
        return self._word_op(self._e.IBV_WR_ATOMIC_FETCH_AND_ADD, offset, delta & (2**64 - 1), 0)

    def load(self, offset: int) -> int:
        # an aligned 8-byte RDMA READ is not torn on the NICs we target; a fetch-add of 0 would also do
        return self._word_op(self._e.IBV_WR_ATOMIC_FETCH_AND_ADD, offset, 0, 0)

    def store(self, offset: int, value: int) -> None:
        self._check(offset, 8)
        with self._lock:
            # the owner's CPU reads its words in host order (peers and owner share it: x86-64, aarch64 LE)
            self._staging.write((value & MASK64).to_bytes(8, sys.byteorder), 8, 0)
            self._post(self._e.IBV_WR_RDMA_WRITE, offset, 8)

    def notify(self, offset: int) -> None:
        self._ctl._call(OP_NOTIFY, offset, 0, 0, 0, None)

    def wait(self, offset: int, expected: int, timeout: float) -> bool:
        return bool(self._ctl._call(OP_WAIT, offset, expected, int(timeout * 1000), 0, None)[0])

    def close(self) -> None:
        self._ep.close()
        for obj in (self._staging, self._pd, self._ctx):
            try:
                obj.close()
            except Exception:
                pass
        self._ctl.close()


# reopen: a restarted owner re-registers the segment its predecessor left (new rkey; peers reconnect)
create, reopen, attach = served_backend(serve, VerbsRegion)
