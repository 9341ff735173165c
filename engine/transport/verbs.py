"""RDMA verbs regions through pyverbs: RC queue pairs, RDMA WRITE/READ, ATOMIC CMP_AND_SWP / FETCH_AND_ADD.

The owner registers its memory once and keeps a TCP control agent (the same
agent as the ``tcp`` backend) through which each peer exchanges queue-pair
information before taking traffic; doorbells also travel over it. Each peer
gets its own RC queue pair; when its control connection drops, the owner moves
that queue pair to the error state, so a fenced or dead peer can write nothing
more (the hardware's version of the ring's quarantine rule).

Requirements: the distribution's pyverbs matching its rdma-core (docs/operations.md, "RDMA
hosts"), and a device whose atomics are coherent with the CPU's
(``IBV_ATOMIC_GLOB``), because the consumer CASes the same words locally.
Written after rdma-core's pyverbs examples; no machine in CI has an RDMA
device, so its tests stop at "no RDMA device".
"""

from __future__ import annotations

import struct
import threading
from typing import Any

from engine import envs
from engine.transport.errors import NoRdmaDevice, PeerUnavailable, RegionError
from engine.transport.region import MemoryRegion
from engine.transport.tcp import (
    OP_NOTIFY,
    OP_WAIT,
    TcpRegion,
    TcpServedRegion,
    served_backend,
)

OP_VERBS_CONNECT = 32
# qp_num, psn, lid, gid (16 bytes), [owner: addr, rkey, size]
PEER_INFO = struct.Struct("<IIH16s")
OWNER_INFO = struct.Struct("<IIH16sQIQ")
STAGING_BYTES = 16 << 20


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


def open_device() -> Any:
    """Open the configured (or first) RDMA device; NoRdmaDevice when there is none."""
    e, _addr, _cq, device, *_ = _pyverbs()
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
    ctx = device.Context(name=name)
    if ctx.query_device().atomic_caps != e.IBV_ATOMIC_GLOB:
        raise NoRdmaDevice(
            f"RDMA device {name!r} has HCA-only atomics: remote CAS would not be atomic with the owner's local CAS"
        )
    return ctx


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


class VerbsServedRegion(TcpServedRegion):
    """A region owned by this process, registered for remote RDMA access."""

    # RDMA's invariant CRC (ICRC, 32-bit) covers every packet from the sending HCA to the receiving one
    payload_integrity = True

    def __init__(self, name: str, size: int | None, host: str, port: int) -> None:
        e, _addr, _cq, _device, mr, pd, *_ = _pyverbs()
        self._ctx = open_device()
        self._pd = pd.PD(self._ctx)
        super().__init__(name, size, host, port)
        access = (e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE | e.IBV_ACCESS_REMOTE_READ
                  | e.IBV_ACCESS_REMOTE_ATOMIC)
        self._mr = mr.MR(self._pd, self.size, access, address=self.base)
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
        return 0, OWNER_INFO.pack(my_qpn, my_psn, my_lid, my_gid, self.base, self._mr.rkey, self.size)

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


class VerbsRegion(MemoryRegion):
    """A peer's view of a :class:`VerbsServedRegion`: data and atomics by RDMA, doorbells over TCP."""

    def __init__(self, host: str, port: int, name: str) -> None:
        e, _addr, _cq, _device, mr, pd, *_ = _pyverbs()
        self._e = e
        self._ctx = open_device()
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
        from pyverbs.wr import SGE, SendWR

        e = self._e
        sge = SGE(self._staging.buf, length, self._staging.lkey)
        wr = SendWR(opcode=opcode, num_sge=1, sg=[sge], send_flags=e.IBV_SEND_SIGNALED)
        if opcode in (e.IBV_WR_ATOMIC_CMP_AND_SWP, e.IBV_WR_ATOMIC_FETCH_AND_ADD):
            wr.set_wr_atomic(self._rkey, self._raddr + remote, compare, swap)
        else:
            wr.set_wr_rdma(self._rkey, self._raddr + remote)
        self._ep.qp.post_send(wr)
        while True:
            n, wcs = self._ep.cq.poll()
            if n:
                if wcs[0].status != e.IBV_WC_SUCCESS:
                    raise PeerUnavailable(f"region {self.name!r}: RDMA work completion status {wcs[0].status}")
                return

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
            return struct.unpack("<Q", self._staging.read(8, 0))[0]

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
            self._staging.write(struct.pack("<Q", value), 8, 0)
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
create, reopen, attach = served_backend(VerbsServedRegion, VerbsRegion)
