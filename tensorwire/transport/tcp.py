"""TCP data plane: plain sockets, fixed-size frame headers, ``recv_into`` the slot.

Wire format (little-endian, every frame starts with the same 88-byte header)::

    magic  "TW"        2s   protocol marker; anything else breaks the connection
    type   u8          1 = DATA, 2 = CREDIT, 3 = BYE, 4 = CMA (control), 5 = WRITTEN,
                       6 = EAGER (DATA sent ahead of its credit)
    ndim   u8          dims in use for DATA with a shape (0..8), 255 = no shape; CMA: subtype
    tag    u32         DATA: slot tag
    step   u64         DATA: per-tag message counter (checked: +1 each time)
    nbytes u64         DATA/EAGER: payload bytes that follow; CREDIT of EAGER_TAG: eager buffer size
    ctag   u32         credits granted for this tag ...
    ccount u32         ... this many (any frame type may carry a grant)
    dims   8 x i64     DATA: actual shape (dynamic specs)

DATA is followed by exactly ``nbytes`` payload bytes, received with
``recv_into`` directly into the posted slot buffer (no intermediate copy).

On links between processes of one host, large messages skip the socket: the
sender writes them straight into the receiver's posted buffer (cross-memory
attach) and sends WRITTEN, a DATA header without payload. CMA frames carry the
probe that turns this on and the addresses of posted buffers (a 64-byte body
in place of ``dims``); see :mod:`tensorwire.transport.cma`. Only connections
that proved the link secret take part.

Flow control reproduces UCX's rendezvous: the receiver grants one CREDIT per
posted buffer, and a sender spends one credit per DATA frame. So every DATA
frame that arrives has a free buffer waiting and the reader never blocks on
the application — two peers can send large tensors at each other at once.

Eager messages (opt-in, :meth:`TcpTransport.offer_eager`): a receiver may set
aside a few small buffers of its own and grant them to the peer on the pseudo
tag ``EAGER_TAG`` (the grant's ``nbytes`` says how large each is). A sender
with no credit on a tag then sends a message that fits such a buffer at once,
as an EAGER frame, instead of waiting a round trip for the credit: the receiver
reads it straight into the posted buffer when there is one (zero-copy), else
into a free eager buffer, copied into the buffer posted next on that tag. The
per-tag credit it went ahead of is still granted when that buffer is posted,
and the sender's balance for the tag (which went one below zero) comes back to
zero: one credit per posted buffer and one message per posted buffer, in order,
as before. An eager buffer goes back to the sender as an ``EAGER_TAG`` credit
once its bytes left it. A receiver that made no offer refuses EAGER frames.
Credits ride in the header of the next DATA frame going the other way; a
separate CREDIT frame is sent only when a thread of this process is about to
block (then every pending credit of every connection is flushed, so no cycle
of links can wait on each other). A separate frame would wake the peer's
process once more per message, which costs more than the syscall itself.

Progress model ("caller progresses"): there is no background thread per
connection. A thread waiting for a receive or a credit becomes the *reader*
(one at a time) and pumps frames off the socket into posted buffers; a thread
whose write would block also pumps reads when no one else does. This keeps the
small-message path free of thread hand-offs (see bench/ for the figures). The
reader reads up to ``READ_AHEAD`` bytes at a time, so a small frame (header and
payload) and the credits riding behind it take one system call; the payload
bytes past the read-ahead are received straight into the posted buffer.
:meth:`TcpTransport.try_send` sends a frame only if that needs no waiting at
all (a credit is there and the socket takes the frame), for callers that must
never block.

Connection set-up: the connecting side sends a hello (magic, protocol version,
16-byte nonce learned over the control plane, then a 16-byte proof that it
holds the link secret: :func:`~tensorwire.transport.base.link_proof`, zeros
without one); the listener answers OK, NO (wrong proof, unknown credential or
version) or BUSY (evicted to make room under a flood of connections that send
no hello: the client dials again with backoff), each 8 bytes. A listener made
with ``secret=`` (links) checks the proof in constant time *before* it looks
at the nonce, so a stranger holding a leaked nonce neither gets in nor uses
the nonce up; one without (the serve daemon, whose nonces are per-session
credentials handed out over its authenticated control plane) ignores it. The
version comes before the proof: a peer of another version is told so after
the first 28 bytes. Garbage, truncated or slow hellos are dropped without disturbing other
connections; see :mod:`tensorwire.transport.admission` for the bounds.

Liveness: TCP keepalive and ``TCP_USER_TIMEOUT`` bounded by ``peer_timeout``,
so a cut network surfaces as :class:`~tensorwire.PeerLostError` rather than a hang.
"""

from __future__ import annotations

import collections
import errno
import logging
import select
import selectors
import socket
import struct
import threading
import time
from typing import Any, Deque

from tensorwire.errors import (
    AuthError,
    ClosedError,
    ConnectTimeout,
    PeerLostError,
    ProtocolError,
    ResourceExhaustedError,
    TransferTimeout,
    TensorWireError,
    TransportError,
    VersionMismatchError,
)
from tensorwire.transport.admission import AdmissionLimits, PendingTable
from tensorwire.transport.base import HEADER_DIMS, NONCE_BYTES, PROOF_BYTES, Listener, Received, Transport
from tensorwire.transport.base import link_proof, proof_matches
from tensorwire.transport.base import remaining as _remaining
from tensorwire.transport._socket import dial, tune_socket
from tensorwire.transport.cma import CmaPeer, new_cma_peer

__all__ = ["TcpTransport", "TcpListener", "PartialSend", "FRAME", "HELLO", "HELLO_HEAD", "EAGER_TAG"]

log = logging.getLogger(__name__)

#: v2: the hello carries a proof of the link secret after the nonce. v3: CMA and WRITTEN frames. (EAGER frames
#: go only to a peer that offered eager buffers: no new version.)
PROTOCOL_VERSION = 3
FRAME = struct.Struct("<2sBBIQQII8q")
#: A CMA frame: the same header with a 64-byte body in place of the dims.
CMA_FRAME = struct.Struct("<2sBBIQQII64s")
assert FRAME.size == CMA_FRAME.size == 96
#: the same header in two parts: the fields, then the eight dims (read only when a shape is there)
_HEAD = struct.Struct("<2sBBIQQII")
_DIMS = struct.Struct("<8q")
_DIMS_AT = _HEAD.size
#: magic, version, nonce (what every version of the hello starts with: the version is read first) ...
HELLO_HEAD = struct.Struct(f"<8sI{NONCE_BYTES}s")
#: ... then, from v2, the proof of the link secret (zeros without one).
HELLO = struct.Struct(f"<8sI{NONCE_BYTES}s{PROOF_BYTES}s")
HELLO_MAGIC = b"TWHELLO\0"
HELLO_OK = b"TWOK"
DATA, CREDIT, BYE, CMA, WRITTEN, EAGER = 1, 2, 3, 4, 5, 6
#: The pseudo tag on which a receiver grants (and gives back) its eager buffers (transport tags are < 2**31).
EAGER_TAG = 0xFFFFFFFF
#: Bytes the reader takes off the socket at once (header, small payloads and the frames behind them).
READ_AHEAD = 32 * 1024
NO_SHAPE = 255
_MAGIC = b"TW"
_ZERO_DIMS = (0,) * HEADER_DIMS
_PEER_GONE = (errno.ECONNRESET, errno.EPIPE, errno.ETIMEDOUT, errno.ECONNABORTED, errno.EHOSTUNREACH, errno.ENETUNREACH)
_POLLERR = select.POLLERR | select.POLLHUP | select.POLLNVAL


def _poll_ms(deadline: float | None, cap: float = 0.5) -> int:
    """Milliseconds to poll: bounded so closed/broken state is noticed promptly."""
    if deadline is None:
        return int(cap * 1000)
    return max(0, min(int((deadline - time.monotonic()) * 1000) + 1, int(cap * 1000)))


class _Posted:
    __slots__ = ("view", "header", "result")

    def __init__(self, view: memoryview, header: bool) -> None:
        self.view = view
        self.header = header
        self.result: Received | None = None


class PartialSend:
    """A frame :meth:`TcpTransport.try_send` began to write but the socket did not take whole.

    The connection's send lock stays held (no other frame may start) until
    :meth:`TcpTransport.finish_send` writes the rest, from any thread.
    """

    __slots__ = ("views", "nbytes")

    def __init__(self, views: list[memoryview], nbytes: int) -> None:
        self.views = views
        self.nbytes = nbytes


def _advance(views: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of a gather list (in place)."""
    while n:
        if n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        else:
            views[0] = views[0][n:]
            n = 0


# Transports holding credits not yet sent (_PENDING), and those of them holding a credit a peer may be
# waiting for (_URGENT). Before any thread blocks, every urgent one is flushed: a peer may be blocked on
# a credit we still hold, on this link or on another one that closes a cycle. A credit is *not* urgent
# when the peer needs no credit to send what fits its buffer: the buffer is no larger than the eager
# buffers this side offered and one of them is free (the peer sends such a message eagerly; the credit
# rides on our next DATA frame and only settles the peer's balance; eager buffers given back are always
# urgent). Such credits wait for a frame going the other way, or until
# a blocked reader saw nothing for a whole read slice (a peer sending a larger message than the buffer
# -- a mismatch the receiver reports -- waits for it that long).
_PENDING: "set[TcpTransport]" = set()
_URGENT: "set[TcpTransport]" = set()
_PENDING_LOCK = threading.Lock()


def flush_pending_credits(exclude: "TcpTransport | None" = None, *, held: bool = False) -> None:
    """Send the credits a peer may be waiting for (``held``: every credit) this process still holds back
    (called before blocking)."""
    which = _PENDING if held else _URGENT
    if not which:  # fast path, no lock: a stale answer only delays by one read slice
        return
    with _PENDING_LOCK:
        todo = [t for t in which if t is not exclude]
    for t in todo:
        t._flush_credits()


def _shape_words(shape: tuple[int, ...] | None) -> tuple[int, tuple[int, ...]]:
    """(ndim field, the eight dims) of a frame header."""
    if shape is None:
        return NO_SHAPE, _ZERO_DIMS
    if len(shape) > HEADER_DIMS:
        raise ProtocolError(f"rank {len(shape)} exceeds {HEADER_DIMS}")
    if len(shape) == HEADER_DIMS:
        return HEADER_DIMS, tuple(shape)
    return len(shape), tuple(shape) + (0,) * (HEADER_DIMS - len(shape))


def _host_view(buf: Any) -> memoryview:
    """Flat byte view of a host buffer (flat uint8 tensor or memoryview), zero-copy."""
    if isinstance(buf, memoryview):
        return buf.cast("B") if buf.format != "B" or buf.ndim != 1 else buf
    if buf.numel() == 0:
        return memoryview(bytearray(0))
    if buf.requires_grad:
        buf = buf.detach()
    mv = memoryview(buf.numpy())
    return mv if mv.ndim == 1 and mv.format == "B" else mv.cast("B")


class TcpTransport(Transport):
    """A framed, credit-flow-controlled TCP connection to one peer. See the module docstring."""

    kind = "tcp"
    reaches_cuda = False
    #: How long one blocking read waits before re-checking deadlines and state.
    READ_SLICE = 0.2
    #: How long one blocking write waits before reading what the peer sent meanwhile.
    SEND_SLICE = 0.02
    #: Posted-buffer views kept for reuse (a Link re-posts the same slots every step).
    VIEW_CACHE = 256
    #: Largest cross-memory copy :meth:`try_send` makes in the caller's thread (larger ones: :meth:`send`).
    INLINE_COPY = 256 * 1024

    def __init__(
        self, sock: socket.socket, *, peer: str = "", peer_timeout: float = 30.0, cma: CmaPeer | None = None
    ) -> None:
        """``cma``: cross-memory attach with the peer (links that proved the link secret); None: never."""
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
        self._posted: dict[int, Deque[_Posted]] = collections.defaultdict(collections.deque)
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
        self._rpost: _Posted | None = None
        self._reager: memoryview | None = None  # the eager buffer the payload goes to (no buffer posted)
        self._rmeta: tuple[int, int, int, tuple[int, ...] | None] | None = None
        self._poll_w = select.poll()
        self._poll_w.register(self._fd, select.POLLOUT)
        self._poll_rw = select.poll()
        self._poll_rw.register(self._fd, select.POLLIN | select.POLLOUT)
        self.bytes_sent = 0
        self.bytes_received = 0
        #: Cross-memory attach with the peer (None: a connection that proved no link secret).
        self.cma = cma
        if cma is not None:
            cma.start()
            self._owe(urgent=True)  # the probe's first frame goes out with the first flush or send

    # -- public API ------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def describe(self) -> str:
        return f"tcp to {self._peer}"

    def post_recv(self, tag: int, buf: Any, *, header: bool = False) -> None:
        # Posted buffers are long-lived slots: cache their views (the cache holds the object, so its id stays unique).
        cached = self._views.get(id(buf))
        if cached is None or cached[0] is not buf:
            if len(self._views) >= self.VIEW_CACHE:
                self._views.clear()  # callers posting ever-new buffers (serve) must not grow this
            cached = (buf, _host_view(buf))
            self._views[id(buf)] = cached
        view = cached[1]
        with self._lock:
            self._check_usable()
            post = _Posted(view, header)
            cma = self.cma
            stash = self._stash.get(tag)
            if stash:  # the message this buffer is for came early, into an eager buffer: copy it here
                if cma is not None:
                    cma.on_post(tag, post, view[:0])  # counted, never announced: its message is here already
                ebuf, got = stash.popleft()
                if got.nbytes > len(view):
                    if self._error is None:  # the next wait on this connection raises it
                        self._error = ProtocolError(
                            f"peer {self._peer} sent {got.nbytes} bytes on tag {tag}; the slot holds {len(view)}"
                        )
                    self._cond.notify_all()
                else:
                    view[: got.nbytes] = ebuf[: got.nbytes]
                    post.result = got
                    self._eager_free.append(ebuf)
                    self._pending_credits[EAGER_TAG] += 1
            elif cma is not None:
                cma.on_post(tag, post, view)
            self._posted[tag].append(post)
            # The credit rides on our next DATA frame, or is flushed before any
            # thread of this process blocks (see flush_pending_credits).
            self._pending_credits[tag] += 1
            # held back only where the peer needs no credit: the buffer fits one of our eager buffers, one of them
            # is free, and nothing is to go back (see _URGENT)
            urgent = (
                not self._eager_free
                or len(view) > self._eager_size
                or post.result is not None
                or (cma is not None and cma.has_frames)  # a SLOT goes ahead of its credit, at once
            )
        self._owe(urgent=urgent)

    def has_credit(self, tag: int) -> bool:
        return self._credits.get(tag, 0) > 0 and self._error is None

    def can_send(self, tag: int, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` on ``tag`` could go now without waiting for a credit (never blocks)."""
        return self._error is None and (
            self._credits.get(tag, 0) > 0 or (nbytes <= self._peer_eager and self._credits.get(EAGER_TAG, 0) > 0)
        )

    def offer_eager(self, *, slots: int, size: int) -> None:
        """Let the peer send up to ``slots`` messages of at most ``size`` bytes before their receive is posted.

        Sets aside ``slots * size`` bytes once and grants them to the peer (see the
        module docstring); a no-op if already offered. Both ends of a connection
        may offer, independently. Call before traffic starts (it writes one frame).

        Raises:
            ClosedError, PeerLostError: the connection is unusable.
        """
        if slots <= 0 or size <= 0:
            raise ValueError(f"offer_eager needs slots > 0 and size > 0, got {slots}, {size}")
        with self._send_lock:
            with self._lock:
                self._check_usable()
                if self._offered:
                    return
                self._offered = True
                if self.cma is not None:
                    # a buffer the peer may write into (cross-memory: at least min_bytes) is never one a message
                    # goes to eagerly: eager messages stay below that size
                    size = max(0, min(size, self.cma.min_bytes - 1))
                pool = memoryview(bytearray(slots * size))
                self._eager_free = [pool[i * size : (i + 1) * size] for i in range(slots)]
                self._eager_size = size
            grant = FRAME.pack(_MAGIC, CREDIT, NO_SHAPE, 0, 0, size, EAGER_TAG, slots, *_ZERO_DIMS)
            self._write([memoryview(grant)], time.monotonic() + self._peer_timeout)

    def wait_eager_offer(self, *, timeout: float | None) -> None:
        """Wait until the peer's :meth:`offer_eager` arrived (for two ends that both offer: then the first
        message of either already goes eagerly).

        Raises:
            TransferTimeout: no offer within ``timeout``.
            PeerLostError, ClosedError.
        """
        self._wait_for(
            lambda: self._peer_offered,
            None if timeout is None else time.monotonic() + timeout,
            "eager offer of the peer",
        )

    def forget_buffer(self, buf: Any) -> None:
        cached = self._views.get(id(buf))
        if cached is not None and cached[0] is buf:
            del self._views[id(buf)]

    def wait_recv(self, tag: int, *, timeout: float | None) -> Received:
        q = self._posted[tag]  # (the deque of a tag is never replaced)
        if not q or q[0].result is None:  # not there yet: wait (fast path skips this)
            self._wait_for(
                lambda: bool(q) and q[0].result is not None,
                None if timeout is None else time.monotonic() + timeout,
                "receive on tag %d",
                tag,
            )
        with self._lock:
            return q.popleft().result  # type: ignore[return-value]

    def send(
        self,
        tag: int,
        buf: Any,
        *,
        step: int | None = None,
        shape: tuple[int, ...] | None = None,
        timeout: float | None,
    ) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        payload = buf if type(buf) is memoryview else _host_view(buf)
        ndim, dims = _shape_words(shape)
        n = len(payload)

        def ready() -> bool:
            return self._credits[tag] > 0 or (n <= self._peer_eager and self._credits[EAGER_TAG] > 0)

        # Fast path: a credit is there and nobody else is sending.
        have = ready() and self._send_lock.acquire(False)
        if have:
            with self._lock:
                if not (ready() or self._error is not None):
                    have = False
            if not have:
                self._send_lock.release()
        while not have:
            self._wait_for(ready, deadline, "credit to send on tag %d", tag)
            if not self._send_lock.acquire(timeout=-1 if deadline is None else max(0.0, deadline - time.monotonic())):
                raise TransferTimeout(f"send on tag {tag}: another send held the connection past the timeout")
            with self._lock:
                if ready() or self._error is not None:
                    break
            self._send_lock.release()  # another sender took the credit first: wait again
        cma = self.cma
        try:
            with self._lock:
                self._check_usable()
                claim = self._claim(tag, n, step)
                assert claim is not None  # a credit was there under the send lock: only senders take credits
                ftype, wire_step, grants, ctrl = claim
                slot = cma.slot_for(tag, wire_step) if cma is not None else None
            if slot is not None and n >= cma.min_bytes:  # type: ignore[union-attr]
                if grants or ctrl:  # hand them over before the copy, not after it
                    self._write([memoryview(self._control_frames(grants, ctrl))], deadline)
                    grants, ctrl = [], None
                if self._cma_write(payload, slot):
                    ftype = WRITTEN
            header = self._header(ftype, ndim, tag, wire_step, n, grants, ctrl, dims)
            self._write([memoryview(header), payload] if n and ftype != WRITTEN else [memoryview(header)], deadline)
            self.bytes_sent += n
        finally:
            self._send_lock.release()
        if self in _URGENT:
            # Receives posted while this frame was on the wire: their flush found the connection busy
            # and left the credits to us. Nobody else may try again before blocking on the peer.
            self._flush_credits()

    def try_send(
        self, tag: int, buf: Any, *, step: int | None = None, shape: tuple[int, ...] | None = None
    ) -> "bool | PartialSend":
        """Send ``buf`` as the next message on ``tag`` only as far as that needs no waiting at all.

        Returns True: the whole frame is out of ``buf``. False: nothing was sent (no
        credit, another send in progress, or the socket full): send it later. A
        :class:`PartialSend`: the socket took part of the frame; ``buf`` must stay
        untouched and the connection's sends wait until :meth:`finish_send` wrote the rest.
        A message for which the peer announced its buffer (cross-memory attach) is copied
        into it here when it is at most ``INLINE_COPY`` bytes (a bounded copy, no waiting),
        else left to :meth:`send`.

        Raises:
            PeerLostError, ClosedError, ProtocolError: the connection is unusable.
        """
        if not self._send_lock.acquire(False):
            return False
        keep = False
        try:
            payload = buf if type(buf) is memoryview else _host_view(buf)
            n = len(payload)
            cma = self.cma
            copy = cma is not None and cma.sending and n >= cma.min_bytes
            if copy and n > self.INLINE_COPY:
                return False  # a long cross-memory copy: that is send()'s, on the caller's sender thread
            ndim, dims = _shape_words(shape)
            with self._lock:
                if self._error is not None:
                    self._check_usable()
                claim = self._claim(tag, n, step)
            if claim is None:  # perhaps a credit came that nobody read yet: look once
                self._look()
                with self._lock:
                    self._check_usable()
                    claim = self._claim(tag, n, step)
                if claim is None:
                    return False
            ftype, wire_step, grants, ctrl = claim
            slot = cma.slot_for(tag, wire_step) if cma is not None else None  # (used or not: forgotten)
            if copy and slot is not None and self._cma_write(payload, slot):
                ftype = WRITTEN  # the bytes are in the peer's buffer: the header alone follows
            header = self._header(ftype, ndim, tag, wire_step, n, grants, ctrl, dims)
            if ftype == WRITTEN:
                n = 0
            views = [header, payload] if n else [header]
            try:
                sent = self._sock.sendmsg(views, (), socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                err = ClosedError("transport closed") if self._closed else self._translate(exc, "send")
                self._fail(err)
                raise err from exc
            if sent == len(header) + n:
                self.bytes_sent += len(payload)
                return True
            if sent == 0 and ftype != WRITTEN:  # (a message copied already is spent: its header must follow)
                self._unframe(tag, header, ctrl)
                return False
            rest = [memoryview(header), payload] if n else [memoryview(header)]
            _advance(rest, sent)
            keep = True
            return PartialSend(rest, len(payload))
        finally:
            if not keep:
                self._send_lock.release()

    def finish_send(self, partial: PartialSend, *, timeout: float | None) -> None:
        """Write the rest of a frame :meth:`try_send` began (any thread; exactly once per PartialSend).

        Raises:
            TransferTimeout: not all out within ``timeout`` (the connection is then broken: a frame was cut).
            PeerLostError, ClosedError.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._write(partial.views, deadline)
            self.bytes_sent += partial.nbytes
        except TransferTimeout:
            # part of the frame is out already: nobody can frame anything after it any more
            self._fail(PeerLostError(f"send to {self._peer} stalled mid-frame past its timeout"))
            raise
        finally:
            self._send_lock.release()

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            if self._error is None:
                self._error = ClosedError("transport closed")
            self._cond.notify_all()
        # Best-effort goodbye so the peer reports a clean close, then free the fd.
        if self._send_lock.acquire(timeout=0.2):
            try:
                self._sock.send(FRAME.pack(_MAGIC, BYE, NO_SHAPE, 0, 0, 0, 0, 0, *_ZERO_DIMS), socket.MSG_DONTWAIT)
                self._sock.shutdown(socket.SHUT_WR)  # FIN after the BYE
            except OSError:
                pass
            finally:
                self._send_lock.release()
        self._drain()
        self._shutdown()

    def _drain(self, limit: float = 0.25) -> None:
        """Discard unread input before closing: closing with unread bytes makes the
        kernel send RST, and an RST can destroy frames the peer has not read yet."""
        scratch = bytearray(1 << 16)
        end = time.monotonic() + limit
        while time.monotonic() < end:
            try:
                if self._sock.recv_into(scratch, len(scratch), socket.MSG_DONTWAIT) == 0:
                    return  # the peer closed too: nothing left
            except (BlockingIOError, InterruptedError):
                return  # nothing unread now
            except OSError:
                return

    def abort(self) -> None:
        with self._cond:
            self._closed = True
            if self._error is None:
                self._error = ClosedError("transport aborted")
            self._cond.notify_all()
        self._shutdown()

    # -- internals -------------------------------------------------------------
    def _shutdown(self) -> None:
        with _PENDING_LOCK:
            _PENDING.discard(self)
            _URGENT.discard(self)
        if self.cma is not None:
            self.cma.close()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

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
        if isinstance(exc, (ConnectionError, TimeoutError)) or exc.errno in _PEER_GONE:
            return PeerLostError(f"{doing}: peer {self._peer} lost ({exc})")
        return TransportError(f"{doing}: {exc}")

    def _take_credits(self) -> list[tuple[int, int]]:
        """Under the lock: take all pending credits as (tag, count)."""
        if not self._pending_credits:
            return []
        grants = list(self._pending_credits.items())
        self._pending_credits.clear()
        return grants

    def _claim(self, tag: int, n: int, step: int | None) -> tuple[int, int, list[Any], Any] | None:
        """Under the lock and the send lock: take a credit for the next message on ``tag`` (``n`` bytes), or
        an eager buffer of the peer's, and what goes with it: ``(frame type, step on the wire, grants,
        cross-memory control frames)``; None without a credit."""
        have = self._credits
        if have[tag] > 0:
            ftype = DATA
        elif n <= self._peer_eager and have[EAGER_TAG] > 0:
            ftype = EAGER
            have[EAGER_TAG] -= 1
        else:
            return None
        have[tag] -= 1  # below zero after an eager frame, until the buffer's credit arrives
        s = self._send_steps[tag] = self._send_steps[tag] + 1
        cma = self.cma
        ctrl = cma.take_frames() if cma is not None and cma.has_frames else None
        owed = self._pending_credits
        if owed:
            grants = list(owed.items())
            owed.clear()
        else:
            grants = []
        if grants or ctrl:
            self._settled()
        return ftype, s if step is None else step, grants, ctrl

    def _header(
        self, ftype: int, ndim: int, tag: int, step: int, n: int, grants: list[Any], ctrl: Any, dims: tuple[int, ...]
    ) -> bytes:
        """A frame's header bytes: control frames (CMA, then CREDIT) first; the last grant rides in the header."""
        ctag, cn = grants.pop() if grants else (0, 0)
        header = FRAME.pack(_MAGIC, ftype, ndim, tag, step, n, ctag, cn, *dims)
        if grants or ctrl:
            return self._control_frames(grants, ctrl) + header
        return header

    def _unframe(self, tag: int, headers: bytes, ctrl: list[Any] | None) -> None:
        """Undo :meth:`_claim` for a frame of which no byte was written (still under the send lock):
        ``headers`` are its header bytes (control frames first, then the DATA/EAGER header), ``ctrl`` the
        cross-memory frames among them (they go back to be sent first)."""
        ftype = DATA
        if ctrl:
            assert self.cma is not None
            self.cma.put_back(ctrl)
        with self._lock:
            for off in range(0, len(headers), FRAME.size):
                _, ftype, _, _, _, _, ctag, cn = _HEAD.unpack_from(headers, off)
                if ftype != CMA and cn:
                    self._pending_credits[ctag] += cn
            self._credits[tag] += 1
            if ftype == EAGER:
                self._credits[EAGER_TAG] += 1
            self._send_steps[tag] -= 1
            owed = self._has_pending()
        if owed:
            self._owe(urgent=True)

    @staticmethod
    def _credit_frames(grants: list[tuple[int, int]]) -> bytes:
        return b"".join([FRAME.pack(_MAGIC, CREDIT, NO_SHAPE, 0, 0, 0, t, c, *_ZERO_DIMS) for t, c in grants])

    def _has_pending(self) -> bool:
        """Credits or cross-memory control frames wait to be sent."""
        return bool(self._pending_credits) or (self.cma is not None and self.cma.has_frames)

    def _control_frames(self, grants: list[tuple[int, int]], ctrl: list[Any] | None) -> bytes:
        """CMA frames first (a buffer's SLOT goes ahead of its credit), then CREDIT frames."""
        cma = b"".join(CMA_FRAME.pack(_MAGIC, CMA, *f[:2], f[2], f[3], 0, 0, f[4]) for f in ctrl) if ctrl else b""
        return cma + (self._credit_frames(grants) if grants else b"")

    def _cma_write(self, payload: memoryview, slot: tuple[int, int]) -> bool:
        """Copy a message into the peer's announced buffer (see :meth:`CmaPeer.write`); a failure breaks
        the connection: the message's step is spent and its bytes may be half there."""
        assert self.cma is not None
        try:
            return self.cma.write(payload, slot)
        except TensorWireError as exc:
            self._fail(exc)
            raise

    def _flush_credits(self) -> None:
        """Send pending credits (and CMA frames) now, unless a send is in progress (it carries them)."""
        if not self._send_lock.acquire(blocking=False):
            return
        try:
            cma = self.cma
            with self._cond:
                if self._error is not None:
                    grants, ctrl = [], None
                else:
                    grants = self._take_credits()
                    ctrl = cma.take_frames() if cma is not None and cma.has_frames else None
            if grants or ctrl:
                self._write([memoryview(self._control_frames(grants, ctrl))], time.monotonic() + self._peer_timeout)
        except TransferTimeout as exc:
            self._fail(PeerLostError(f"could not grant credits to {self._peer}: {exc}"))
        except TensorWireError:
            pass  # recorded by _write; waiters will see it
        finally:
            self._send_lock.release()
            self._settled()

    def _owe(self, *, urgent: bool) -> None:
        """(not under the lock) Pending credits were added: make sure a flush before blocking finds them."""
        with _PENDING_LOCK:  # always: a check outside the lock could race _settled's discard
            _PENDING.add(self)
            if urgent:
                _URGENT.add(self)

    def _settled(self) -> None:
        """Pending credits were taken (may be under the lock): forget this transport if none are left."""
        if self in _PENDING:
            with _PENDING_LOCK:
                if not self._has_pending():
                    _PENDING.discard(self)
                    _URGENT.discard(self)

    def _wait_for(self, pred: Any, deadline: float | None, what: str, arg: int | None = None) -> None:
        """Wait until ``pred()`` (evaluated under the lock) holds, reading the socket when no one else is.
        ``what % arg`` names the wait in a timeout. A deadline already past still reads what the socket
        holds, without waiting, once (a poll makes progress)."""
        read = False
        with self._cond:
            while True:
                if pred():
                    return
                if self._error is not None:
                    self._check_usable()
                rem = None if deadline is None else deadline - time.monotonic()
                if rem is not None and rem <= 0 and (read or self._reader_busy):
                    raise TransferTimeout(f"{what if arg is None else what % arg} timed out (peer {self._peer})")
                if not self._reader_busy:
                    read = True
                    self._reader_busy = True
                    self._cond.release()
                    try:
                        self._pump(pred, deadline)
                    finally:
                        self._cond.acquire()
                        self._reader_busy = False
                        if self._waiters:
                            self._cond.notify_all()
                else:
                    self._cond.release()
                    try:
                        flush_pending_credits()
                    finally:
                        self._cond.acquire()
                    if not pred():
                        self._waiters += 1
                        try:
                            self._cond.wait(self.READ_SLICE if rem is None else min(rem, self.READ_SLICE))
                        finally:
                            self._waiters -= 1

    def _pump(self, pred: Any, deadline: float | None) -> None:
        """Reader role: read frames until pred() holds, the deadline passes, or an error."""
        # with credits to hand back, look before blocking; past the deadline, only look
        block = not _URGENT and (deadline is None or time.monotonic() < deadline)
        while True:
            try:
                progressed = self._read_some(block=block)
            except BaseException as exc:  # noqa: BLE001 - recorded, re-raised by waiters
                self._fail(exc)
                return
            if progressed:
                try:  # frames that came in the same read (credits riding behind): take them now, no system call
                    while self._read_some(block=False, buffered=True):
                        pass
                except BaseException as exc:  # noqa: BLE001 - recorded, re-raised by waiters
                    self._fail(exc)
                    return
                with self._lock:
                    if self._waiters:
                        self._cond.notify_all()
                    if pred() or self._error is not None:
                        return
                block = not _URGENT and (deadline is None or time.monotonic() < deadline)
                continue
            if self._error is not None:
                return
            rem = _remaining(deadline)
            if rem is not None and rem <= 0:
                return
            if not block:
                # About to block: first hand back every credit a peer may be waiting for.
                flush_pending_credits()
                with self._cond:
                    if pred() or self._error is not None:
                        return
                block = True
            elif _PENDING:
                # A whole read slice without a byte: hand back the credits held back too (see _URGENT).
                flush_pending_credits(held=True)

    def _recv(self, view: memoryview, n: int, block: bool) -> int:
        try:
            if block:
                return self._sock.recv_into(view, n, socket.MSG_WAITALL if n > 65536 else 0)
            return self._sock.recv_into(view, n, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return -1
        except OSError as exc:
            if self._closed:
                raise ClosedError("transport closed") from exc
            raise self._translate(exc, "receive") from exc

    def _read_some(self, *, block: bool, buffered: bool = False) -> bool:
        """Advance the frame reader. True if a whole frame completed; False if no data (yet).

        ``buffered``: only from what the read-ahead buffer holds (no system call).
        """
        rview = self._rview
        while True:
            if self._rphase == 0:
                pos, end = self._rpos, self._rend
                if end - pos < FRAME.size:
                    if buffered or self._fill(block or end > pos) < 0:
                        return False
                    continue
                if buffered and self._rbuf[pos + 2] == BYE:
                    return False  # the peer's goodbye waits for a reader that needs more: what came before it is used
                self._rpos = pos + FRAME.size
                if self._on_header(pos):
                    return True
                # the payload: first what the read-ahead holds, the rest straight from the socket
                target = self._rtarget
                assert target is not None
                pos, end = self._rpos, self._rend
                k = min(end - pos, len(target))
                if k:
                    target[:k] = rview[pos : pos + k]
                    self._rpos = pos + k
                    self.bytes_received += k
                self._roff = k
                if k == len(target):
                    self._complete_data()
                    return True
                self._rpos = self._rend = 0  # the read-ahead is empty (the payload took all of it)
                block = True  # a frame has started: wait for the rest of it
                if buffered:
                    return False
            else:
                if buffered:
                    return False
                target = self._rtarget
                assert target is not None
                n = self._recv(target[self._roff :], len(target) - self._roff, block)
                if n < 0:
                    return False
                if n == 0:
                    raise PeerLostError(f"peer {self._peer} closed the connection mid-message")
                self._roff += n
                self.bytes_received += n
                if self._roff == len(target):
                    self._complete_data()
                    return True
                block = True  # a frame has started: wait for the rest of it

    def _fill(self, block: bool) -> int:
        """(reader, between frames) Read into the read-ahead buffer: bytes read, -1 if none (not blocking)."""
        pos, end = self._rpos, self._rend
        if pos:  # keep the start of a header (if any) at the front of the buffer
            if end > pos:
                self._rbuf[: end - pos] = bytes(self._rview[pos:end])
            end -= pos
            self._rpos, self._rend = 0, end
        n = self._recv(self._rview[end:], READ_AHEAD - end, block)
        if n == 0:
            raise (
                ClosedError("transport closed")
                if self._closed
                else PeerLostError(f"peer {self._peer} closed the connection")
            )
        if n > 0:
            self._rend = end + n
        return n

    def _look(self) -> None:
        """Take what the socket holds right now, if no other thread is reading: one read of at most
        ``READ_AHEAD`` bytes that does not wait, whole frames only (credits that came while nobody read)."""
        with self._lock:
            if self._reader_busy or self._error is not None or self._rphase:
                return
            self._reader_busy = True
        try:
            if self._fill(False) > 0:
                while self._read_some(block=False, buffered=True):
                    pass
        except BaseException as exc:  # noqa: BLE001 - recorded, re-raised by whoever uses the connection
            self._fail(exc)
        finally:
            with self._cond:
                self._reader_busy = False
                if self._waiters:
                    self._cond.notify_all()

    def _on_header(self, pos: int) -> bool:
        """Parse the header at ``pos`` of the read-ahead buffer. True if the frame is complete (no payload)."""
        magic, ftype, ndim, tag, step, nbytes, ctag, ccount = _HEAD.unpack_from(self._rbuf, pos)
        if magic != _MAGIC:
            raise ProtocolError(f"bad frame magic {bytes(magic)!r} from {self._peer}")
        if ftype == CREDIT:
            with self._lock:
                self._credits[ctag] += ccount
            if ctag == EAGER_TAG and ccount:  # the peer's offer (its buffers come back as grants without a size)
                if not self._peer_offered:
                    self._peer_eager = nbytes
                    self._peer_offered = True
            return True
        if ftype != DATA and ftype != EAGER:
            if ftype == BYE:
                raise PeerLostError(f"peer {self._peer} closed the link")
            if ftype == CMA:
                if self.cma is None:
                    raise ProtocolError(
                        f"peer {self._peer} sent a cross-memory frame on a connection without a link secret"
                    )
                self.cma.on_frame(ndim, tag, step, nbytes, CMA_FRAME.unpack_from(self._rbuf, pos)[8])
                if self.cma.has_frames:
                    self._owe(urgent=True)
                return True
            if ftype != WRITTEN:
                raise ProtocolError(f"unknown frame type {ftype} from {self._peer}")
        post = ebuf = None
        with self._lock:
            if ccount:
                self._credits[ctag] += ccount
            q = self._posted.get(tag)
            if q:
                for post in q:
                    if post.result is None:
                        break
                else:
                    post = None
            if ftype == EAGER:
                if not self._offered or nbytes > self._eager_size:
                    raise ProtocolError(
                        f"peer {self._peer} sent {nbytes} bytes eagerly on tag {tag}; eager buffers hold "
                        f"{self._eager_size if self._offered else 'nothing (none offered)'}"
                    )
                if post is None:
                    if not self._eager_free:
                        raise ProtocolError(f"peer {self._peer} sent on tag {tag} beyond its eager credits")
                    ebuf = self._eager_free.pop()
                else:
                    self._pending_credits[EAGER_TAG] += 1  # its eager buffer was not needed: back to the peer
        if post is None:
            if ebuf is None:
                raise ProtocolError(f"peer {self._peer} sent on tag {tag} without a credit")
        else:
            if nbytes > len(post.view):
                raise ProtocolError(
                    f"peer {self._peer} sent {nbytes} bytes on tag {tag}; the slot holds {len(post.view)}"
                )
            if ftype == EAGER:
                self._owe(urgent=True)
        expected = self._recv_steps[tag] + 1
        if step != expected:
            raise ProtocolError(f"tag {tag}: step {step} arrived, expected {expected} (lost or reordered message)")
        self._recv_steps[tag] = step
        if ndim == NO_SHAPE:
            shape = None
        elif ndim == HEADER_DIMS:
            shape = _DIMS.unpack_from(self._rbuf, pos + _DIMS_AT)
        elif ndim < HEADER_DIMS:
            shape = _DIMS.unpack_from(self._rbuf, pos + _DIMS_AT)[:ndim]
        else:
            raise ProtocolError(f"bad ndim {ndim} from {self._peer}")
        self._rpost = post
        self._reager = ebuf
        self._rmeta = (tag, step, nbytes, shape)
        if ftype == WRITTEN:
            # The sender wrote the bytes into this buffer itself: deliver them only if this side announced
            # exactly this buffer for this step (never a buffer, or a length, the peer chose).
            why = self.cma.landed(tag, step, post, nbytes) if self.cma is not None else "no cross-memory attach here"
            if why is not None:
                raise ProtocolError(f"peer {self._peer}: cross-memory message refused: {why}")
            self.bytes_received += nbytes
            self._complete_data()
            return True
        if self.cma is not None:
            self.cma.streamed(tag, step)
        if nbytes == 0:
            self._complete_data()
            return True
        self._rtarget = (post.view if post is not None else ebuf)[:nbytes]
        self._rphase = 1
        return False

    def _complete_data(self) -> None:
        post, meta = self._rpost, self._rmeta
        assert meta is not None
        tag, step, nbytes, shape = meta
        got = Received(nbytes, shape, step)
        self._rphase = 0
        self._roff = 0
        self._rtarget = None
        self._rpost = None
        self._rmeta = None
        if post is not None:
            with self._lock:
                post.result = got
            return
        ebuf, self._reager = self._reager, None
        assert ebuf is not None
        with self._lock:
            q = self._posted.get(tag)
            if q:
                for post in q:
                    if post.result is None:
                        break
                else:
                    post = None
            if post is None:
                self._stash.setdefault(tag, collections.deque()).append((ebuf, got))
                return
            if nbytes > len(post.view):  # posted while the payload came in: refused as on the header
                raise ProtocolError(
                    f"peer {self._peer} sent {nbytes} bytes on tag {tag}; the slot holds {len(post.view)}"
                )
            post.view[:nbytes] = ebuf[:nbytes]
            post.result = got
            self._eager_free.append(ebuf)
            self._pending_credits[EAGER_TAG] += 1
            if self.cma is not None:
                self.cma.streamed(tag, step)  # (an announcement made for the buffer is not used)
        self._owe(urgent=True)

    def _write(self, views: list[memoryview], deadline: float | None) -> None:
        """Write all views (gather) without ever blocking the peer's progress.

        First a non-blocking attempt (small frames finish here). If the socket is
        full, block in the kernel for at most one send slice at a time (cheap
        for one-way streams), and between slices read whatever the peer sent us
        when no other thread is reading, so two peers writing large frames at
        each other cannot deadlock. Once the peer is seen writing too, switch to
        poll()-driven interleaving of reads and writes for the rest of the frame.
        """
        sock = self._sock
        sent_any = False
        flushed = False
        flags = socket.MSG_DONTWAIT
        interleave = False
        while views:
            try:
                n = sock.sendmsg(views, (), flags)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError as exc:
                err = ClosedError("transport closed") if self._closed else self._translate(exc, "send")
                self._fail(err)
                raise err from exc
            if n:
                sent_any = True
                _advance(views, n)
                if not views:
                    return
                if interleave:
                    continue
            rem = _remaining(deadline)
            if rem is not None and rem <= 0:
                total = sum(len(v) for v in views)
                err = TransferTimeout(f"send to {self._peer} timed out with {total} bytes left")
                if sent_any:
                    # A half-written frame cannot be resumed by anyone else: the stream is broken.
                    self._fail(PeerLostError(f"send to {self._peer} stalled mid-frame past its timeout"))
                raise err
            if not flushed:
                # About to block: other links' credits must not wait on us. (Our
                # own cannot be written mid-frame; the peer reads while it waits.)
                flushed = True
                flush_pending_credits(exclude=self, held=True)
            with self._lock:
                self._check_usable()
                can_read = not self._reader_busy
                if can_read:
                    self._reader_busy = True
            if can_read:
                try:
                    events = self._poll_rw.poll(_poll_ms(deadline) if interleave else 0)
                    if any(ev & select.POLLIN for _, ev in events):
                        interleave = True  # the peer is writing to us as well
                        try:
                            while self._read_some(block=False):
                                pass
                        except BaseException as exc:  # noqa: BLE001
                            self._fail(exc)
                finally:
                    with self._cond:
                        self._reader_busy = False
                        if self._waiters:
                            self._cond.notify_all()
            elif interleave:
                self._poll_w.poll(_poll_ms(deadline))
            flags = socket.MSG_DONTWAIT if interleave else 0  # 0: block up to SEND_SLICE (SO_SNDTIMEO)


# -- connection set-up -----------------------------------------------------------


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
        ``None`` (the serve daemon): the nonce alone admits. See the module docstring."""
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
                rem = _remaining(deadline)
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
                rem = _remaining(deadline)
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
            sock.settimeout(_remaining(deadline))
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
            sock, peer=peer, peer_timeout=peer_timeout, cma=new_cma_peer(authenticated=linked, peer=peer)
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
