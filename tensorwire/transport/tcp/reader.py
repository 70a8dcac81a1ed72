"""The receive side of a TCP data connection: posted buffers and the reader role.

Progress model ("caller progresses"): there is no background thread per
connection. A thread waiting for a receive or a credit becomes the *reader*
(one at a time) and pumps frames off the socket into posted buffers; a thread
whose write would block also pumps reads when no one else does. This keeps the
small-message path free of thread hand-offs (see bench/ for the figures). The
reader reads up to ``READ_AHEAD`` bytes at a time, so a small frame (header and
payload) and the credits riding behind it take one system call; the payload
bytes past the read-ahead are received straight into the posted buffer. What a
frame does once its header is read is :mod:`.frames`' (the reader's base class).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from tensorwire.errors import ClosedError, ConfigError, PeerLostError, ProtocolError, TransferTimeout
from tensorwire.transport.base import Received, remaining
from tensorwire.transport.tcp.credits import PENDING, URGENT, flush_pending_credits
from tensorwire.transport.tcp.frames import FrameParser
from tensorwire.transport.contention import contended
from tensorwire.transport.tcp.wire import (
    BYE,
    EAGER_TAG,
    FRAME,
    READ_AHEAD,
    Posted,
    host_view,
)

_yield = getattr(os, "sched_yield", lambda: None)
#: seconds a spinning reader polls before it yields the core between polls
YIELD_AFTER = 20e-6
#: A wait for a receive of n bytes polls ``n * SPIN_PER_BYTE`` seconds longer than the link's spin (at most
#: ``SPIN_EXTRA_MAX``): about the time the bytes take to come (a cross-memory copy moves 1 MiB in 80-100 us), so
#: the reader is still polling when they land. Sleeping through that time instead costs a wake-up on both sides
#: (a 1 MiB ping-pong on a 2-core VM: the header's sendmsg took 23 us instead of 8, and the reader saw it 22 us
#: after it was sent instead of 2). Not past ``SPIN_EXTRA_BYTES``: a longer copy runs on several threads, which
#: need the cores (in one profile on a 2-core VM a 4 MiB copy in two pieces, its peer polling, ran no faster than
#: one piece would), and a wake-up is a small part of it. (4 MiB ping-pongs with and without this bound, in
#: turns, were within the VM's noise.)
SPIN_PER_BYTE = 2e-10
SPIN_EXTRA_MAX = 400e-6
SPIN_EXTRA_BYTES = 2 << 20
__all__ = ["FrameReader"]


class FrameReader(FrameParser):
    """Receives of a connection: buffers posted per tag, and the reader role that fills them (whichever
    thread waits first reads the socket for everyone)."""

    def post_recv(self, tag: int, buf: Any, *, header: bool = False) -> None:
        """Post ``buf`` (a flat uint8 tensor, or a byte memoryview) for the next message on ``tag``
        (:meth:`Transport.post_recv <tensorwire.transport.base.Transport.post_recv>`). A message that came
        before it, into an eager buffer, is copied into it here -- one of no bytes included.

        Raises:
            ConfigError: ``buf`` is read-only (and not empty), or a memoryview that was released; refused
                before anything changes (the connection and its other receives go on).
            ClosedError, PeerLostError, ProtocolError: the connection is unusable.
        """
        # Posted buffers are long-lived slots: cache their views (the cache holds the object, so its id stays unique).
        cached = self._views.get(id(buf))
        if cached is None or cached[0] is not buf:
            try:
                view = host_view(buf)
            except ValueError as exc:  # (a released memoryview)
                raise ConfigError(f"receive buffer on tag {tag} cannot be used: {exc}") from exc
            if view.readonly and len(view):
                # an empty read-only view (a receive of no bytes) is fine: nothing is ever written into it
                raise ConfigError(f"receive buffer on tag {tag} is read-only ({len(view)} bytes)")
            if len(self._views) >= self.VIEW_CACHE:
                self._views.clear()  # callers posting ever-new buffers (serve) must not grow this
            cached = (buf, view)
            self._views[id(buf)] = cached
        view = cached[1]
        try:
            size = len(view)  # (what can fail, fails before anything changes)
        except ValueError as exc:  # a cached memoryview its owner released since
            raise ConfigError(f"receive buffer on tag {tag} cannot be used: {exc}") from exc
        with self._lock:
            self._check_usable()
            post = Posted(view, header)
            cma = self.cma
            stash = self._stash.get(tag)
            if stash:  # the message this buffer is for came early, into an eager buffer: copy it here
                if cma is not None:
                    cma.on_post(tag, post, view[:0])  # counted, never announced: its message is here already
                ebuf, got = stash.popleft()
                if got.nbytes > size:
                    if self._error is None:  # the next wait on this connection raises it
                        self._error = ProtocolError(
                            f"peer {self._peer} sent {got.nbytes} bytes on tag {tag}; the slot holds {size}"
                        )
                    self._cond.notify_all()
                else:
                    self._deliver_early(tag, post, ebuf, got)
                    self._eager_free.append(ebuf)
                    self._pending_credits[EAGER_TAG] += 1
            elif cma is not None:
                cma.on_post(tag, post, view)
            self._posted[tag].append(post)
            # The credit rides on our next DATA frame, or is flushed before any
            # thread of this process blocks (see flush_pending_credits).
            self._pending_credits[tag] += 1
            # held back only where the peer needs no credit: the buffer fits one of our eager buffers, one of them
            # is free, and nothing is to go back (see URGENT)
            urgent = (
                not self._eager_free
                or size > self._eager_size
                or post.result is not None
                or (cma is not None and cma.has_frames)  # a SLOT goes ahead of its credit, at once
            )
        self._owe(urgent=urgent)
        if urgent and self._offered:
            # Eager offers made (torch.distributed's links, whose receives are posted only when the caller
            # asks): the peer cannot send this message without the credit (or the buffer's SLOT), and is
            # likely waiting for it. Out now, not when this side first waits (a 1 MiB dist.send/recv
            # ping-pong on a 2-core VM: the credit left 25 us earlier). Links and the serve daemon post
            # ahead of need: their credits ride on the next frame going the other way.
            self._flush_credits(wait=False)

    def wait_recv(self, tag: int, *, timeout: float | None) -> Received:
        q = self._posted[tag]  # (the deque of a tag is never replaced)
        if not q or q[0].result is None:  # not there yet: wait (fast path skips this)
            self._wait_for(
                lambda: bool(q) and q[0].result is not None,
                None if timeout is None else time.monotonic() + timeout,
                "receive on tag %d",
                tag,
                expect=len(q[0].view) if q else 0,
            )
        with self._lock:
            post = q.popleft()
        if post.error is not None:
            raise post.error
        return post.result  # type: ignore[return-value]

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

    # -- the reader role -----------------------------------------------------------------------------------
    def _wait_for(
        self, pred: Any, deadline: float | None, what: str, arg: int | None = None, *, expect: int = 0
    ) -> None:
        """Wait until ``pred()`` (evaluated under the lock) holds, reading the socket when no one else is.
        ``what % arg`` names the wait in a timeout. A deadline already past still reads what the socket
        holds, without waiting, once (a poll makes progress). ``expect``: bytes the wait is for (a longer
        poll before sleeping, see ``SPIN_PER_BYTE``)."""
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
                        self._pump(pred, deadline, expect)
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

    def _pump(self, pred: Any, deadline: float | None, expect: int = 0) -> None:
        """Reader role: read frames until pred() holds, the deadline passes, or an error."""
        spin = self._spin
        self._rspin = (
            spin + min(expect * SPIN_PER_BYTE, SPIN_EXTRA_MAX) if spin and expect <= SPIN_EXTRA_BYTES else spin
        )
        # with credits to hand back, look before blocking; past the deadline, only look
        block = not URGENT and (deadline is None or time.monotonic() < deadline)
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
                block = not URGENT and (deadline is None or time.monotonic() < deadline)
                continue
            if self._error is not None:
                return
            rem = remaining(deadline)
            if rem is not None and rem <= 0:
                return
            if not block:
                # About to block: first hand back every credit a peer may be waiting for.
                flush_pending_credits()
                with self._cond:
                    if pred() or self._error is not None:
                        return
                block = True
            elif PENDING:
                # A whole read slice without a byte: hand back the credits held back too (see URGENT).
                flush_pending_credits(held=True)

    def _recv(self, view: memoryview, n: int, block: bool) -> int:
        try:
            if block:
                spin = self._rspin
                now = time.perf_counter() if spin else 0.0
                if spin and not contended(now):  # poll first: a peer answering within it is seen without a wake-up
                    end = now + spin
                    polite = now + min(spin, YIELD_AFTER)
                    ready = self._poll_r.poll
                    while True:
                        # Ask poll() whether bytes are there before receiving. Polling with receives that find
                        # nothing made the compiled transport's 1 MiB round trip 1.17x slower than Python's (its
                        # loop turns faster); asking poll() made both faster than before (2-core VM,
                        # bench/results/native_cpu2_2026-11-27.md). poll() does not take the socket's lock.
                        if ready(0):
                            return self._sock.recv_into(view, n, socket.MSG_DONTWAIT)
                        now = time.perf_counter()
                        if now >= end:
                            break
                        if now >= polite:
                            # Past the first polls, give the core away between two: where the peer shares
                            # this core (two ranks on one of two cores), it answers only while we do not run.
                            _yield()
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
            self._reader_done()

    def _reader_done(self) -> None:
        """The thread that read the socket gives the reader role back and wakes whoever waits for it."""
        with self._cond:
            self._reader_busy = False
            if self._waiters:
                self._cond.notify_all()
