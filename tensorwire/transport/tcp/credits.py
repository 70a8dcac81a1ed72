"""Credits and eager buffers of the TCP data plane: who may send what, and when grants go out.

Flow control reproduces UCX's rendezvous: the receiver grants one CREDIT per
posted buffer, and a sender spends one credit per DATA frame. So every DATA
frame that arrives has a free buffer waiting and the reader never blocks on
the application -- two peers can send large tensors at each other at once.

Eager messages (opt-in, :meth:`CreditBook.offer_eager`): a receiver may set
aside a few small buffers of its own and grant them to the peer on the pseudo
tag ``EAGER_TAG`` (the grant's ``nbytes`` says how large each is). A sender
with no credit on a tag then sends a message that fits such a buffer at once,
as an EAGER frame, instead of waiting a round trip for the credit: the receiver
reads it straight into the posted buffer when there is one (zero-copy), else
into a free eager buffer, copied into the buffer posted next on that tag. The
per-tag credit it went ahead of is still granted when that buffer is posted,
and the sender's balance for the tag (which went one below zero) comes back to
zero: one credit per posted buffer and one message per posted buffer, in order,
as before. With cross-memory attach a DATA frame of a large message is copied
into the buffer its credit came with; an EAGER frame never is (its bytes take
the byte stream, and the receiver forgets the buffer it announced for that
step), so eager buffers may be larger than the messages cross-memory attach
copies. An eager buffer goes back to the sender as an ``EAGER_TAG`` credit
once its bytes left it. A receiver that made no offer refuses EAGER frames.
Credits ride in the header of the next DATA frame going the other way; a
separate CREDIT frame is sent only when a thread of this process is about to
block (then every pending credit of every connection is flushed, so no cycle
of links can wait on each other), or, on a connection that offered eager
buffers, at the post of a receive the peer cannot send eagerly (it is likely
waiting for that credit; ``CreditBook._flush_credits(wait=False)``). A
separate frame would wake the peer's process once more per message, which
costs more than the syscall itself where the peer is not waiting.
"""

from __future__ import annotations

import abc
import mmap
import socket
import threading
import time
from typing import Any

from tensorwire.errors import PeerLostError, TensorWireError, TransferTimeout
from tensorwire.transport.tcp.connection import Connection
from tensorwire.transport.tcp.wire import (
    CMA,
    CMA_FRAME,
    CREDIT,
    DATA,
    EAGER,
    EAGER_TAG,
    FRAME,
    HEAD,
    MAGIC,
    NO_SHAPE,
    ZERO_DIMS,
)

__all__ = ["CreditBook", "flush_pending_credits", "PENDING", "URGENT", "PENDING_LOCK"]

# Transports holding credits not yet sent (PENDING), and those of them holding a credit a peer may be
# waiting for (URGENT). Before any thread blocks, every urgent one is flushed: a peer may be blocked on
# a credit we still hold, on this link or on another one that closes a cycle. A credit is *not* urgent
# when the peer needs no credit to send what fits its buffer: the buffer is no larger than the eager
# buffers this side offered and one of them is free (the peer sends such a message eagerly; the credit
# rides on our next DATA frame and only settles the peer's balance; eager buffers given back are always
# urgent). Such credits wait for a frame going the other way, or until
# a blocked reader saw nothing for a whole read slice (a peer sending a larger message than the buffer
# -- a mismatch the receiver reports -- waits for it that long).
PENDING: "set[CreditBook]" = set()
URGENT: "set[CreditBook]" = set()
PENDING_LOCK = threading.Lock()


def flush_pending_credits(exclude: "CreditBook | None" = None, *, held: bool = False) -> None:
    """Send the credits a peer may be waiting for (``held``: every credit) this process still holds back
    (called before blocking)."""
    which = PENDING if held else URGENT
    if not which:  # fast path, no lock: a stale answer only delays by one read slice
        return
    with PENDING_LOCK:
        todo = [t for t in which if t is not exclude]
    for t in todo:
        t._flush_credits()


class CreditBook(Connection):
    """The credit and eager-buffer bookkeeping of a connection: grants owed and sent, credits spent, frames
    undone. Every method here runs under the connection's lock or send lock, as each says."""

    def has_credit(self, tag: int) -> bool:
        return self._credits.get(tag, 0) > 0 and self._error is None

    def can_send(self, tag: int, nbytes: int) -> bool:
        """Whether a message of ``nbytes`` on ``tag`` could go now without waiting for a credit (never blocks)."""
        return self._error is None and (
            self._credits.get(tag, 0) > 0 or (nbytes <= self._peer_eager and self._credits.get(EAGER_TAG, 0) > 0)
        )

    def offer_eager(self, *, slots: int, size: int) -> None:
        """Let the peer send up to ``slots`` messages of at most ``size`` bytes before their receive is posted.

        Sets aside ``slots * size`` bytes once (anonymous memory: a slot becomes resident when it is first
        used) and grants them to the peer (see the :mod:`.credits` docstring); a no-op if already offered.
        Both ends of a connection may offer, independently. Call before traffic starts (it writes one frame).

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
                # Anonymous memory: zero pages until a slot is used (a group links every pair of ranks when it
                # is made; only the slots that carry messages become resident, reused last-in first-out).
                pool = memoryview(mmap.mmap(-1, slots * size))
                self._eager_free = [pool[i * size : (i + 1) * size] for i in range(slots)]
                self._eager_size = size
            grant = FRAME.pack(MAGIC, CREDIT, NO_SHAPE, 0, 0, size, EAGER_TAG, slots, *ZERO_DIMS)
            self._write([memoryview(grant)], time.monotonic() + self._peer_timeout)

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
        header = FRAME.pack(MAGIC, ftype, ndim, tag, step, n, ctag, cn, *dims)
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
                _, ftype, _, _, _, _, ctag, cn = HEAD.unpack_from(headers, off)
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
        return b"".join([FRAME.pack(MAGIC, CREDIT, NO_SHAPE, 0, 0, 0, t, c, *ZERO_DIMS) for t, c in grants])

    def _has_pending(self) -> bool:
        """Credits or cross-memory control frames wait to be sent."""
        return bool(self._pending_credits) or (self.cma is not None and self.cma.has_frames)

    def _control_frames(self, grants: list[tuple[int, int]], ctrl: list[Any] | None) -> bytes:
        """CMA frames first (a buffer's SLOT goes ahead of its credit), then CREDIT frames."""
        cma = b"".join(CMA_FRAME.pack(MAGIC, CMA, *f[:2], f[2], f[3], 0, 0, f[4]) for f in ctrl) if ctrl else b""
        return cma + (self._credit_frames(grants) if grants else b"")

    def _flush_credits(self, *, wait: bool = True) -> None:
        """Send pending credits (and CMA frames) now, unless a send is in progress (it carries them).

        ``wait`` False: only if the socket takes them at once (for a receive the peer cannot send eagerly: it
        waits for this credit, so it should not wait until this side blocks). If it takes nothing they stay
        pending (a wait or the next DATA frame sends them); a frame it took in part is finished here, since
        nothing else may follow part of a frame.
        """
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
                frames = self._control_frames(grants, ctrl)
                sent = 0
                if not wait:
                    try:
                        sent = self._sock.sendmsg([frames], (), socket.MSG_DONTWAIT)
                    except OSError:  # (full; or failing: a waiter's read or write reports it)
                        sent = 0
                    if sent == 0:
                        self._unframe_control(grants, ctrl)
                        return
                if sent < len(frames):
                    self._write([memoryview(frames)[sent:]], time.monotonic() + self._peer_timeout)
        except TransferTimeout as exc:
            self._fail(PeerLostError(f"could not grant credits to {self._peer}: {exc}"))
        except TensorWireError:
            pass  # recorded by _write; waiters will see it
        finally:
            self._send_lock.release()
            self._settled()

    def _unframe_control(self, grants: list[tuple[int, int]], ctrl: list[Any] | None) -> None:
        """Give back credits and CMA frames taken for a control frame of which no byte was written."""
        if ctrl:
            assert self.cma is not None
            self.cma.put_back(ctrl)
        with self._lock:
            for t, c in grants:
                self._pending_credits[t] += c
        self._owe(urgent=True)

    def _owe(self, *, urgent: bool) -> None:
        """(not under the lock) Pending credits were added: make sure a flush before blocking finds them."""
        with PENDING_LOCK:  # always: a check outside the lock could race _settled's discard
            PENDING.add(self)
            if urgent:
                URGENT.add(self)

    def _settled(self) -> None:
        """Pending credits were taken (may be under the lock): forget this transport if none are left."""
        if self in PENDING:
            with PENDING_LOCK:
                if not self._has_pending():
                    PENDING.discard(self)
                    URGENT.discard(self)

    @abc.abstractmethod
    def _write(self, views: list[memoryview], deadline: float | None) -> None:
        """Write all views (gather), reading what the peer sends meanwhile (the send side's)."""
