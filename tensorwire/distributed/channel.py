"""Point-to-point messages of ``backend="tensorwire"`` over one tensorwire link per pair of ranks.

Each pair of ranks in a group shares one spec-less :class:`tensorwire.Link`, whose
data connection (UCX or TCP, chosen as for any link) carries every message
between the two. A torch tag ``t`` is transport tag ``t + 1`` (tag 0 carries
notices, below); messages of one tag stay in order, messages of different tags
are independent, as torch specifies.

The send side of a pair is :mod:`.sending`, the receive side :mod:`.receiving`;
what both use is in :mod:`.messages`. :class:`Peer` holds the two, the link
and the notices of refused messages.

CUDA tensors follow NCCL's stream semantics (:mod:`.streams`): an ``isend``
goes out in the caller's thread when the caller's current stream is idle at the
call (and no stream will wait on a flag for it), else through the sender thread,
which first waits for an event recorded on that stream (the bytes are read only
after the work queued there before ``isend``); an ``irecv`` is posted once the caller's stream has reached
it (at once when that stream is idle; else by whoever drives the channel next);
``wait()`` queues a stream wait on the channel's flag and returns, and the
channel's completion thread finishes the receive and releases the flag -- also
on failure, so no stream waits forever.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import TYPE_CHECKING, Callable

import torch

from ..errors import ProtocolError, TensorWireError, TransferTimeout
from ..transport.tcp import TcpTransport
from .errors import GroupClosed, SignatureMismatch, translate
from .messages import (
    EAGER_MAX,
    EAGER_SLOTS,
    EMPTY,
    UCX_SEND_AHEAD,
    MAX_TAG,
    NOTICE,
    NOTICE_TAG,
    SlotPool,
    check_tag,
    host_bytes,
)
from . import copyengine
from .receiving import RecvChannel, RecvWork
from .sending import SendChannel, SendWork
from .signatures import Signature, decode, signature_of
from .streams import CudaOps
from .work import Completer

if TYPE_CHECKING:  # pragma: no cover
    from ..p2p.link import Link
    from ..transport.ce import CePair
    from .copyengine import CeWork
    from ..transport.base import Transport

__all__ = ["Peer", "SendWork", "RecvWork", "MAX_TAG", "SlotPool", "check_tag"]

log = logging.getLogger(__name__)

_NOTICE_SLOTS = 2
#: a group shut down waits this long at most for each peer's side of the close (so it reads what was sent)
LINGER_S = 5.0


class Peer:
    """Everything between this rank and one other rank of the group: the link, channels, notices."""

    def __init__(
        self,
        link: "Link",
        *,
        rank: int,
        group: str,
        timeout: float,
        pool: SlotPool,
        completer: Completer,
        ops: CudaOps | None = None,
        on_async_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.link = link
        self.ops = ops if ops is not None else CudaOps()
        self._on_async_error = on_async_error
        self.transport: "Transport" = link.connection
        #: the TCP transport (messages go out in the caller's thread when the socket takes them at once)
        self.tcp: TcpTransport | None = self.transport if isinstance(self.transport, TcpTransport) else None
        if self.tcp is not None:
            self.tcp.offer_eager(slots=EAGER_SLOTS, size=EAGER_MAX)
        elif hasattr(self.transport, "send_ahead"):
            # UCX: a message whose size and shape its tag admitted before goes without waiting for the
            # credit of a receive the peer posts only at its irecv (both ranks of a group set this)
            self.transport.send_ahead = UCX_SEND_AHEAD
        self.peer = link.peer
        self.rank = rank
        self.group = group
        self.timeout = timeout
        self.pool = pool
        self.completer = completer
        self.error: BaseException | None = None
        #: the copy-engine path to this peer (same host, both ranks able; set by :func:`.copyengine.setup`)
        self.ce: "CePair | None" = None
        #: what the copy-engine path's set-up probe found ("" where no pair was made: another host, or UCX chosen)
        self.ce_probe = ""
        self._lock = threading.Lock()
        self._send: dict[int, SendChannel] = {}
        self._recv: dict[int, RecvChannel] = {}
        self._notice_lock = threading.Lock()
        self._notices: collections.deque[torch.Tensor] = collections.deque()
        for _ in range(_NOTICE_SLOTS):
            buf = torch.zeros(NOTICE.size, dtype=torch.uint8)
            self.transport.post_recv(NOTICE_TAG, buf, header=True)
            self._notices.append(buf)

    def settle(self, timeout: float) -> None:
        """Wait until the peer's half of the set-up arrived (TCP: its eager offer), so that even the first
        message goes without waiting for a credit. Call once every peer of the group was made (each side
        offers as it makes its Peer, then waits: nobody waits on a Peer not made yet).

        Raises:
            TransferTimeout, PeerLostError: nothing within ``timeout``.
        """
        if self.tcp is not None:
            self.tcp.wait_eager_offer(timeout=timeout)

    # -- operations ------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, tag: int) -> "SendWork | CeWork":
        if self.ce is not None and tensor.is_cuda:
            return copyengine.isend(self, self.ce, tensor, tag)
        sig, hdr = signature_of(tensor)
        work = SendWork(self, sig, tag, [tensor])
        if self.error is not None:
            work._finish(self.error)
            return work
        chan = self._send.get(tag + 1)
        if chan is None:
            with self._lock:
                chan = self._send.get(tag + 1) or self._send.setdefault(tag + 1, SendChannel(self, tag + 1))
        chan.submit(work, tensor, sig, hdr)
        return work

    def irecv(self, tensor: torch.Tensor, tag: int) -> "RecvWork | CeWork":
        if self.ce is not None and tensor.is_cuda:
            return copyengine.irecv(self, self.ce, tensor, tag)
        sig, hdr = signature_of(tensor)
        chan = self._recv.get(tag + 1)
        if chan is None:
            with self._lock:
                chan = self._recv.get(tag + 1) or self._recv.setdefault(tag + 1, RecvChannel(self, tag + 1))
        if self.tcp is not None and tensor.is_contiguous() and not self.ops.streamed(tensor):
            # TCP, host memory: the sender's bytes land in the tensor itself
            work = RecvWork(self, chan, tensor, sig, hdr, None)
            if self.error is not None:
                work._finish(self.error)
                return work
            n = sig.nbytes
            try:
                chan.post_wire(work, host_bytes(tensor, n) if n else EMPTY, tensor)
            except BaseException as exc:  # noqa: BLE001
                work._finish(self.fail(exc, work._what))
            return work
        staging = None
        buf = tensor
        where = chan.where(tensor)
        if where == "pinned":
            staging = buf = self.pool.take(sig, "pinned")
        elif not tensor.is_contiguous():
            staging = buf = self.pool.take(sig, "same", tensor.device)
        work = RecvWork(self, chan, tensor, sig, hdr, staging)
        ready = None
        if self.ops.streamed(tensor):
            # The tensor may be written only after the work queued on the caller's stream before this call
            # (it may still read the tensor): posted once that stream reaches this event (None: idle now).
            ready = self.ops.mark(tensor)
            work._device_side = True
            work._ready = ready if staging is not None else None
            # Through a slot (TCP's pinned one, a non-contiguous tensor's), the bytes reach the tensor by a copy
            # that a thread of tensorwire's makes once they are in; queued while a stream waits on a flag, it
            # may never run (see SendChannel._submit): such a receive's wait() blocks the host instead.
            work._flag = chan.flag_for(tensor) if staging is None else None
        if self.error is not None:
            work._finish(self.error)
            return work
        try:
            chan.post(work, buf, after=ready if staging is None else None)
        except BaseException as exc:  # noqa: BLE001
            work._finish(self.fail(exc, work._what))
        return work

    # -- failures ----------------------------------------------------------------------
    def async_failure(self, exc: BaseException, what: str) -> None:
        """A work a stream waited for failed after its ``wait()`` returned: tell the group (its next call raises)."""
        if self._on_async_error is not None and not isinstance(exc, GroupClosed):
            self._on_async_error(translate(exc, what))

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def fail(
        self,
        exc: BaseException,
        context: str,
        *,
        tag: int | None = None,
        sig: Signature | None = None,
        work: RecvWork | None = None,
        graceful: bool = False,
    ) -> BaseException:
        """Record the pair's first fatal error, close the connection, fail every pending work; returns the error.

        ``graceful`` (a group shut down, not broken): leave the connection to :meth:`close`, which lets the
        peer read what was sent before it; otherwise it is aborted at once.
        """
        if isinstance(exc, ProtocolError) and not isinstance(exc, SignatureMismatch) and tag is not None:
            exc = self._mismatch_from(exc, tag, sig, work) or exc
        err = translate(exc, context) if context else exc
        with self._lock:
            if self.error is None:
                self.error = err
                first = True
            else:
                first = False
                err = self.error
        if first:
            if isinstance(err, SignatureMismatch) and sig is not None and tag is not None:
                self._send_notice(tag, sig)
            if not isinstance(err, GroupClosed):
                log.error("tensorwire.distributed: rank %d <-> rank %d failed: %s", self.rank, self.peer, err)
            if not graceful:
                self.transport.abort()
            for chan in list(self._recv.values()):
                while chan.fifo:
                    try:
                        chan.fifo.popleft()._finish(err)
                    except IndexError:
                        break
        return err

    def _mismatch_from(
        self, exc: ProtocolError, tag: int, sig: Signature | None, work: RecvWork | None
    ) -> SignatureMismatch | None:
        text = str(exc)
        if "do not fit" in text and sig is not None:  # UCX: refused on this (sending) side
            return SignatureMismatch(
                f"rank {self.rank} sends {sig.describe()} on tag {tag - 1}; rank {self.peer} "
                f"posted a receive of another size ({text}) (group {self.group!r})"
            )
        if f"bytes on tag {tag};" in text and work is not None:  # TCP: refused on this (receiving) side
            return SignatureMismatch(
                f"rank {self.peer} sent more bytes on tag {tag - 1} than rank {self.rank}'s "
                f"receive {work._sig.describe()} holds ({text}) (group {self.group!r})"
            )
        return None

    def _send_notice(self, tag: int, sig: Signature) -> None:
        """Best effort: tell the receiver a message of ``sig`` on ``tag`` was refused (so it raises too)."""
        try:
            buf = torch.frombuffer(bytearray(NOTICE.pack(tag)), dtype=torch.uint8)
            self.transport.send(NOTICE_TAG, buf, shape=sig.encode(), timeout=1.0)
        except Exception:  # noqa: BLE001 - the connection is going down anyway
            pass

    def read_notices(self) -> None:
        """Look (without waiting) for notices the peer sent; a refused message fails the pair here too."""
        if not self._notice_lock.acquire(blocking=False):
            return
        try:
            while self.error is None:
                try:
                    got = self.transport.wait_recv(NOTICE_TAG, timeout=0.0)
                except TransferTimeout:
                    return
                except TensorWireError:
                    return  # the data waits report it
                buf = self._notices.popleft()
                (tag,) = NOTICE.unpack(bytes(buf[: NOTICE.size].numpy()))
                theirs = decode(got.shape)
                chan = self._recv.get(tag)
                head = chan.fifo[0] if chan is not None and chan.fifo else None
                mine = head._sig.describe() if head is not None else "no receive posted"
                self.fail(
                    SignatureMismatch(
                        f"rank {self.peer} sent {theirs.describe()} on tag {tag - 1}; rank {self.rank} receives into "
                        f"{mine} (group {self.group!r})"
                    ),
                    "",
                )
        finally:
            self._notice_lock.release()

    def close(self, reason: BaseException, *, abort: bool = True) -> None:
        """Fail what is pending with ``reason`` and close the pair: aborted at once, or (``abort=False``, the
        group shut down) closed so that the peer still reads every message this side sent -- an abort sends a
        reset, and a reset destroys bytes the peer has not read yet."""
        if self.ce is not None:  # (a shutdown lets the CUDA messages already queued run first)
            self.ce.close(reason, linger=0.0 if abort else min(self.timeout, LINGER_S))
        self.fail(reason, "", graceful=not abort)
        for chan in list(self._send.values()):
            chan.close(self.error or reason)
        for rchan in list(self._recv.values()):
            rchan.close()
        if abort:
            self.link.close()
        else:
            self.link.close(linger=min(self.timeout, LINGER_S))
