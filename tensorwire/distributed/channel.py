"""Point-to-point messages of ``backend="tensorwire"`` over one tensorwire link per pair of ranks.

Each pair of ranks in a group shares one spec-less :class:`tensorwire.Link`, whose
data connection (UCX or TCP, chosen as for any link) carries every message
between the two. A torch tag ``t`` is transport tag ``t + 1`` (tag 0 carries
notices, below); messages of one tag stay in order, messages of different tags
are independent, as torch specifies.

Receive (``irecv``): the caller's tensor itself is posted as the receive buffer
(when it is contiguous and the transport reaches its memory; otherwise a
preallocated slot of its signature, reused): the sender's bytes land in it
directly, no copy. Every message carries its sender's signature in its frame
header (:mod:`.signatures`); the receiver compares it with its tensor and
raises :class:`~.errors.SignatureMismatch` naming both sides on any difference
of dtype, shape, device or size. A message larger than the posted tensor is
refused before any byte moves (UCX: on the sender, which then sends a notice
on tag 0 so the receiver raises too; TCP: on the receiver, as the frame
header arrives). After a mismatch the pair's connection is closed: later
operations between the two ranks raise the same error (torch's rule for a
failed communicator) -- never wrong bytes, never a hang.

Send (``isend``): never waits. A host tensor is posted in the caller's thread
when that cannot block (UCX: the receiver's credit is already there; TCP:
:meth:`~tensorwire.transport.tcp.TcpTransport.try_send` -- a credit or an
eager buffer of the peer's is there and the socket takes the frame at once);
otherwise the message is queued, and the caller waiting on it or the tag's
sender thread sends it (messages of one tag keep their order either way). A
frame the socket took in part is finished the same way, before anything else.
CUDA tensors always go through the queue, whose sender first waits for an
event recorded on the caller's current stream: the bytes are read only after
the work queued there before ``isend``.

Small messages over TCP: every pair offers the other ``EAGER_SLOTS`` buffers
of ``EAGER_MAX`` bytes when the group is made (and waits for the other's
offer), so a small message goes before its receive is posted or its credit
has come back. A 4 KiB ping-pong is then one ``sendmsg`` and one ``recv`` per
message on each side, in the caller's thread, with no lock contended, no
Event and no thread woken (``bench/results/distributed_cpu2_2026-11-24-2.md``).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import struct
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from ..buffers import as_bytes
from ..errors import ConfigError, ProtocolError, TensorWireError, TransferTimeout
from .errors import GroupClosed, SignatureMismatch, WorkTimeout, translate
from .signatures import Signature, decode, signature_of
from ..transport.tcp import PartialSend, TcpTransport
from .work import Completer, Work

if TYPE_CHECKING:  # pragma: no cover
    from ..p2p.link import Link
    from ..transport.base import Received, Transport

__all__ = ["Peer", "SendWork", "RecvWork", "MAX_TAG"]

log = logging.getLogger(__name__)

NOTICE_TAG = 0
#: torch tags map to transport tags 1 .. 2**31 - 1
MAX_TAG = (1 << 31) - 2
#: TCP: each rank lets each peer send this many messages of at most EAGER_MAX bytes before their receive is
#: posted (one buffer of EAGER_SLOTS * EAGER_MAX bytes per peer, set aside when the group is made)
EAGER_SLOTS = 8
EAGER_MAX = 64 * 1024
#: how long a receive waits on its tag before looking at notices (a mismatch refused on the sender)
SLICE = 0.05
NOTICE = struct.Struct("<I")
_NOTICE_SLOTS = 2
#: flat byte views of host memory by (address, size), for transports that take bytes (TCP)
_VIEWS: dict[tuple[int, int], memoryview] = {}
_VIEWS_MAX = 4096
_EMPTY = memoryview(b"")


def _wire(t: "Transport", tensor: torch.Tensor) -> Any:
    """What the transport gets for a contiguous tensor: the tensor itself (any-dtype transports) or its bytes.

    The byte view is built from the address alone and reused by (address, size), as the UCX transport
    does for its descriptors: a loop's tensors come back at the same addresses, and making a flat uint8
    view through torch costs tens of microseconds per message. The view references no tensor (the cache
    keeps no memory alive); the work keeps the tensor alive while the transport uses it. Reusing the same
    view object also lets the TCP transport reuse its cached view of a posted buffer.
    """
    if t.any_dtype:
        return tensor
    n = tensor.nbytes
    if n == 0 or tensor.is_cuda:
        return as_bytes(tensor)
    return _host_bytes(tensor, n)


def _host_bytes(tensor: torch.Tensor, n: int) -> memoryview:
    """The ``n`` bytes of a contiguous host tensor (``n`` > 0), as a cached flat view (see :func:`_wire`)."""
    key = (tensor.data_ptr(), n)
    mv = _VIEWS.get(key)
    if mv is None:
        if len(_VIEWS) >= _VIEWS_MAX:
            _VIEWS.clear()
        mv = _VIEWS[key] = memoryview((ctypes.c_char * n).from_address(key[0])).cast("B")
    return mv


class SlotPool:
    """Preallocated tensors per (signature, where), taken for a message and given back after it.

    A signature's first message in flight allocates one; later messages reuse it
    (a second one exists only while two are in flight at once).
    """

    def __init__(self) -> None:
        self._free: dict[tuple[Signature, str], list[torch.Tensor]] = collections.defaultdict(list)
        self._lock = threading.Lock()

    def take(self, sig: Signature, where: str, device: torch.device | None = None) -> torch.Tensor:
        key = (sig, where)
        with self._lock:
            free = self._free[key]
            if free:
                return free.pop()
        dtype = getattr(torch, sig.dtype)
        if where == "pinned":
            return torch.empty(sig.shape, dtype=dtype, pin_memory=torch.cuda.is_available())
        return torch.empty(sig.shape, dtype=dtype, device=device)

    def give(self, sig: Signature, where: str, slot: torch.Tensor) -> None:
        with self._lock:
            self._free[(sig, where)].append(slot)


class SendWork(Work):
    """``isend``: done once the bytes are out of the tensor."""

    _op: Any = None  # UCX send posted in the caller's thread: complete it in wait()
    _keep: Any = None  # what UCX reads until the send completes
    _chan: "_SendChannel | None" = None  # queued: the channel whose queue holds it
    _staging: tuple[Signature, str, torch.Tensor] | None = None  # slot to give back when done

    def __init__(self, peer: "Peer", sig: Signature, tag: int, tensors: list[torch.Tensor]) -> None:
        super().__init__(peer.timeout, tensors)
        self._peer = peer
        self._sig = sig
        self._tag = tag
        self._completer = peer.completer

    def _describe(self) -> str:
        return f"isend of {self._sig.describe()} to rank {self._peer.peer} (tag {self._tag})"

    def _finish(self, exc: BaseException | None = None) -> None:
        staging = self._staging
        if staging is not None:
            self._staging = None
            self._peer.pool.give(*staging)
        if self._keep is not None:
            self._keep = None
        super()._finish(exc)

    def _drive(self, deadline: float) -> None:
        op = self._op
        if op is None:
            if self._chan is not None and deadline - time.monotonic() >= self._peer.timeout * 0.99:
                # A wait as long as the group's timeout sends queued messages itself; a shorter
                # wait(timeout) only waits (its timeout must not cut a send short: over TCP that
                # would break the connection once the first byte is out).
                self._chan.help(self, deadline)
            return super()._drive(deadline)
        try:
            self._peer.transport.wait_send(op, timeout=max(0.0, deadline - time.monotonic()))
        except TransferTimeout:
            if self._op is op and not self.done:
                raise WorkTimeout(f"{self._what} not complete within {self._wait_seconds:.3g} s") from None
        except BaseException as exc:  # noqa: BLE001
            self._finish(self._peer.fail(exc, f"{self._what}"))
            return
        self._finish()

    def _poll(self) -> None:
        if self._op is not None and self._op.done():
            self._drive(time.monotonic())


class RecvWork(Work):
    """``irecv``: done once the message is in the tensor (checked against the sender's signature)."""

    def __init__(
        self,
        peer: "Peer",
        chan: "_RecvChannel",
        tensor: torch.Tensor,
        sig: Signature,
        hdr: tuple[int, ...],
        staging: torch.Tensor | None,
    ) -> None:
        super().__init__(peer.timeout, [tensor])
        self._peer = peer
        self._chan = chan
        self._tensor = tensor
        self._sig = sig
        self._hdr = hdr
        self._staging = staging
        self._source = peer.peer
        self._completer = peer.completer

    def _describe(self) -> str:
        return f"irecv of {self._sig.describe()} from rank {self._peer.peer} (tag {self._chan.tag - 1})"

    def _drive(self, deadline: float) -> None:
        self._chan.drive(self, deadline)

    def _poll(self) -> None:
        self._chan.drive(self, None)

    def _complete(self, got: "Received") -> None:
        mine = self._sig
        if got.shape == self._hdr and got.nbytes == mine.nbytes:  # the signature this side expects
            if self._staging is not None:
                self._tensor.copy_(self._staging)  # host->device (pinned) or into a non-contiguous tensor
                self._release()
            self._finish()
            return
        theirs = decode(got.shape)
        if not theirs.fills(mine) or got.nbytes != mine.nbytes:
            exc = SignatureMismatch(
                f"rank {self._peer.peer} sent {theirs.describe()} on tag {self._chan.tag - 1}; "
                f"rank {self._peer.rank} receives into {mine.describe()} (group {self._peer.group!r})"
            )
            self._release()
            self._finish(self._peer.fail(exc, ""))
            return
        if self._staging is not None:
            self._tensor.copy_(self._staging)  # host->device (pinned) or into a non-contiguous tensor
            self._release()
        self._finish()

    def _release(self) -> None:
        if self._staging is not None:
            self._peer.pool.give(self._sig, self._chan.where(self._tensor), self._staging)
            self._staging = None

    def _finish(self, exc: BaseException | None = None) -> None:
        if exc is not None:
            self._release()
        super()._finish(exc)


class _RecvChannel:
    """Receives of one tag from one peer, completed in the order they were posted."""

    def __init__(self, peer: "Peer", tag: int) -> None:
        self.peer = peer
        self.tag = tag
        self.fifo: collections.deque[RecvWork] = collections.deque()
        self.post_lock = threading.Lock()
        self.drive_lock = threading.Lock()

    def where(self, tensor: torch.Tensor) -> str:
        return "pinned" if tensor.is_cuda and not self.peer.transport.reaches_cuda else "same"

    def post(self, work: RecvWork, wire: Any) -> None:
        """Post ``wire`` (the receive buffer as the transport takes it: :func:`_wire`) for ``work``."""
        peer = self.peer
        with self.post_lock:
            if peer.error is not None:
                raise peer.error
            peer.transport.post_recv(self.tag, wire, header=True)
            self.fifo.append(work)

    def drive(self, work: RecvWork, deadline: float | None) -> None:
        """Complete posted receives in order until ``work`` is done (``deadline`` None: without waiting)."""
        lock = self.drive_lock
        if not lock.acquire(False):
            if deadline is None:
                return
            if not lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise WorkTimeout(f"{work._what} not complete within {work._wait_seconds:.3g} s")
        try:
            while not work._is_done:
                got = self._wait_one(work, deadline)
                if got is None:
                    return  # nothing yet (non-blocking)
                head = self.fifo.popleft()
                head._complete(got)
        finally:
            self.drive_lock.release()

    def _wait_one(self, work: RecvWork, deadline: float | None) -> "Received | None":
        t = self.peer.transport
        while True:
            try:
                if deadline is None:
                    return t.wait_recv(self.tag, timeout=0.0)
                return t.wait_recv(self.tag, timeout=max(0.0, min(SLICE, deadline - time.monotonic())))
            except TransferTimeout:
                self.peer.read_notices()
                if deadline is None:
                    return None
                if time.monotonic() >= deadline:
                    raise WorkTimeout(f"{work._what} not complete within {work._wait_seconds:.3g} s") from None
            except BaseException as exc:  # noqa: BLE001
                raise self.peer.fail(exc, f"{work._what}", tag=self.tag, work=work) from None


class _SendChannel:
    """Sends of one tag to one peer, in order.

    A message goes out in the caller's thread when that cannot block; otherwise
    it is queued. Whoever gets there first sends the queued messages, oldest
    first: the caller when it waits on one of them (``dist.send`` is ``isend``
    + ``wait``: no thread hand-off), or the tag's sender thread, which takes a
    queued message once it has stayed at the head of the queue for ``DEFER``
    seconds (so an ``isend`` nobody waits on still goes out). The thread is
    woken only when it is parked (nothing queued): it never polls, and it never
    contends for ``send_lock`` with a caller that is sending.
    """

    DEFER = 0.0005

    def __init__(self, peer: "Peer", tag: int) -> None:
        self.peer = peer
        self.tag = tag
        self.cond = threading.Condition()
        self.pending: collections.deque[tuple[Any, ...]] = collections.deque()
        self.send_lock = threading.Lock()  # held by whoever is sending a message of this tag
        self.thread: threading.Thread | None = None
        self.parked = False  # the thread sleeps until notified (nothing was queued)
        self.closed = False

    def submit(self, work: SendWork, tensor: torch.Tensor, sig: Signature, hdr: tuple[int, ...]) -> None:
        tcp = self.peer.tcp
        if tcp is not None and not self.pending and not tensor.is_cuda and tensor.is_contiguous():
            # TCP, host memory, nothing queued before it: out in this thread if the socket takes it at once
            if self.send_lock.acquire(False):
                try:
                    if not self.pending:
                        n = sig.nbytes
                        try:
                            sent = tcp.try_send(self.tag, _host_bytes(tensor, n) if n else _EMPTY, shape=hdr)
                        except BaseException as exc:  # noqa: BLE001
                            work._finish(self.peer.fail(exc, work._what, tag=self.tag, sig=sig))
                            return
                        if sent is True:
                            work._finish()
                            return
                        if sent is not False:  # the socket took part of it: the rest before anything else
                            self._queue_partial(work, tensor, sig, hdr, sent)
                            return
                finally:
                    self.send_lock.release()
        self._submit(work, tensor, sig, hdr)

    def _submit(self, work: SendWork, tensor: torch.Tensor, sig: Signature, hdr: tuple[int, ...]) -> None:
        """Everything but the TCP fast path: out in this thread when that cannot block, else queued."""
        peer = self.peer
        t = peer.transport
        if tensor.requires_grad:
            tensor = tensor.detach()
        if not tensor.is_cuda and not tensor.is_contiguous():
            slot = peer.pool.take(sig, "same")
            slot.copy_(tensor)
            work._staging = (sig, "same", slot)
            tensor = slot
        if not tensor.is_cuda and not self.pending and self.send_lock.acquire(blocking=False):
            try:
                if not self.pending:
                    data = _wire(t, tensor)
                    try:
                        if peer.tcp is not None:  # (a non-contiguous tensor, copied into its slot)
                            sent = peer.tcp.try_send(self.tag, data, shape=hdr)
                            if sent is True:
                                work._finish()
                                return
                            if sent is not False:
                                self._queue_partial(work, tensor, sig, hdr, sent)
                                return
                        elif t.async_send:
                            work._keep = tensor
                            work._op = t.start_send(self.tag, data, shape=hdr, timeout=0.0)
                            return
                    except TransferTimeout:
                        pass  # no credit yet: queued
                    except BaseException as exc:  # noqa: BLE001
                        work._finish(peer.fail(exc, work._what, tag=self.tag, sig=sig))
                        return
            finally:
                self.send_lock.release()
        ev = None
        if tensor.is_cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(tensor.device))
        work._chan = self
        with self.cond:
            self.pending.append((work, tensor, sig, hdr, ev, None))
            self._wake()

    def _queue_partial(
        self, work: SendWork, tensor: torch.Tensor, sig: Signature, hdr: tuple[int, ...], partial: PartialSend
    ) -> None:
        """(caller holds ``send_lock``; nothing queued) A frame the socket took only part of: its rest is written
        first, by whoever sends next on this channel -- the caller waiting on it, or the sender thread."""
        work._chan = self
        with self.cond:
            self.pending.appendleft((work, tensor, sig, hdr, None, partial))
            self._wake()

    def _wake(self) -> None:
        """(under ``cond``) Start the sender thread, or wake it if it sleeps with nothing queued."""
        if self.thread is None:
            self.thread = threading.Thread(
                target=self._run, daemon=True, name=f"tw-dist-send-{self.peer.peer}-{self.tag - 1}"
            )
            self.thread.start()
        elif self.parked:
            self.cond.notify()

    def help(self, work: SendWork, deadline: float) -> None:
        """(caller waiting on ``work``) Send queued messages up to and including ``work``'s."""
        while not work.done:
            if not self.send_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return  # the thread is sending (ours or an older one): the caller waits for the event
            try:
                if work.done:
                    return
                with self.cond:
                    item = self.pending.popleft() if self.pending else None
                if item is None:
                    return
                self._send(item)
            finally:
                self.send_lock.release()
            if time.monotonic() >= deadline:
                return

    def _send(self, item: tuple[Any, ...]) -> None:
        """Send one queued message (caller holds ``send_lock``)."""
        peer = self.peer
        t = peer.transport
        work, tensor, sig, hdr, ev, partial = item
        exc: BaseException | None = None
        try:
            if partial is not None:  # the connection's send lock is ours until the rest of this frame is out
                try:
                    assert peer.tcp is not None  # only TCP sends part of a frame
                    peer.tcp.finish_send(partial, timeout=peer.timeout)
                except BaseException as exc_:  # noqa: BLE001 - a cut frame: the pair is broken
                    exc = peer.fail(exc_, work._what, tag=self.tag, sig=sig)
                work._finish(exc)
                return
            peer.check()
            if ev is not None:
                ev.synchronize()
                if not t.reaches_cuda:  # through a pinned host slot (TCP)
                    slot = peer.pool.take(sig, "pinned")
                    work._staging = (sig, "pinned", slot)
                    slot.copy_(tensor)
                    tensor = slot
                elif not tensor.is_contiguous():
                    slot = peer.pool.take(sig, "same", tensor.device)
                    work._staging = (sig, "same", slot)
                    slot.copy_(tensor)
                    torch.cuda.current_stream(tensor.device).synchronize()
                    tensor = slot
            t.send(self.tag, _wire(t, tensor), shape=hdr, timeout=peer.timeout)
        except TransferTimeout as exc_:  # no credit within the group's timeout: nothing sent, the pair lives on
            exc = translate(exc_, work._what)
        except BaseException as exc_:  # noqa: BLE001
            exc = peer.fail(exc_, work._what, tag=self.tag, sig=sig)
        work._finish(exc)

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.pending and not self.closed:
                    self.parked = True
                    self.cond.wait()
                    self.parked = False
                if self.closed:
                    return
                head = self.pending[0]
                # A caller waiting on it sends it itself, without a hand-off: give it DEFER to do so.
                self.cond.wait(self.DEFER)
                if self.closed:
                    return
                if not self.pending or self.pending[0] is not head:
                    continue  # taken (by a caller): look at what is queued now
            with self.send_lock:
                with self.cond:
                    item = self.pending.popleft() if self.pending else None
                if item is not None:
                    self._send(item)

    def close(self, reason: BaseException) -> None:
        with self.cond:
            self.closed = True
            pending, self.pending = list(self.pending), collections.deque()
            self.cond.notify_all()
            thread = self.thread
        for item in pending:
            item[0]._finish(reason)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)


class Peer:
    """Everything between this rank and one other rank of the group: the link, channels, notices."""

    def __init__(
        self, link: "Link", *, rank: int, group: str, timeout: float, pool: SlotPool, completer: Completer
    ) -> None:
        self.link = link
        self.transport: "Transport" = link.connection
        #: the TCP transport (messages go out in the caller's thread when the socket takes them at once)
        self.tcp: TcpTransport | None = self.transport if isinstance(self.transport, TcpTransport) else None
        if self.tcp is not None:  # both ends offer, then wait for the other's offer (no first message waits)
            self.tcp.offer_eager(slots=EAGER_SLOTS, size=EAGER_MAX)
            self.tcp.wait_eager_offer(timeout=timeout)
        self.peer = link.peer
        self.rank = rank
        self.group = group
        self.timeout = timeout
        self.pool = pool
        self.completer = completer
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._send: dict[int, _SendChannel] = {}
        self._recv: dict[int, _RecvChannel] = {}
        self._notice_lock = threading.Lock()
        self._notices: collections.deque[torch.Tensor] = collections.deque()
        for _ in range(_NOTICE_SLOTS):
            buf = torch.zeros(NOTICE.size, dtype=torch.uint8)
            self.transport.post_recv(NOTICE_TAG, buf, header=True)
            self._notices.append(buf)

    # -- operations ------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, tag: int) -> SendWork:
        sig, hdr = signature_of(tensor)
        work = SendWork(self, sig, tag, [tensor])
        if self.error is not None:
            work._finish(self.error)
            return work
        chan = self._send.get(tag + 1)
        if chan is None:
            with self._lock:
                chan = self._send.get(tag + 1) or self._send.setdefault(tag + 1, _SendChannel(self, tag + 1))
        chan.submit(work, tensor, sig, hdr)
        return work

    def irecv(self, tensor: torch.Tensor, tag: int) -> RecvWork:
        sig, hdr = signature_of(tensor)
        chan = self._recv.get(tag + 1)
        if chan is None:
            with self._lock:
                chan = self._recv.get(tag + 1) or self._recv.setdefault(tag + 1, _RecvChannel(self, tag + 1))
        t = self.transport
        staging = None
        if self.tcp is not None and not tensor.is_cuda and tensor.is_contiguous():
            # TCP, host memory: the sender's bytes land in the tensor itself
            n = sig.nbytes
            wire: Any = _host_bytes(tensor, n) if n else _EMPTY
        else:
            buf = tensor
            where = chan.where(tensor)
            if where == "pinned":
                staging = buf = self.pool.take(sig, "pinned")
            elif not tensor.is_contiguous():
                staging = buf = self.pool.take(sig, "same", tensor.device)
            if tensor.is_cuda:
                # The buffer may be written as soon as it is posted: work queued on it must be done.
                torch.cuda.current_stream(tensor.device).synchronize()
            wire = _wire(t, buf)
        work = RecvWork(self, chan, tensor, sig, hdr, staging)
        if self.error is not None:
            work._finish(self.error)
            return work
        try:
            chan.post(work, wire)
        except BaseException as exc:  # noqa: BLE001
            work._finish(self.fail(exc, work._what))
        return work

    # -- failures ----------------------------------------------------------------------
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
    ) -> BaseException:
        """Record the pair's first fatal error, close the connection, fail every pending work; returns the error."""
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

    def close(self, reason: BaseException) -> None:
        self.fail(reason, "")
        for chan in list(self._send.values()):
            chan.close(self.error or reason)
        self.link.close()


def check_tag(tag: int) -> int:
    if not isinstance(tag, int) or not 0 <= tag <= MAX_TAG:
        raise ConfigError(f"backend 'tensorwire' takes tags in [0, {MAX_TAG}], got {tag!r}")
    return tag
