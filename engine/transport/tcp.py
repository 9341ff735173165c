"""One-sided operations emulated over TCP, for hosts without RDMA NICs.

The owner serves its region from an agent: a listening thread plus one thread
per connection, each applying the peer's read / write / CAS / fetch-add /
load / store to local memory with the same native atomics the shm backend
uses, so local and remote parties stay atomic with respect to each other. The
agent also rings the owner's futex doorbells for remote producers.

Wire format (little endian): request ``op:u8 pad:3 n:u32 offset:u64 a:u64 b:u64``
followed by ``n`` payload bytes; reply ``status:u8 pad:3 n:u32 value:u64``
followed by ``n`` bytes. The agent trusts its network, like RDMA does: bind it
to the data-plane network only.
"""

from __future__ import annotations

import itertools
import socket
import struct
import threading
from collections.abc import Callable
from urllib.parse import ParseResult

from engine.transport.errors import OutOfBounds, PeerUnavailable, RegionError
from engine.transport.layout import REMOTE
from engine.transport.region import MemoryRegion
from engine.transport.shm import ShmRegion, open_segment

REQ = struct.Struct("<BxxxIQQQ")
REP = struct.Struct("<BxxxIQ")
OP_HELLO, OP_READ, OP_WRITE, OP_CAS, OP_FAA, OP_LOAD, OP_STORE, OP_NOTIFY, OP_WAIT = range(1, 10)
OK, ERR = 0, 1
MAX_IO = 1 << 30


def _recv_exact(sock: socket.socket, n: int, into: memoryview | None = None) -> memoryview:
    buf = into if into is not None else memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(buf[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return buf


class TcpServedRegion(ShmRegion):
    """A region owned by this process and served to remote peers over TCP.

    Its memory is a named shared-memory segment on the owner's host, not private
    memory, so it outlives a crashed owner: the restarted owner re-opens it
    (``size`` None) with everything committed in it, and serves it again from a
    new agent, ideally on the same port (the address stays valid for producers).
    """

    # TCP's 16-bit checksum misses some corruptions (and offloading NICs compute it after the fact)
    payload_integrity = False

    def __init__(self, name: str, size: int | None, host: str, port: int) -> None:
        fd, size, path = open_segment(name, size)
        super().__init__(name, fd, size, owner=True, path=path)
        try:
            self._start_agent(host, port)
        except OSError as exc:
            super().close()
            raise RegionError(f"cannot serve region {name!r} on {host}:{port}: {exc}") from exc

    def _start_agent(self, host: str, port: int) -> None:
        name = self.name
        # SO_REUSEADDR (create_server's default on POSIX): a restarted owner can take its port back at once
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.host, self.port = self._listener.getsockname()[:2]
        self.address = f"tcp://{self.host}:{self.port}/{name}"
        self._conns: dict[int, socket.socket] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._stopping = False
        self._threads: list[threading.Thread] = []
        # op code -> handler(conn id, offset, a, b, payload) -> (value, reply bytes); for subclasses
        self._extra_ops: dict[int, Callable[[int, int, int, int, bytes], tuple[int, bytes]]] = {}
        self._on_disconnect: list[Callable[[int], None]] = []
        t = threading.Thread(target=self._accept_loop, name=f"onepiece-tcp-agent-{name}", daemon=True)
        t.start()
        self._threads.append(t)

    def peer_alive(self, pid: int, start_time: int) -> bool:
        if pid & REMOTE:
            with self._lock:
                return (pid & ~REMOTE) in self._conns
        return super().peer_alive(pid, start_time)

    def _accept_loop(self) -> None:
        while not self._stopping:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            cid = next(self._ids)
            with self._lock:
                self._conns[cid] = conn
            t = threading.Thread(target=self._serve, args=(conn, cid), name=f"onepiece-tcp-conn-{cid}", daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, conn: socket.socket, cid: int) -> None:
        hdr = memoryview(bytearray(REQ.size))
        try:
            while True:
                _recv_exact(conn, REQ.size, hdr)
                op, n, off, a, b = REQ.unpack(hdr)
                status, value, out = OK, 0, b""
                try:
                    if op == OP_HELLO:
                        value, out = self.size, struct.pack("<Q", REMOTE | cid)
                    elif op == OP_READ:
                        self._check(off, n)
                        out = self._view[off : off + n]
                        n = 0
                    elif op == OP_WRITE:
                        self._check(off, n)
                        _recv_exact(conn, n, self._view[off : off + n])
                        n = 0
                    elif op == OP_CAS:
                        value = self.cas(off, a, b)
                    elif op == OP_FAA:
                        value = self.fetch_add(off, a)
                    elif op == OP_LOAD:
                        value = self.load(off)
                    elif op == OP_STORE:
                        self.store(off, a)
                    elif op == OP_NOTIFY:
                        super().notify(off)
                    elif op == OP_WAIT:
                        value = int(super().wait(off, a, min(b, 1000) / 1000))
                    elif op in self._extra_ops:
                        payload = bytes(_recv_exact(conn, n)) if n else b""
                        n = 0
                        value, out = self._extra_ops[op](cid, off, a, b, payload)
                    else:
                        raise RegionError(f"unknown op {op}")
                except (RegionError, OutOfBounds) as exc:
                    if op == OP_WRITE and n:
                        _recv_exact(conn, n)  # drain the payload to stay in frame
                    status, out = ERR, str(exc).encode()
                conn.sendall(REP.pack(status, len(out), value))
                if out:
                    conn.sendall(out)
        except (ConnectionError, OSError):
            pass
        finally:
            with self._lock:
                self._conns.pop(cid, None)
            for hook in self._on_disconnect:
                hook(cid)
            conn.close()

    def close(self) -> None:
        if self._stopping:
            return
        self._stopping = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            conns = list(self._conns.values())
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(2)
        super().close()


class TcpRegion(MemoryRegion):
    """A peer's view of a region served by a :class:`TcpServedRegion`."""

    def __init__(self, host: str, port: int, name: str, timeout: float = 10.0) -> None:
        self.name = name
        self._peer = f"{host}:{port}"
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise PeerUnavailable(f"cannot reach region {name!r} at {self._peer}: {exc}") from exc
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.settimeout(None)
        self._lock = threading.Lock()
        self.size, ident = self._call(OP_HELLO, 0, 0, 0, 0, None, 8)
        (self._identity,) = struct.unpack("<Q", ident)

    def _call(self, op: int, off: int, a: int, b: int, n: int, payload, want: int = 0) -> tuple[int, bytes]:
        with self._lock:
            try:
                self._sock.sendall(REQ.pack(op, n, off, a, b))
                if payload is not None:
                    self._sock.sendall(payload)
                status, rn, value = REP.unpack(_recv_exact(self._sock, REP.size))
                out = bytes(_recv_exact(self._sock, rn)) if rn else b""
            except (ConnectionError, OSError) as exc:
                raise PeerUnavailable(f"region {self.name!r} at {self._peer}: {exc}") from exc
        if status != OK:
            raise RegionError(f"region {self.name!r} at {self._peer}: {out.decode(errors='replace')}")
        return value, out

    def identity(self) -> tuple[int, int]:
        return self._identity, 0

    def read_into(self, offset: int, out: memoryview) -> None:
        n = len(out)
        self._check(offset, n)
        with self._lock:
            try:
                self._sock.sendall(REQ.pack(OP_READ, n, offset, 0, 0))
                status, rn, _ = REP.unpack(_recv_exact(self._sock, REP.size))
                if status != OK:
                    raise RegionError(bytes(_recv_exact(self._sock, rn)).decode(errors="replace"))
                _recv_exact(self._sock, n, out.cast("B") if out.format != "B" else out)
            except (ConnectionError, OSError) as exc:
                raise PeerUnavailable(f"region {self.name!r} at {self._peer}: {exc}") from exc

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        n = data.nbytes if isinstance(data, memoryview) else len(data)
        self._check(offset, n)
        if n > MAX_IO:
            raise OutOfBounds(f"write of {n} bytes exceeds the TCP agent's limit of {MAX_IO}")
        self._call(OP_WRITE, offset, 0, 0, n, data)

    def cas(self, offset: int, expected: int, desired: int) -> int:
        return self._call(OP_CAS, offset, expected, desired, 0, None)[0]

    def fetch_add(self, offset: int, delta: int) -> int:
        return self._call(OP_FAA, offset, delta & (2**64 - 1), 0, 0, None)[0]

    def load(self, offset: int) -> int:
        return self._call(OP_LOAD, offset, 0, 0, 0, None)[0]

    def store(self, offset: int, value: int) -> None:
        self._call(OP_STORE, offset, value, 0, 0, None)

    def notify(self, offset: int) -> None:
        self._call(OP_NOTIFY, offset, 0, 0, 0, None)

    def wait(self, offset: int, expected: int, timeout: float) -> bool:
        return bool(self._call(OP_WAIT, offset, expected, int(timeout * 1000), 0, None)[0])

    def close(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass


def host_port_name(u: ParseResult, need_port: bool) -> tuple[str, int, str]:
    """(host, port, region name) of ``scheme://HOST:PORT/NAME`` (tcp and verbs addresses)."""
    name = u.path.lstrip("/")
    if not name:
        raise RegionError(f"{u.scheme} address {u.geturl()!r} needs a region name: {u.scheme}://HOST:PORT/NAME")
    if need_port and not u.port:
        raise RegionError(f"{u.scheme} address {u.geturl()!r} needs a port")
    return u.hostname or "127.0.0.1", u.port or 0, name


def served_backend(served: Callable[[str, int | None, str, int], MemoryRegion],
                   peer: Callable[[str, int, str], MemoryRegion]) -> tuple[Callable[..., MemoryRegion], ...]:
    """``create``, ``reopen`` and ``attach`` (engine.transport.region's backend functions) of a transport
    whose owner serves its region at ``scheme://HOST:PORT/NAME``: ``served(name, size, host, port)`` owns
    it (``size`` None: take over the segment a dead predecessor left), ``peer(host, port, name)`` reaches it."""

    def create(u: ParseResult, size: int) -> MemoryRegion:
        host, port, name = host_port_name(u, need_port=False)
        return served(name, size, host, port)

    def reopen(u: ParseResult) -> MemoryRegion:
        host, port, name = host_port_name(u, need_port=False)
        return served(name, None, host, port)

    def attach(u: ParseResult) -> MemoryRegion:
        host, port, name = host_port_name(u, need_port=True)
        return peer(host, port, name)

    return create, reopen, attach


# reopen: a restarted owner takes over the segment its predecessor left and serves it at the same address
create, reopen, attach = served_backend(TcpServedRegion, TcpRegion)

