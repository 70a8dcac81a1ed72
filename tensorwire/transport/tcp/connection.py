"""The state of one TCP data connection, shared by its roles (credits, reader, sender).

:class:`Connection` makes the socket's settings and every field the roles of a
connection touch; :mod:`.credits`, :mod:`.reader` and :mod:`.transport` add the
credit bookkeeping, the reader role and the send side on top of it, one class
each, and :class:`~tensorwire.transport.tcp.TcpTransport` is the last of them.
"""

from __future__ import annotations

import collections
import select
import socket
import struct
import threading
from typing import Any, ClassVar, Deque

from tensorwire.errors import AuthError, ClosedError, PeerLostError, ProtocolError, TransportError
from tensorwire.transport.base import Received, Transport
from tensorwire.transport.cma import CmaPeer
from tensorwire.transport.tcp.wire import PEER_GONE, READ_AHEAD, Posted

__all__ = ["Connection"]


class Connection(Transport):
    """The fields of a framed, credit-flow-controlled TCP connection to one peer, and its error state."""

    #: How long one blocking read waits before re-checking deadlines and state.
    READ_SLICE: ClassVar[float] = 0.2
    #: How long one blocking write waits before reading what the peer sent meanwhile.
    SEND_SLICE: ClassVar[float] = 0.02
    #: Posted-buffer views kept for reuse (a Link re-posts the same slots every step).
    VIEW_CACHE: ClassVar[int] = 256

    def __init__(
        self,
        sock: socket.socket,
        *,
        peer: str = "",
        peer_timeout: float = 30.0,
        cma: CmaPeer | None = None,
        spin_us: float = 0.0,
    ) -> None:
        """``cma``: cross-memory attach with the peer (links that proved the link secret); None: never.
        ``spin_us``: how long a blocking read first polls the socket without sleeping."""
        self._spin = spin_us * 1e-6
        self._rspin = self._spin  # the reader's poll budget for its current wait (see FrameReader._pump)
        sock.setblocking(True)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, int(self.READ_SLICE * 1e6)))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 0, int(self.SEND_SLICE * 1e6)))
        self._sock = sock
        self._fd = sock.fileno()
        self._peer = peer
        self._peer_timeout = peer_timeout
        self._lock = threading.Lock()  # guards the state below; plain lock for short updates
        self._cond = threading.Condition(self._lock)  # same lock, for waiting
        self._views: dict[int, tuple[Any, memoryview]] = {}
        self._posted: dict[int, Deque[Posted]] = collections.defaultdict(collections.deque)
        self._credits: dict[int, int] = collections.defaultdict(int)
        self._recv_steps: dict[int, int] = collections.defaultdict(int)
        self._send_steps: dict[int, int] = collections.defaultdict(int)
        # credits granted but not sent yet, by tag (a defaultdict: a missing key costs no Python call, unlike a Counter)
        self._pending_credits: dict[int, int] = collections.defaultdict(int)
        self._reader_busy = False
        self._waiters = 0  # threads in cond.wait: notify only when someone listens
        self._send_lock = threading.Lock()
        self._error: BaseException | None = None
        self._closed = False
        # eager messages (offer_eager): buffers of ours free for the peer, their size (0: none offered), what
        # arrived in them per tag before its buffer was posted; the size the peer takes (0: never send eager)
        self._eager_free: list[memoryview] = []
        self._eager_size = 0
        self._stash: dict[int, Deque[tuple[memoryview, Received]]] = {}
        self._peer_eager = 0
        self._peer_offered = False  # the peer's offer arrived (its size may be 0: then nothing goes eagerly)
        self._offered = False
        # reader state (touched only by the thread holding the reader role)
        self._rbuf = bytearray(READ_AHEAD)
        self._rview = memoryview(self._rbuf)
        self._rpos = 0  # read-ahead bytes [_rpos, _rend) not parsed yet
        self._rend = 0
        self._rphase = 0  # 0: header, 1: payload
        self._roff = 0
        self._rtarget: memoryview | None = None
        self._rpost: Posted | None = None
        self._reager: memoryview | None = None  # the eager buffer the payload goes to (no buffer posted)
        self._rmeta: tuple[int, int, int, tuple[int, ...] | None] | None = None
        self._poll_r = select.poll()
        self._poll_r.register(self._fd, select.POLLIN)
        self._poll_w = select.poll()
        self._poll_w.register(self._fd, select.POLLOUT)
        self._poll_rw = select.poll()
        self._poll_rw.register(self._fd, select.POLLIN | select.POLLOUT)
        self.bytes_sent = 0
        self.bytes_received = 0
        #: Cross-memory attach with the peer (None: a connection that proved no link secret).
        self.cma = cma

    # -- what every role reads ---------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def describe(self) -> str:
        return f"tcp to {self._peer}"

    @property
    def spin_us(self) -> float:
        """Microseconds a blocking read polls the socket before it sleeps (0: never)."""
        return self._spin * 1e6

    def set_spin(self, us: float) -> None:
        """Poll the socket for ``us`` microseconds before a blocking read sleeps (0: never), from the next wait."""
        self._spin = self._rspin = max(0.0, us) * 1e-6

    def forget_buffer(self, buf: Any) -> None:
        cached = self._views.get(id(buf))
        if cached is not None and cached[0] is buf:
            del self._views[id(buf)]

    def _check_usable(self) -> None:
        err = self._error
        if err is not None:
            if isinstance(err, (TransportError, ClosedError, ProtocolError, AuthError)):
                raise type(err)(str(err)) from err
            raise PeerLostError(str(err)) from err

    def _fail(self, exc: BaseException) -> None:
        """Record a fatal error (first one wins) and wake everyone."""
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    def _translate(self, exc: OSError, doing: str) -> TransportError:
        if isinstance(exc, (ConnectionError, TimeoutError)) or exc.errno in PEER_GONE:
            return PeerLostError(f"{doing}: peer {self._peer} lost ({exc})")
        return TransportError(f"{doing}: {exc}")
