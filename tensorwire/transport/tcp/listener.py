"""Connection set-up of the TCP data plane: :class:`TcpListener` (admission, handshake) and the dialler.

The connecting side sends a hello (magic, protocol version, 16-byte nonce
learned over the control plane, then a 16-byte proof that it holds the link
secret: :func:`~tensorwire.transport.base.link_proof`, zeros without one); the
listener answers OK, NO (wrong proof, unknown credential or version) or BUSY
(evicted to make room under a flood of connections that send no hello: the
client dials again with backoff), each 8 bytes. A listener made with
``secret=`` (links) checks the proof in constant time *before* it looks at the
nonce, so a stranger holding a leaked nonce neither gets in nor uses the nonce
up; one without (the serve daemon, whose nonces are per-session credentials
handed out over its authenticated control plane) ignores it. The version comes
before the proof: a peer of another version is told so after the first 28
bytes. Garbage, truncated or slow hellos are dropped without disturbing other
connections; see :mod:`tensorwire.transport.admission` for the bounds.
"""

from __future__ import annotations

import errno
import logging
import selectors
import socket
import struct
import threading
import time
from typing import Any

from tensorwire.errors import (
    AuthError,
    ClosedError,
    ConnectTimeout,
    PeerLostError,
    ProtocolError,
    ResourceExhaustedError,
    VersionMismatchError,
)
from tensorwire.transport._socket import dial, tune_socket
from tensorwire.transport.admission import AdmissionLimits, PendingTable
from tensorwire.settings import setting
from tensorwire.transport.base import Listener, link_proof, proof_matches, remaining
from tensorwire.transport.cma import new_cma_peer
from tensorwire.transport.tcp.transport import TcpTransport
from tensorwire.transport.tcp.wire import HELLO, HELLO_HEAD, HELLO_MAGIC, HELLO_OK, PROTOCOL_VERSION

__all__ = ["TcpListener"]

log = logging.getLogger(__name__)


class _Hello:
    """A connection whose hello has not arrived yet (the accept thread's only)."""

    __slots__ = ("conn", "addr", "buf", "got", "need")

    def __init__(self, conn: socket.socket, addr: Any) -> None:
        self.conn = conn
        self.addr = addr
        self.buf = bytearray(HELLO.size)
        self.got = 0
        self.need = HELLO_HEAD.size  # the whole HELLO once the head says this version


class TcpListener(Listener):
    """Accepts framed TCP data connections; routes each to the link whose nonce it presents.

    One thread accepts connections and reads their hellos (non-blocking, one
    selector): a connection costs no thread before it is authenticated, and
    the check of a nonce and the parking of its connection happen in that one
    thread, so one nonce is never accepted twice. Connections that have not
    sent their hello yet are bounded by :class:`~tensorwire.transport.admission.AdmissionLimits`
    (a deadline each, caps per peer address and in total, the oldest of the
    heaviest address evicted with a BUSY answer); see that module for why this
    never starves real clients.
    """

    kind = "tcp"
    #: Seconds a connection may take to send its hello (an instance may change it before connections arrive).
    HELLO_TIMEOUT = AdmissionLimits.hello_timeout
    #: Connections accepted per wake-up before pending hellos are read again.
    ACCEPT_BATCH = 256
    #: Seconds between two WARNINGs about dropped connections (the others are counted and summed up).
    LOG_EVERY = 10.0

    def __init__(
        self,
        host: str = "127.0.0.1",
        *,
        port: int = 0,
        peer_timeout: float = 30.0,
        backlog: int = 1024,
        limits: AdmissionLimits | None = None,
        secret: bytes | None = None,
    ) -> None:
        """``secret``: the link secret a dialler must prove it holds (checked before its nonce);
        ``None`` (the serve daemon): the nonce alone admits. See :mod:`.listener`."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(backlog)
        self._sock.setblocking(False)
        self._host = host
        self._port = self._sock.getsockname()[1]
        self._peer_timeout = peer_timeout
        self._secret = bytes(secret) if secret else None
        self.limits = limits or AdmissionLimits()
        self.HELLO_TIMEOUT = self.limits.hello_timeout
        self._cond = threading.Condition()
        self._expected: set[bytes] = set()
        #: Nonces a connection has presented and is being answered for: taken out of ``_expected`` in the
        #: same breath as they were checked, so one nonce admits one connection, however many race for it.
        self._claimed: set[bytes] = set()
        self._parked: dict[bytes, TcpTransport] = {}
        self._closed = False
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, None)
        self._hellos: dict[int, _Hello] = {}
        self._pending: PendingTable[int] = PendingTable(self.limits)
        #: Connections dropped (bad or no hello, evicted for load), since creation.
        self.rejected = 0
        self._quiet = 0  # drops not logged since the last WARNING
        self._logged_at = -1e9
        self._thread = threading.Thread(
            target=self._accept_loop, name=f"tensorwire-tcp-accept:{self._port}", daemon=True
        )
        self._thread.start()

    @property
    def address(self) -> tuple[str, int]:
        return (self._host, self._port)

    @property
    def pending(self) -> int:
        """Connections accepted whose hello has not arrived yet."""
        return len(self._pending)

    @property
    def evicted(self) -> int:
        """Pending connections evicted (answered BUSY) to make room for newer ones."""
        return self._pending.evicted

    def expect(self, nonce: bytes) -> None:
        with self._cond:
            self._expected.add(bytes(nonce))

    def forget(self, nonce: bytes) -> None:
        with self._cond:
            self._expected.discard(nonce)
            self._claimed.discard(nonce)
            t = self._parked.pop(nonce, None)
        if t is not None:
            t.abort()

    def accept(self, nonce: bytes, *, timeout: float | None) -> TcpTransport:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while nonce not in self._parked:
                if self._closed:
                    raise ClosedError("listener closed")
                rem = remaining(deadline)
                if rem is not None and rem <= 0:
                    raise ConnectTimeout(f"no data connection arrived on {self._host}:{self._port} within {timeout}s")
                self._cond.wait(0.5 if rem is None else min(rem, 0.5))
            self._expected.discard(nonce)
            self._claimed.discard(nonce)
            return self._parked.pop(nonce)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            parked = list(self._parked.values())
            self._parked.clear()
            self._cond.notify_all()
        for t in parked:
            t.abort()
        self._thread.join(timeout=2)
        for h in list(self._hellos.values()):
            h.conn.close()
        self._hellos.clear()
        self._sel.close()
        self._sock.close()

    # -- the accept thread ----------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed:
            nxt = self._pending.next_deadline()
            wait = 0.2 if nxt is None else max(0.0, min(0.2, nxt - time.monotonic()))
            try:
                events = self._sel.select(wait)
            except OSError:  # pragma: no cover - closed under us
                if self._closed:
                    return
                time.sleep(0.05)
                continue
            for key, _ in events:
                if key.fileobj is self._sock:
                    self._accept_some()
                else:
                    self._read_hello(key.fd)
            for fd in self._pending.expired_keys(time.monotonic()):
                self._drop(fd, f"no hello within {self.HELLO_TIMEOUT:g}s", pending=False)

    def _accept_some(self) -> None:
        for _ in range(self.ACCEPT_BATCH):
            try:
                conn, addr = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if self._closed:
                    return
                if exc.errno in (errno.EMFILE, errno.ENFILE) and len(self._pending):
                    # Out of descriptors: the oldest idle hello gives its up (a real client retries on BUSY).
                    oldest = next(self._pending.keys())
                    self._pending.remove(oldest)
                    self._pending.evicted += 1
                    self._drop(oldest, f"out of file descriptors ({exc})", reply=_BUSY, pending=False)
                    continue
                self._log_drop(None, f"accept failed: {exc}")
                time.sleep(0.05)
                return
            if self._closed:
                conn.close()
                return
            conn.setblocking(False)
            fd = conn.fileno()
            for old in self._pending.add(fd, str(addr[0]), time.monotonic(), timeout=self.HELLO_TIMEOUT):
                if self._read_hello(old, pending=False):
                    self._pending.evicted -= 1  # its hello was there already: admitted, not evicted
                    continue
                self._drop(old, "evicted for load: too many connections without a hello", reply=_BUSY, pending=False)
            self._hellos[fd] = _Hello(conn, addr)
            self._sel.register(conn, selectors.EVENT_READ, None)

    def _read_hello(self, fd: int, *, pending: bool = True) -> bool:
        """Read what arrived of ``fd``'s hello; True once it is whole (then it is admitted or refused).
        ``pending``: ``fd`` is still in the table (False: about to be evicted; an incomplete one stays)."""
        h = self._hellos.get(fd)
        if h is None:
            return False
        try:
            n = h.conn.recv_into(memoryview(h.buf)[h.got :], h.need - h.got)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:
            if pending:
                self._drop(fd, f"hello failed: {exc}")
            return False
        if n == 0:
            if pending:
                self._drop(fd, "closed during hello")
            return False
        h.got += n
        if h.got == HELLO_HEAD.size and h.need == HELLO_HEAD.size:
            magic, version, _ = HELLO_HEAD.unpack_from(h.buf)
            if magic == HELLO_MAGIC and version == PROTOCOL_VERSION:
                h.need = HELLO.size  # the proof follows; another version is answered now
                return self._read_hello(fd, pending=pending)
        if h.got < h.need:
            return False
        if pending:
            self._pending.remove(fd)
        self._sel.unregister(h.conn)
        del self._hellos[fd]
        self._admit(h.conn, h.addr, h.buf, h.got)
        return True

    def _admit(self, conn: socket.socket, addr: Any, buf: bytearray, got: int) -> None:
        """A whole hello arrived (``got`` bytes of ``buf``): check it, answer, park the connection for its nonce."""
        try:
            magic, version, nonce = HELLO_HEAD.unpack_from(buf)
            if magic != HELLO_MAGIC:
                raise ProtocolError(f"bad hello magic {bytes(magic)[:8]!r}")
            if version != PROTOCOL_VERSION or got != HELLO.size:
                conn.send(_NO)
                raise VersionMismatchError(f"peer speaks data protocol v{version}, this is v{PROTOCOL_VERSION}")
            proof = HELLO.unpack_from(buf)[3]
            # The proof first, in constant time: without the secret, a (leaked) nonce is neither
            # admitted nor claimed, so the real peer presenting it later still gets in.
            if not proof_matches(self._secret, nonce, proof):
                conn.send(_NO)
                raise AuthError("wrong or missing link secret")
            with self._cond:
                # check and claim in one step: a nonce is single-use (a second connection presenting it,
                # even at the same instant, is refused before it is answered)
                ok = nonce in self._expected and not self._closed
                if ok:
                    self._expected.discard(nonce)
                    self._claimed.add(nonce)
            if not ok:
                conn.send(_NO)
                raise AuthError("unknown data-plane credential")
            try:
                conn.setblocking(True)
                conn.settimeout(self.HELLO_TIMEOUT)
                conn.sendall(HELLO_OK + struct.pack("<I", PROTOCOL_VERSION))
                tune_socket(conn, peer_timeout=self._peer_timeout)
                peer = f"{addr[0]}:{addr[1]}"
                transport = TcpTransport(
                    conn,
                    peer=peer,
                    peer_timeout=self._peer_timeout,
                    cma=new_cma_peer(authenticated=self._secret is not None, peer=peer),
                    spin_us=setting("tcp_spin_us") if self._secret is not None else 0.0,
                )
            except BaseException:
                with self._cond:  # answering failed: nobody got in; the nonce may be presented again
                    if nonce in self._claimed:
                        self._claimed.discard(nonce)
                        self._expected.add(nonce)
                raise
            with self._cond:
                if self._closed or nonce not in self._claimed:  # forgotten meanwhile
                    transport.abort()
                    return
                self._claimed.discard(nonce)
                self._parked[nonce] = transport
                self._cond.notify_all()
        except (OSError, ProtocolError, AuthError) as exc:
            self.rejected += 1
            self._log_drop(addr, str(exc))
            try:
                conn.close()
            except OSError:
                pass

    def _drop(self, fd: int, why: str, *, reply: bytes | None = None, pending: bool = True) -> None:
        """Close a connection whose hello has not arrived (``pending``: it is still in the table)."""
        if pending:
            self._pending.remove(fd)
        h = self._hellos.pop(fd, None)
        if h is None:
            return
        try:
            self._sel.unregister(h.conn)
        except (KeyError, ValueError):
            pass
        if reply is not None:
            try:
                h.conn.send(reply, socket.MSG_DONTWAIT)  # 8 bytes into a fresh connection's buffer
            except OSError:
                pass
        h.conn.close()
        self.rejected += 1
        self._log_drop(h.addr, why)

    def _log_drop(self, addr: Any, why: str) -> None:
        """A WARNING per dropped connection, at most one per LOG_EVERY seconds (a flood must not flood the log)."""
        now = time.monotonic()
        if now - self._logged_at < self.LOG_EVERY:
            self._quiet += 1
            return
        more = f" (and {self._quiet} more since the last report)" if self._quiet else ""
        self._quiet = 0
        self._logged_at = now
        log.warning("tcp data listener: dropped connection from %s: %s%s", addr, why, more)

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
    ) -> TcpTransport:
        """Dial a listener and present ``nonce`` (and the proof of ``secret``, the link secret).

        A listener that answers BUSY (it evicted this connection to make room
        under a flood of connections), or that drops the connection without an
        answer, is dialled again with backoff until ``timeout``.

        Raises:
            ConnectTimeout: no connection/answer within ``timeout``.
            ResourceExhaustedError: the listener was too busy for the whole ``timeout``.
            AuthError: the listener refused the credential (an unknown nonce, or a wrong or missing secret).
            VersionMismatchError: the listener speaks another data protocol version.
            PeerLostError: the connection was refused or reset until the timeout.
        """
        proof = link_proof(secret, bytes(nonce))
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.02
        while True:
            try:
                return cls._connect_once(host, port, nonce, proof, deadline, peer_timeout, linked=secret is not None)
            except (_Busy, _NoAnswer) as exc:
                rem = remaining(deadline)
                if rem is not None and rem <= delay:
                    if isinstance(exc, _Busy):
                        raise ResourceExhaustedError(
                            f"data listener {host}:{port} was too busy to take the connection within {timeout}s "
                            f"(too many connections without a hello; retry later): {exc}"
                        ) from None
                    raise PeerLostError(f"data listener {host}:{port}: {exc}") from None
                wait = max(delay, getattr(exc, "retry_after", 0.0))
                time.sleep(wait if rem is None else max(0.0, min(wait, rem - 0.01)))
                delay = min(delay * 2, 0.5)

    @staticmethod
    def _connect_once(
        host: str, port: int, nonce: bytes, proof: bytes, deadline: float | None, peer_timeout: float, *, linked: bool
    ) -> TcpTransport:
        sock = dial(host, port, deadline)
        try:
            sock.settimeout(remaining(deadline))
            sock.sendall(HELLO.pack(HELLO_MAGIC, PROTOCOL_VERSION, nonce, proof))
            reply = b""
            while len(reply) < 8:
                chunk = sock.recv(8 - len(reply))
                if not chunk:
                    raise _NoAnswer("closed the connection during the handshake without an answer")
                reply += chunk
            word, value = reply[:4], struct.unpack("<I", reply[4:8])[0]
            if word == _BUSY[:4]:
                raise _Busy("BUSY", retry_after=min(value, 5000) / 1000.0)
            if word == _NO[:4]:
                if value != PROTOCOL_VERSION:
                    raise VersionMismatchError(
                        f"data listener {host}:{port} speaks data protocol v{value}, this is v{PROTOCOL_VERSION}"
                    )
                raise AuthError(
                    f"data listener {host}:{port} refused the credential (unknown nonce, or a wrong or "
                    "missing link secret)"
                )
            if word != HELLO_OK:
                raise ProtocolError(f"unexpected hello reply {reply!r} from {host}:{port}")
            tune_socket(sock, peer_timeout=peer_timeout)
        except (socket.timeout, TimeoutError) as exc:
            sock.close()
            raise ConnectTimeout(f"hello to {host}:{port} timed out") from exc
        except ConnectionError as exc:
            sock.close()
            raise _NoAnswer(f"reset the connection during the handshake: {exc}") from exc
        except BaseException:
            sock.close()
            raise
        peer = f"{host}:{port}"
        return TcpTransport(
            sock,
            peer=peer,
            peer_timeout=peer_timeout,
            cma=new_cma_peer(authenticated=linked, peer=peer),
            spin_us=setting("tcp_spin_us") if linked else 0.0,
        )


class _Busy(Exception):
    def __init__(self, msg: str, *, retry_after: float) -> None:
        super().__init__(msg)
        self.retry_after = retry_after


class _NoAnswer(Exception):
    pass


#: Answers to a hello besides HELLO_OK (4 bytes + a little-endian u32): refused (u32: the listener's version),
#: and BUSY (u32: milliseconds to wait before dialling again).
_NO = b"TWNO" + struct.pack("<I", PROTOCOL_VERSION)
_BUSY = b"TWBZ" + struct.pack("<I", 50)
