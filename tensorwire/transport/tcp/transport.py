"""The send side of a TCP data connection, and :class:`TcpTransport`, the whole of it.

On links between processes of one host, large messages skip the socket: the
sender writes them straight into the receiver's posted buffer (cross-memory
attach) and sends WRITTEN, a DATA header without payload. CMA frames carry the
probe that turns this on and the addresses of posted buffers (a 64-byte body
in place of ``dims``); see :mod:`tensorwire.transport.cma`. Only connections
that proved the link secret take part.

:meth:`TcpTransport.try_send` sends a frame only if that needs no waiting at
all (a credit is there and the socket takes the frame), for callers that must
never block.

Liveness: TCP keepalive and ``TCP_USER_TIMEOUT`` bounded by ``peer_timeout``,
so a cut network surfaces as :class:`~tensorwire.PeerLostError` rather than a hang.
"""

from __future__ import annotations

import select
import socket
import time
from typing import Any, ClassVar

from tensorwire.errors import ClosedError, PeerLostError, TensorWireError, TransferTimeout
from tensorwire.transport.base import remaining
from tensorwire.transport.cma import CmaPeer
from tensorwire.transport.tcp.credits import PENDING, PENDING_LOCK, URGENT, flush_pending_credits
from tensorwire.transport.tcp.reader import FrameReader
from tensorwire.transport.tcp.wire import (
    BYE,
    DATA,
    EAGER_TAG,
    FRAME,
    MAGIC,
    NO_SHAPE,
    WRITTEN,
    ZERO_DIMS,
    PartialSend,
    advance,
    host_view,
    poll_ms,
    shape_words,
)

__all__ = ["TcpTransport"]


class TcpTransport(FrameReader):
    """A framed, credit-flow-controlled TCP connection to one peer. See :mod:`tensorwire.transport.tcp`."""

    kind: ClassVar[str] = "tcp"
    reaches_cuda: ClassVar[bool] = False
    #: Largest cross-memory copy :meth:`try_send` makes in the caller's thread (larger ones: :meth:`send`).
    #: A copy of 1 MiB takes 80-100 us; one left to :meth:`send` is queued by the caller and a thread is woken
    #: for it, which cost more than that: a 1 MiB ``dist.send/recv`` round trip took 483 us with 256 KiB here,
    #: 385 us with 1 MiB (2-core VM, one run each).
    INLINE_COPY: ClassVar[int] = 1 << 20

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
        ``spin_us``: how long a blocking read first polls the socket without sleeping (``TENSORWIRE_TCP_SPIN_US``
        for links; 0: never)."""
        super().__init__(sock, peer=peer, peer_timeout=peer_timeout, cma=cma, spin_us=spin_us)
        if cma is not None:
            cma.start()
            self._owe(urgent=True)  # the probe's first frame goes out with the first flush or send

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
        payload = buf if type(buf) is memoryview else host_view(buf)
        ndim, dims = shape_words(shape)
        n = len(payload)
        have = self._credits
        cma = self.cma
        claim: tuple[int, int, list[Any], Any] | None = None
        slot = None
        held = self._send_lock.acquire(False)
        try:
            if held:
                # Fast path: a credit is there and nobody else is sending (one look under the lock, the claim).
                with self._lock:
                    if self._error is None and (have[tag] > 0 or (n <= self._peer_eager and have[EAGER_TAG] > 0)):
                        claim = self._claim(tag, n, step)
                if claim is None:
                    held = False
                    self._send_lock.release()
            if claim is None:

                def ready() -> bool:
                    return have[tag] > 0 or (n <= self._peer_eager and have[EAGER_TAG] > 0)

                while claim is None:
                    self._wait_for(ready, deadline, "credit to send on tag %d", tag)
                    rem = -1 if deadline is None else max(0.0, deadline - time.monotonic())
                    if not self._send_lock.acquire(timeout=rem):
                        raise TransferTimeout(f"send on tag {tag}: another send held the connection past the timeout")
                    held = True
                    with self._lock:
                        self._check_usable()
                        if ready():
                            claim = self._claim(tag, n, step)
                    if claim is None:  # another sender took the credit first: wait again
                        held = False
                        self._send_lock.release()
            ftype, wire_step, grants, ctrl = claim
            if cma is not None:
                slot = cma.slot_for(tag, wire_step)
            if slot is not None and ftype == DATA and n >= cma.min_bytes:  # type: ignore[union-attr]
                if grants or ctrl:  # hand them over before the copy, not after it
                    self._write([memoryview(self._control_frames(grants, ctrl))], deadline)
                    grants, ctrl = [], None
                if self._cma_write(payload, slot):
                    ftype = WRITTEN
            header = self._header(ftype, ndim, tag, wire_step, n, grants, ctrl, dims)
            self._write([memoryview(header), payload] if n and ftype != WRITTEN else [memoryview(header)], deadline)
            self.bytes_sent += n
        finally:
            if held:
                self._send_lock.release()
        if self in URGENT:
            # Receives posted while this frame was on the wire: their flush found the connection busy
            # and left the credits to us. Nobody else may try again before blocking on the peer.
            self._flush_credits()

    def send_two(
        self,
        first: tuple[int, Any, int | None],
        second: tuple[int, Any, int | None],
        *,
        timeout: float | None,
    ) -> None:
        """Two messages in one ``sendmsg`` where both credits are there and nobody else is sending (a reply and
        the payload right behind it: one system call and one wake-up of the reader instead of two); else two
        :meth:`send` calls. Not on a connection with cross-memory attach (its payloads may skip the socket)."""
        tag1, buf1, step1 = first
        tag2, buf2, step2 = second
        if self.cma is None and self._send_lock.acquire(False):
            try:
                p1 = buf1 if type(buf1) is memoryview else host_view(buf1)
                p2 = buf2 if type(buf2) is memoryview else host_view(buf2)
                have = self._credits
                c1 = c2 = None
                with self._lock:  # both DATA credits there: both claims succeed
                    if self._error is None and have[tag1] > 0 and have[tag2] > (1 if tag1 == tag2 else 0):
                        c1 = self._claim(tag1, len(p1), step1)
                        c2 = self._claim(tag2, len(p2), step2)
                if c1 is not None and c2 is not None:
                    views: list[memoryview] = []
                    for (ftype, wire_step, grants, ctrl), tag, p in ((c1, tag1, p1), (c2, tag2, p2)):
                        header = self._header(ftype, NO_SHAPE, tag, wire_step, len(p), grants, ctrl, ZERO_DIMS)
                        views.append(memoryview(header))
                        if len(p):
                            views.append(p)
                    self._write(views, None if timeout is None else time.monotonic() + timeout)
                    self.bytes_sent += len(p1) + len(p2)
                    sent = True
                else:
                    sent = False
            finally:
                self._send_lock.release()
            if sent:
                if self in URGENT:
                    self._flush_credits()  # as send(): credits left to this frame while it was on the wire
                return
        self.send(tag1, buf1, step=step1, timeout=timeout)
        self.send(tag2, buf2, step=step2, timeout=timeout)

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
            payload = buf if type(buf) is memoryview else host_view(buf)
            n = len(payload)
            cma = self.cma
            copy = cma is not None and cma.sending and n >= cma.min_bytes
            if copy and n > self.INLINE_COPY:
                return False  # a long cross-memory copy: that is send()'s, on the caller's sender thread
            ndim, dims = shape_words(shape)
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
            if copy and slot is not None and ftype == DATA and self._cma_write(payload, slot):
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
            advance(rest, sent)
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

    def close(self, *, linger: float = 0.25) -> None:
        """Say goodbye, send FIN after every byte sent, then wait up to ``linger`` s for the peer's FIN (reading
        and discarding what still comes) before freeing the socket. Idempotent."""
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
                self._sock.send(FRAME.pack(MAGIC, BYE, NO_SHAPE, 0, 0, 0, 0, 0, *ZERO_DIMS), socket.MSG_DONTWAIT)
                self._sock.shutdown(socket.SHUT_WR)  # FIN after the BYE
            except OSError:
                pass
            finally:
                self._send_lock.release()
        self._drain(linger)
        self._shutdown()

    def _drain(self, limit: float) -> None:
        """Discard input until the peer's FIN, ``limit`` s at most, before closing: closing with unread bytes --
        or receiving any after the close, such as the credit of a receive the peer posts a moment later --
        makes the kernel send RST, and an RST destroys frames the peer has not read yet."""
        scratch = bytearray(1 << 16)
        end = time.monotonic() + limit
        while True:
            try:
                if self._sock.recv_into(scratch, len(scratch), socket.MSG_DONTWAIT) == 0:
                    return  # the peer closed too: nothing left
                continue
            except (BlockingIOError, InterruptedError):
                pass  # nothing unread now: wait for more, or the FIN
            except OSError:
                return
            left = end - time.monotonic()
            if left <= 0:
                return
            try:
                select.select([self._sock], [], [], left)
            except (OSError, ValueError):
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
        with PENDING_LOCK:
            PENDING.discard(self)
            URGENT.discard(self)
        if self.cma is not None:
            self.cma.close()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _cma_write(self, payload: memoryview, slot: tuple[int, int]) -> bool:
        """Copy a message into the peer's announced buffer (see :meth:`CmaPeer.write`); a failure breaks
        the connection: the message's step is spent and its bytes may be half there."""
        assert self.cma is not None
        try:
            return self.cma.write(payload, slot)
        except TensorWireError as exc:
            self._fail(exc)
            raise

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
                if not sent_any and n == sum(map(len, views)):  # (the usual case: all out at the first try)
                    views.clear()
                    return
                sent_any = True
                advance(views, n)
                if not views:
                    return
                if interleave:
                    continue
            rem = remaining(deadline)
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
                    events = self._poll_rw.poll(poll_ms(deadline) if interleave else 0)
                    if any(ev & select.POLLIN for _, ev in events):
                        interleave = True  # the peer is writing to us as well
                        try:
                            while self._read_some(block=False):
                                pass
                        except BaseException as exc:  # noqa: BLE001
                            self._fail(exc)
                finally:
                    self._reader_done()
            elif interleave:
                self._poll_w.poll(poll_ms(deadline))
            flags = socket.MSG_DONTWAIT if interleave else 0  # 0: block up to SEND_SLICE (SO_SNDTIMEO)
