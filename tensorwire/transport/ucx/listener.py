"""UcxListener: the handshake that makes a UCX connection, on both ends.

The data-plane address of a UCX listener is a plain TCP socket bound to the
node's address (UCX's own sockaddr listener binds every interface, and its
endpoints always have peer error handling). The dialler sends a hello (magic,
protocol version, its receiver id, the nonce learned over the control plane,
the proof of the link secret, the length of its UCX worker address), then the
address. The listener checks everything *before* creating anything, creates
its endpoint from the peer's worker address and answers OK plus its own
receiver id and worker address (or NO, then closes); the dialler creates its
endpoint from that. A connection that sends garbage, a wrong nonce or nothing
within ``HELLO_TIMEOUT`` is dropped; the listener keeps serving. The TCP
connection then stays open as the connection's liveness channel; no data goes
over it. Untrusted peers' worker addresses are unpacked in a sandbox process
first (:mod:`tensorwire.transport.ucx.addrcheck`).
"""

from __future__ import annotations

import functools
import logging
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

from tensorwire import lifecycle
from tensorwire.errors import (
    AuthError,
    ClosedError,
    ConfigError,
    ConnectTimeout,
    PeerLostError,
    ProtocolError,
    TransportError,
    VersionMismatchError,
)
from tensorwire.transport._socket import dial, tune_socket
from tensorwire.transport.base import NONCE_BYTES, Listener, link_proof, proof_matches
from tensorwire.transport.base import remaining as _remaining
from tensorwire.transport.ucx._ucxx import close_ep, ucx
from tensorwire.transport.ucx.connection import watch
from tensorwire.transport.ucx.endpoint import UcxTransport
from tensorwire.transport.ucx.engine import Engine, engine, error_handling
from tensorwire.transport.ucx.wire import (
    HELLO,
    HELLO_MAGIC,
    MAX_ADDRESS,
    PROTOCOL_VERSION,
    R_PEER_ERRORS,
    REPLY,
    REPLY_NO,
    REPLY_OK,
    RID_MASK,
)

__all__ = ["UcxListener"]

log = logging.getLogger(__name__)


def _listen(host: str, port: int) -> socket.socket:
    """The listener's TCP socket (handshake, then liveness), bound to ``host`` only."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise TransportError(f"cannot resolve {host!r} for the UCX data listener: {exc}") from exc
    info = next((i for i in infos if i[0] == socket.AF_INET), infos[0])
    sock = socket.socket(info[0], socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(128)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        raise TransportError(f"cannot listen for UCX data connections on {host!r} port {port}: {exc}") from exc
    return sock


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    """Blocking read of exactly ``n`` bytes before ``deadline`` (socket.timeout / ConnectionError otherwise)."""
    buf = bytearray()
    while len(buf) < n:
        rem = _remaining(deadline)
        if rem is not None and rem <= 0:
            raise socket.timeout("handshake timed out")
        sock.settimeout(10.0 if rem is None else max(0.01, rem))
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionResetError("connection closed during the handshake")
        buf += chunk
    return bytes(buf)


class _Pending:
    """A handshake in progress on the listener (non-blocking reads, driven by the engine)."""

    __slots__ = ("sock", "buf", "need", "deadline", "peer")

    def __init__(self, sock: socket.socket, deadline: float, peer: str) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.need = HELLO.size
        self.deadline = deadline
        self.peer = peer


class AddressCheck:
    """A sandbox process that unpacks untrusted UCX worker addresses (module :mod:`~tensorwire.transport.ucx.addrcheck`).

    :meth:`check` is True when the sandbox made an endpoint from the address;
    False when it refused it, died (UCX aborted on it) or did not answer in time.
    A dead sandbox is replaced at the next check. Thread-safe (one check at a time).
    The sandbox gets the transport list of ``eng``, the engine the checked peers will use.
    """

    def __init__(self, eng: Engine) -> None:
        self._eng = eng
        self._lock = threading.Lock()
        self._proc: Any = None
        self._answers = -1  # read end of the pipe the sandbox answers on
        self.started = 0  # sandboxes started (tests watch it)

    def _spawn(self) -> Any:
        tls = self._eng.ctx.config.get("TLS", "")
        r, w = os.pipe()
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tensorwire.transport.ucx.addrcheck", tls, str(w)],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                close_fds=True,
                pass_fds=(w,),
            )
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        self._answers = r
        self.started += 1
        return proc

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                proc.kill()
                proc.wait(5)
            except Exception:  # noqa: BLE001 - best effort
                pass
            try:
                proc.stdin.close()
            except Exception:  # noqa: BLE001
                pass
        if self._answers >= 0:
            os.close(self._answers)
            self._answers = -1

    def _read1(self, deadline: float) -> bytes:
        fd = self._answers
        rem = deadline - time.monotonic()
        if rem <= 0 or not select.select([fd], [], [], rem)[0]:
            return b""
        return os.read(fd, 1)

    def check(self, addr: bytes, *, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._lock:
            try:
                if self._proc is None or self._proc.poll() is not None:
                    self._kill()
                    self._proc = self._spawn()
                    # a fresh sandbox imports ucxx first (about a second): allow for it
                    if self._read1(deadline + 10.0) != b"R":
                        self._kill()
                        return False
                self._proc.stdin.write(struct.pack("<I", len(addr)) + addr)
                self._proc.stdin.flush()
                answer = self._read1(deadline)
            except (OSError, ValueError) as exc:
                log.debug("ucx address sandbox: %s", exc)
                answer = b""
            if answer != b"Y":
                if answer != b"N":
                    self._kill()  # died on it (or hung): the next check starts a fresh one
                return False
            return True

    def close(self) -> None:
        with self._lock:
            self._kill()


class UcxListener(Listener):
    """Accepts UCX data connections; routes each to the link whose nonce it presents.

    The listening socket is a plain TCP socket bound to ``host``: a connecting
    peer sends its hello (magic, version, receiver id, nonce, its UCX worker
    address) there; a good hello gets an answer with this side's receiver id
    and worker address, each side creates its UCX endpoint from the other's
    worker address, and the TCP connection stays open as the liveness channel.
    """

    kind = "ucx"
    HELLO_TIMEOUT = 5.0

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        port: int = 0,
        peer_timeout: float = 30.0,
        untrusted: bool = False,
        secret: bytes | None = None,
    ) -> None:
        """
        Args:
            untrusted: the peers are not trusted (serve clients): this process's UCX
                context gets no shared-memory / cma / cuda_ipc transport, every endpoint
                has peer error handling, and a peer's worker address is first unpacked by
                a sandbox process (:class:`AddressCheck`), since UCX aborts on a malformed one.
            secret: the link secret a dialler must prove it holds (``link_proof``), checked
                in constant time before anything else is done for it; None: none asked.

        Raises:
            TransportError: cannot listen.
        """
        self._eng = eng = engine(peer_timeout, untrusted=untrusted)
        self._untrusted = untrusted
        self._peer_errors = untrusted or error_handling()
        self._secret = bytes(secret) if secret else None
        self._check = AddressCheck(eng) if untrusted else None
        self._host = host
        self._peer_timeout = peer_timeout
        self._expected: set[bytes] = set()
        self._parked: dict[bytes, UcxTransport] = {}
        self._conns: dict[int, _Pending] = {}
        self._closed = False
        self._count = 0
        self._checking = 0  # worker addresses in the sandbox now
        self._checkers: set[threading.Thread] = set()  # their threads (joined by close)
        self.rejected = 0
        self._sock = _listen(host, port)
        self._port = self._sock.getsockname()[1]
        with eng.op():
            eng.watch_fd(self._sock.fileno(), self._on_accept)
            eng.adopt(self)

    @property
    def address(self) -> tuple[str, int]:
        return (self._host, self._port)

    def expect(self, nonce: bytes) -> None:
        with self._eng.op():
            self._expected.add(bytes(nonce))

    def forget(self, nonce: bytes) -> None:
        with self._eng.op():
            self._expected.discard(nonce)
            t = self._parked.pop(nonce, None)
        if t is not None:
            t.abort()

    def accept(self, nonce: bytes, *, timeout: float | None) -> UcxTransport:
        deadline = None if timeout is None else time.monotonic() + timeout
        nonce = bytes(nonce)
        got: list[UcxTransport] = []

        def ready() -> bool:
            t = self._parked.pop(nonce, None)
            if t is not None:
                self._expected.discard(nonce)
                got.append(t)
                return True
            if self._closed:
                raise ClosedError("listener closed")
            return False

        if not self._eng.wait(ready, deadline):
            raise ConnectTimeout(f"no UCX data connection arrived on port {self._port} within {timeout}s")
        return got[0]

    def close(self) -> None:
        eng = self._eng
        with eng.op():
            if self._closed:
                return
            self._closed = True
            eng.unwatch_fd(self._sock.fileno())
            self._sock.close()
            for fd, pend in list(self._conns.items()):
                eng.unwatch_fd(fd)
                pend.sock.close()
            self._conns.clear()
            parked = list(self._parked.values())
            self._parked.clear()
            eng.servicing.discard(self)
            eng.disown(self)
            eng.notify()
        for t in parked:
            t.abort()
        if self._check is not None:
            self._check.close()  # a check under way ends with the sandbox
        with eng.op():
            checkers = list(self._checkers)
        for th in checkers:
            lifecycle.join(th)

    # -- engine lock held ------------------------------------------------------------
    def _on_accept(self, events: int) -> None:
        """The listening socket is readable: take every waiting connection."""
        while True:
            try:
                sock, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.debug("ucx data listener: accept: %s", exc)
                return
            if self._closed:
                sock.close()
                continue
            self._count += 1
            sock.setblocking(False)
            fd = sock.fileno()
            self._conns[fd] = _Pending(
                sock, time.monotonic() + self.HELLO_TIMEOUT, f"ucx-client#{self._count}@{addr[0]}:{addr[1]}"
            )
            self._eng.watch_fd(fd, functools.partial(self._on_hello_event, fd))
            self._eng.servicing.add(self)

    def _service(self) -> None:
        """Drop connections whose hello did not arrive in time."""
        now = time.monotonic()
        for fd, pend in list(self._conns.items()):
            if now >= pend.deadline:
                self._drop(fd, f"no hello within {self.HELLO_TIMEOUT}s")
        if not self._conns:
            self._eng.servicing.discard(self)

    def _drop(self, fd: int, why: str, *, reply: bytes | None = None) -> None:
        pend = self._conns.pop(fd, None)
        if pend is None:
            return
        self._eng.unwatch_fd(fd)
        self._reject(pend, why, reply=reply)

    def _reject(self, pend: _Pending, why: str, *, reply: bytes | None = None) -> None:
        if reply is not None:
            try:
                pend.sock.send(reply)  # small: fits the socket buffer of a fresh connection
            except OSError:
                pass
        pend.sock.close()
        self.rejected += 1
        log.warning("ucx data listener: dropped connection %s: %s", pend.peer, why)

    def _on_hello_event(self, fd: int, events: int) -> None:
        self._on_hello(fd)

    def _on_hello(self, fd: int) -> None:
        pend = self._conns.get(fd)
        if pend is None:
            return
        try:
            data = pend.sock.recv(pend.need - len(pend.buf))
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(fd, f"hello failed: {exc}")
            return
        if not data:
            self._drop(fd, "closed before its hello")
            return
        pend.buf += data
        if len(pend.buf) < pend.need:
            return
        magic, version, client_rid, nonce, proof, alen = HELLO.unpack_from(pend.buf)
        if magic != HELLO_MAGIC:
            self._drop(fd, f"bad hello magic {bytes(magic)!r}")
            return
        no = REPLY.pack(REPLY_NO, PROTOCOL_VERSION, 0, 0, 0)
        if version != PROTOCOL_VERSION:
            self._drop(fd, f"peer speaks data protocol v{version}, this is v{PROTOCOL_VERSION}", reply=no)
            return
        if not client_rid or client_rid > RID_MASK or not 0 < alen <= MAX_ADDRESS:
            self._drop(fd, "bad hello fields")
            return
        if not proof_matches(self._secret, nonce, proof):
            self._drop(fd, "wrong or missing link secret", reply=no)
            return
        if nonce not in self._expected or nonce in self._parked or self._closed:
            self._drop(fd, "unknown data-plane credential", reply=no)
            return
        if pend.need == HELLO.size:
            pend.need += alen  # now read the worker address
            return
        addr = bytes(pend.buf[HELLO.size :])
        if self._check is None:
            self._complete(fd, pend, nonce, client_rid, addr)
            return
        # Untrusted: UCX aborts the process on a malformed worker address (an assertion in its
        # address unpacking), so a sandbox process unpacks it first, off the engine lock.
        del self._conns[fd]
        self._eng.unwatch_fd(fd)
        self._checking += 1
        check = self._check

        def run() -> None:
            ok = check.check(addr, timeout=self.HELLO_TIMEOUT)
            with self._eng.op():
                self._checkers.discard(threading.current_thread())
                self._checking -= 1
                if not ok:
                    self._reject(pend, "its UCX worker address does not unpack (refused)", reply=no)
                elif self._closed or nonce not in self._expected or nonce in self._parked:
                    self._reject(pend, "listener closed or credential used meanwhile", reply=no)
                else:
                    self._conns[fd] = pend
                    self._complete(fd, pend, nonce, client_rid, addr)

        th = threading.Thread(target=run, daemon=True, name="tensorwire-ucx-addrcheck")
        self._checkers.add(th)
        th.start()

    def _complete(self, fd: int, pend: _Pending, nonce: bytes, client_rid: int, addr: bytes) -> None:
        """Under the lock: make the endpoint to a checked hello's worker address, answer, park the transport."""
        eng = self._eng
        no = REPLY.pack(REPLY_NO, PROTOCOL_VERSION, 0, 0, 0)
        eh = self._peer_errors
        try:
            ep = ucx.UCXEndpoint.create_from_worker_address(eng.worker, ucx.UCXAddress.create_from_buffer(addr), eh)
        except Exception as exc:  # noqa: BLE001 - one bad peer must not stop the listener
            self._drop(fd, f"cannot create a UCX endpoint to its worker address: {exc}", reply=no)
            return
        self._conns.pop(fd, None)
        eng.unwatch_fd(fd)
        rid = eng.new_rid()
        mine = eng.address
        try:
            pend.sock.setblocking(True)
            pend.sock.settimeout(self.HELLO_TIMEOUT)
            flags = R_PEER_ERRORS if eh else 0
            pend.sock.sendall(REPLY.pack(REPLY_OK, PROTOCOL_VERSION, rid, flags, len(mine)) + mine)
        except OSError as exc:
            close_ep(ep)
            self._reject(pend, f"answering failed: {exc}")
            return
        t = UcxTransport(
            eng,
            ep,
            watch(ep),
            rid=rid,
            peer_rid=client_rid,
            peer=pend.peer,
            peer_timeout=self._peer_timeout,
            peer_errors=eh,
        )
        t._attach_liveness(pend.sock)
        self._parked[nonce] = t
        eng.notify()

    # -- dialling --------------------------------------------------------------------
    @classmethod
    def connect(
        cls,
        host: str,
        port: int,
        nonce: bytes,
        *,
        timeout: float | None,
        peer_timeout: float = 30.0,
        secret: bytes | None = None,
    ) -> UcxTransport:
        """Dial a UCX data listener and present ``nonce`` (and the proof of ``secret``, the link secret).

        The endpoint gets UCX peer error handling when the listener's answer says so.

        Raises:
            ConnectTimeout: no connection/answer within ``timeout``.
            AuthError: the listener refused the credential.
            VersionMismatchError: the listener speaks another protocol version.
            PeerLostError: the address cannot be resolved.
        """
        if len(nonce) != NONCE_BYTES:
            raise ConfigError(f"nonce must be {NONCE_BYTES} bytes")
        deadline = None if timeout is None else time.monotonic() + timeout
        eng = engine(peer_timeout)
        peer = f"{host}:{port}"
        # Any socket error is retried until the deadline (a listener not up yet, a reset, a slow SYN).
        sock = dial(host, port, deadline, retry=(OSError,), timeout_without_deadline=10.0, what="UCX data listener")
        try:
            tune_socket(sock, peer_timeout=peer_timeout)
            with eng.op():
                rid = eng.new_rid()
                mine = eng.address
            sock.sendall(
                HELLO.pack(
                    HELLO_MAGIC, PROTOCOL_VERSION, rid, bytes(nonce), link_proof(secret, bytes(nonce)), len(mine)
                )
                + mine
            )
            magic, version, server_rid, flags, alen = REPLY.unpack(_recv_exact(sock, REPLY.size, deadline))
            if magic == REPLY_NO:
                if version != PROTOCOL_VERSION:
                    raise VersionMismatchError(f"peer speaks data protocol v{version}, this is v{PROTOCOL_VERSION}")
                raise AuthError(f"UCX data listener {peer} refused the connection (bad credential)")
            if (
                magic != REPLY_OK
                or version != PROTOCOL_VERSION
                or not 0 < server_rid <= RID_MASK
                or not 0 < alen <= MAX_ADDRESS
            ):
                raise ProtocolError(f"unexpected hello reply from {peer}")
            addr = _recv_exact(sock, alen, deadline)
        except socket.timeout:
            sock.close()
            raise ConnectTimeout(f"UCX hello to {peer} not answered in time") from None
        except OSError as exc:
            sock.close()
            raise PeerLostError(f"UCX handshake with {peer} failed: {exc}") from exc
        except BaseException:
            sock.close()
            raise
        with eng.op():
            try:
                ep = ucx.UCXEndpoint.create_from_worker_address(
                    eng.worker, ucx.UCXAddress.create_from_buffer(addr), bool(flags & R_PEER_ERRORS)
                )
            except ucx.UCXError as exc:
                sock.close()
                raise TransportError(f"cannot create a UCX endpoint to {peer}: {exc}") from exc
            t = UcxTransport(
                eng,
                ep,
                watch(ep),
                rid=rid,
                peer_rid=server_rid,
                peer=peer,
                peer_timeout=peer_timeout,
                peer_errors=bool(flags & R_PEER_ERRORS),
            )
            t._attach_liveness(sock)
        return t
