"""What an incoming frame does to a TCP connection: credits, posted receives, eager buffers, cross-memory.

The reader role (:mod:`.reader`) reads frames off the socket; each header it
reads is parsed here (:meth:`FrameParser._on_header`), which checks the frame
against what this side granted -- the magic, a credit or an eager buffer for
it, its step, its size against the posted buffer, a cross-memory frame only for
the buffer this side announced -- and says where its payload goes. When the
payload is in, :meth:`FrameParser._complete_data` hands it to the receive it
was for (or keeps it in its eager buffer until that receive is posted). A frame
that breaks any rule raises :class:`~tensorwire.errors.ProtocolError`, which
the reader records: the connection is then unusable, never delivering wrong bytes.
"""

from __future__ import annotations

import collections

from tensorwire.errors import PeerLostError, ProtocolError, TransportError
from tensorwire.transport.base import HEADER_DIMS, Received
from tensorwire.transport.tcp.credits import CreditBook
from tensorwire.transport.tcp.wire import (
    BYE,
    CMA,
    CMA_FRAME,
    CREDIT,
    DATA,
    DIMS,
    DIMS_AT,
    EAGER,
    EAGER_TAG,
    HEAD,
    MAGIC,
    NO_SHAPE,
    WRITTEN,
    Posted,
)

__all__ = ["FrameParser"]


class FrameParser(CreditBook):
    """The parsing of incoming frames (see the module docstring); every method runs in the reader role."""

    def _open_post(self, tag: int) -> "Posted | None":
        """(under ``_lock``) The oldest receive posted on ``tag`` that no message has filled yet, or None."""
        q = self._posted.get(tag)
        if q:
            for post in q:
                if post.result is None:
                    return post
        return None

    def _deliver_early(self, tag: int, post: "Posted", ebuf: memoryview, got: Received) -> None:
        """(under ``_lock``) A message that came before its buffer was posted, in eager buffer ``ebuf``: copy it
        into ``post`` (which it fits) and complete that receive.

        A message of no bytes copies nothing (the posted view may be a read-only empty one). A copy that fails
        nonetheless fails that receive alone (its wait raises): the message was read whole, so every other
        message of the connection is still where the protocol says, and the connection goes on.
        """
        n = got.nbytes
        if n:
            try:
                post.view[:n] = ebuf[:n]
            except Exception as exc:  # noqa: BLE001 - fails this receive only (see above)
                err = TransportError(
                    f"receive on tag {tag} from {self._peer}: the message of {n} bytes that came before its "
                    f"buffer was posted could not be copied into that buffer: {type(exc).__name__}: {exc}"
                )
                err.__cause__ = exc
                post.error = err
        post.result = got

    def _on_header(self, pos: int) -> bool:
        """Parse the header at ``pos`` of the read-ahead buffer. True if the frame is complete (no payload)."""
        magic, ftype, ndim, tag, step, nbytes, ctag, ccount = HEAD.unpack_from(self._rbuf, pos)
        if magic != MAGIC:
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
        ebuf = None
        with self._lock:
            if ccount:
                self._credits[ctag] += ccount
            post = self._open_post(tag)
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
            shape = DIMS.unpack_from(self._rbuf, pos + DIMS_AT)
        elif ndim < HEADER_DIMS:
            shape = DIMS.unpack_from(self._rbuf, pos + DIMS_AT)[:ndim]
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
        into = post.view if post is not None else ebuf
        assert into is not None  # (no post: an eager buffer was taken above, or it raised)
        self._rtarget = into[:nbytes]
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
            post = self._open_post(tag)
            if post is None:
                self._stash.setdefault(tag, collections.deque()).append((ebuf, got))
                return
            if nbytes > len(post.view):  # posted while the payload came in: refused as on the header
                raise ProtocolError(
                    f"peer {self._peer} sent {nbytes} bytes on tag {tag}; the slot holds {len(post.view)}"
                )
            self._deliver_early(tag, post, ebuf, got)
            self._eager_free.append(ebuf)
            self._pending_credits[EAGER_TAG] += 1
            if self.cma is not None:
                self.cma.streamed(tag, step)  # (an announcement made for the buffer is not used)
        self._owe(urgent=True)
