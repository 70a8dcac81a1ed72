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

Small messages over TCP: every pair offers the other ``EAGER_SLOTS`` buffers
of ``EAGER_MAX`` bytes when the group is made (and waits for the other's
offer), so a small message goes before its receive is posted or its credit
has come back. A 4 KiB ping-pong is then one ``sendmsg`` and one ``recv`` per
message on each side, in the caller's thread, with no lock contended, no
Event and no thread woken (``bench/results/distributed_cpu2_2026-11-24-2.md``).

CUDA tensors follow NCCL's stream semantics (:mod:`.streams`): an ``isend``
goes through the sender thread, which first waits for an event recorded on the
caller's current stream (the bytes are read only after the work queued there
before ``isend``); an ``irecv`` is posted once the caller's stream has reached
it (at once when that stream is idle; else by whoever drives the channel next);
``wait()`` queues a stream wait on the channel's flag and returns, and the
channel's completion thread finishes the receive and releases the flag -- also
on failure, so no stream waits forever.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import struct
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..buffers import as_bytes
from ..errors import ConfigError, ProtocolError, TensorWireError, TransferTimeout
from .errors import GroupClosed, SignatureMismatch, WorkTimeout, translate
from .signatures import Signature, decode, signature_of
from ..transport.tcp import PartialSend, TcpTransport
from .streams import CudaOps, Flag
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
#: posted (one buffer of EAGER_SLOTS * EAGER_MAX bytes per peer, set aside when the group is made; the
#: transport keeps eager messages below the size it copies across processes, TENSORWIRE_CMA_MIN_BYTES)
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
    _flag: Flag | None = None  # CUDA: the channel's flag, released with ``_seq`` when done
    _seq = 0

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

    def _finished(self, exc: BaseException | None, streamed: bool) -> None:
        flag = self._flag
        if flag is not None:
            if exc is not None and streamed:
                self._peer.async_failure(exc, self._what)
            flag.release(self._seq)

    def _stream_wait(self) -> bool:
        flag, chan = self._flag, self._chan
        if flag is None or chan is None or not self._peer.ops.order_after(flag, self._seq, self._tensors[0]):
            return False
        if self._mark_streamed():
            chan.kick()  # nobody will help it out: the sender thread sends it now
        return True

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

    _device_side = False  # CUDA tensor (stream semantics)
    _ready: Any = None  # staged CUDA receive: the caller's stream reached irecv (copy into the tensor after it)
    _flag: Flag | None = None  # CUDA: the channel's flag, released with ``_seq`` once the bytes are in the tensor
    _seq: int | None = None

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
        self._hdr = hdr  # the header words of ``sig``: a message with the same words fits
        self._staging = staging
        self._posted = False  # its buffer is posted to the transport
        self._source = peer.peer
        self._completer = peer.completer

    def _describe(self) -> str:
        return f"irecv of {self._sig.describe()} from rank {self._peer.peer} (tag {self._chan.tag - 1})"

    def _drive(self, deadline: float) -> None:
        self._chan.drive(self, deadline)

    def _poll(self) -> None:
        self._chan.drive(self, None)

    def _stream_wait(self) -> bool:
        flag, seq = self._flag, self._seq
        if flag is None or seq is None or not self._peer.ops.order_after(flag, seq, self._tensor):
            return False
        if self._mark_streamed():
            self._chan.serve(self)
        return True

    def _complete(self, got: "Received") -> None:
        mine = self._sig
        if got.shape != self._hdr or got.nbytes != mine.nbytes:  # (the same words: the signature this side expects)
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
            if self._device_side:
                # host->device (pinned) or into a non-contiguous tensor: on tensorwire's copy stream, once the
                # caller's stream has reached the irecv (earlier work may still read the tensor)
                ops = self._peer.ops
                ready, self._ready = self._ready, None
                try:
                    if not ops.wait_reached(ready, time.monotonic() + self._peer.timeout):
                        raise WorkTimeout(
                            f"{self._what}: the caller's CUDA stream did not reach the irecv within "
                            f"{self._peer.timeout:.3g} s"
                        )
                    ops.copy(self._tensor, self._staging)
                except BaseException as exc:  # noqa: BLE001
                    self._release()
                    self._finish(self._peer.fail(exc, self._what))
                    return
                finally:
                    ops.recycle(ready)
            else:
                self._tensor.copy_(self._staging)  # into a non-contiguous host tensor
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

    def _finished(self, exc: BaseException | None, streamed: bool) -> None:
        flag, seq = self._flag, self._seq
        if flag is not None and seq is not None:
            if exc is not None and streamed:
                self._peer.async_failure(exc, self._what)
            flag.release(seq)


class _RecvChannel:
    """Receives of one tag from one peer, completed in the order they were posted.

    ``fifo`` holds every incomplete receive in order; a CUDA receive whose caller's
    stream had not reached it at ``irecv`` waits in ``unposted`` (in order: a later
    one never overtakes it) until someone driving the channel sees the stream
    reach it and posts it. Receives a stream waits for (``wait()`` of a CUDA
    receive) are completed by the channel's thread, started on the first one.
    """

    def __init__(self, peer: "Peer", tag: int) -> None:
        self.peer = peer
        self.tag = tag
        self.fifo: collections.deque[RecvWork] = collections.deque()
        self.unposted: collections.deque[tuple[RecvWork, torch.Tensor, Any]] = collections.deque()
        self.post_lock = threading.Lock()
        self.drive_lock = threading.Lock()
        self.flag: Flag | None = None
        self.cond = threading.Condition()
        self.served: collections.deque[RecvWork] = collections.deque()
        self.thread: threading.Thread | None = None
        self.closed = False

    def where(self, tensor: torch.Tensor) -> str:
        return "pinned" if self.peer.ops.streamed(tensor) and not self.peer.transport.reaches_cuda else "same"

    def flag_for(self, tensor: torch.Tensor) -> Flag | None:
        """The channel's flag (taken on its first CUDA receive), or None where streams cannot wait on one."""
        ops = self.peer.ops
        if not ops.usable(tensor.device):
            return None
        flag = self.flag
        if flag is None:
            with self.post_lock:
                flag = self.flag
                if flag is None:
                    flag = self.flag = ops.new_flag(tensor.device)
        return flag

    def post(self, work: RecvWork, buf: torch.Tensor, *, after: Any = None) -> None:
        """Post ``buf`` for ``work`` now, or once the caller's stream reached event ``after``."""
        t = self.peer.transport
        with self.post_lock:
            self.peer.check()
            if work._flag is not None:
                work._seq = work._flag.issue()
            if after is None and not self.unposted:
                t.post_recv(self.tag, _wire(t, buf), header=True)
                work._posted = True
                self.fifo.append(work)
            else:
                self.fifo.append(work)
                self.unposted.append((work, buf, after))

    def post_wire(self, work: RecvWork, wire: Any, buf: torch.Tensor) -> None:
        """Post a host receive (no stream to wait for) whose transport view is ``wire`` (:func:`_wire` of ``buf``)."""
        peer = self.peer
        with self.post_lock:
            if peer.error is not None:
                raise peer.error
            if self.unposted:  # behind a CUDA receive whose stream has not reached it: after that one
                self.fifo.append(work)
                self.unposted.append((work, buf, None))
                return
            peer.transport.post_recv(self.tag, wire, header=True)
            work._posted = True
            self.fifo.append(work)

    def flush(self, deadline: float | None) -> bool:
        """Post the deferred receives whose stream reached them, oldest first; True when none is left.

        ``deadline`` None: only those ready now; else wait for each (this thread) until ``deadline``.
        """
        ops = self.peer.ops
        t = self.peer.transport
        while True:
            with self.post_lock:
                if not self.unposted:
                    return True
                work, buf, ev = self.unposted[0]
                if work.done or ops.reached(ev):
                    self.unposted.popleft()
                    ops.recycle(ev)
                    if work.done:
                        continue
                    try:
                        self.peer.check()
                        t.post_recv(self.tag, _wire(t, buf), header=True)
                    except BaseException as exc:  # noqa: BLE001
                        raise self.peer.fail(exc, work._what) from None
                    work._posted = True
                    continue
            if deadline is None or not ops.wait_reached(ev, deadline):
                return False

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
                try:
                    head = self.fifo[0]
                except IndexError:
                    return  # completed (or failed) by another thread just now
                if head.done:  # failed while still queued: nothing of it is posted any more
                    try:
                        self.fifo.remove(head)
                    except ValueError:
                        pass
                    continue
                if not head._posted:
                    # Nothing of it is posted yet: its caller's stream has to reach its irecv first.
                    if not self.flush(deadline):
                        if deadline is None:
                            return
                        raise WorkTimeout(
                            f"{work._what} not complete within {work._wait_seconds:.3g} s (the CUDA stream of "
                            f"an irecv did not reach it)"
                        )
                    continue
                if self.unposted:
                    self.flush(None)
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

    # -- the completion thread (receives a stream waits for) ------------------------------------------------
    def serve(self, work: RecvWork) -> None:
        """Complete ``work`` (a stream waits for it) in the channel's thread: it releases the flag, whatever happens."""
        with self.cond:
            if self.closed:
                return  # the group is closing: close() fails every pending receive
            self.served.append(work)
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._run, daemon=True, name=f"tw-dist-recv-{self.peer.peer}-{self.tag - 1}"
                )
                self.thread.start()
            else:
                self.cond.notify()

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.served and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                work = self.served[0]
            try:
                self.peer.ops.bind_thread(work._tensor.device)
                self.drive(work, work._deadline)
            except WorkTimeout:
                # A stream waits for it: it cannot be left pending. Close the pair, which fails (and releases)
                # every receive of it -- what NCCL's watchdog does to a communicator whose work timed out.
                self.peer.fail(
                    WorkTimeout(
                        f"{work._what} not complete within {work._timeout:.3g} s of wait() (a CUDA stream waits "
                        f"for it): the connection to rank {self.peer.peer} is closed"
                    ),
                    "",
                )
            except BaseException as exc:  # noqa: BLE001 - drive() failed the pair already; this is the backstop
                self.peer.fail(exc, work._what)
            if not work.done:
                work._sleep_until_done(SLICE)  # taken off the queue by another thread, finishing it now
            with self.cond:
                while self.served and self.served[0].done:
                    self.served.popleft()

    def close(self) -> None:
        """Stop the completion thread (after the pair failed: nothing is pending) and give the flag back."""
        with self.cond:
            self.closed = True
            self.served.clear()
            self.cond.notify_all()
            thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)
        with self.post_lock:
            for _work, _buf, ev in self.unposted:
                self.peer.ops.recycle(ev)
            self.unposted.clear()
            flag, self.flag = self.flag, None
        if flag is not None:
            self.peer.ops.give_flag(flag)


class _SendChannel:
    """Sends of one tag to one peer, in order.

    A message goes out in the caller's thread when that cannot block; otherwise
    it is queued. Whoever gets there first sends the queued messages, oldest
    first: the caller when it waits on one of them (``dist.send`` is ``isend``
    + ``wait``: no thread hand-off), or the tag's sender thread, which takes a
    queued message once it has stayed at the head of the queue for ``DEFER``
    seconds (so an ``isend`` nobody waits on still goes out). The thread is
    woken only when it is parked (nothing queued): it never polls, and it never
    contends for ``send_lock`` with a caller that is sending. A ``wait()`` that
    only makes a CUDA stream wait (nobody will help) wakes it at once (:meth:`kick`).

    CUDA messages always queue (with an event recorded on the caller's stream,
    or none when that stream was idle) and take sequence numbers of the
    channel's flag in queue order; they complete in that order.
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
        self.urgent = False  # a stream waits for a queued message: send without DEFER
        self.closed = False
        self.flag: Flag | None = None

    def submit(self, work: SendWork, tensor: torch.Tensor, sig: Signature, hdr: tuple[int, ...]) -> None:
        tcp = self.peer.tcp
        if tcp is not None and not self.pending and tensor.is_contiguous() and not self.peer.ops.streamed(tensor):
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
        device_side = peer.ops.streamed(tensor)
        if not device_side and not tensor.is_contiguous():
            slot = peer.pool.take(sig, "same")
            slot.copy_(tensor)
            work._staging = (sig, "same", slot)
            tensor = slot
        if not device_side and not self.pending and self.send_lock.acquire(blocking=False):
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
        ev = flag = None
        if device_side:
            ev = peer.ops.mark(tensor)  # the bytes are final once the caller's stream reaches it
            flag = self.flag_for(tensor)
        work._chan = self
        with self.cond:
            if flag is not None:
                work._flag = flag
                work._seq = flag.issue()
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

    def flag_for(self, tensor: torch.Tensor) -> Flag | None:
        """The channel's flag (taken on its first CUDA send), or None where streams cannot wait on one."""
        ops = self.peer.ops
        if not ops.usable(tensor.device):
            return None
        with self.cond:
            if self.flag is None:
                self.flag = ops.new_flag(tensor.device)
            return self.flag

    def kick(self) -> None:
        """A stream waits for a queued message: the thread sends without waiting for a caller to help."""
        with self.cond:
            self.urgent = True
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
        ops = peer.ops
        exc: BaseException | None = None
        if partial is not None:  # the connection's send lock is ours until the rest of this frame is out
            try:
                assert peer.tcp is not None  # only TCP sends part of a frame
                peer.tcp.finish_send(partial, timeout=peer.timeout)
            except BaseException as exc_:  # noqa: BLE001 - a cut frame: the pair is broken
                exc = peer.fail(exc_, work._what, tag=self.tag, sig=sig)
            work._finish(exc)
            return
        try:
            peer.check()
            if ops.streamed(tensor):
                # A CUDA tensor: read only once the caller's stream has reached the isend (this thread waits
                # for that event, not for the device); copies go on tensorwire's own stream.
                if not ops.wait_reached(ev, time.monotonic() + peer.timeout):
                    raise WorkTimeout(
                        f"{work._what}: the caller's CUDA stream did not reach the isend within {peer.timeout:.3g} s"
                    )
                if not t.reaches_cuda:  # through a pinned host slot (TCP)
                    slot = peer.pool.take(sig, "pinned")
                    work._staging = (sig, "pinned", slot)
                    ops.copy(slot, tensor)
                    tensor = slot
                elif not tensor.is_contiguous():
                    slot = peer.pool.take(sig, "same", tensor.device)
                    work._staging = (sig, "same", slot)
                    ops.copy(slot, tensor)
                    tensor = slot
            t.send(self.tag, _wire(t, tensor), shape=hdr, timeout=peer.timeout)
        except TransferTimeout as exc_:  # no credit within the group's timeout: nothing sent, the pair lives on
            exc = translate(exc_, work._what)
        except BaseException as exc_:  # noqa: BLE001
            exc = peer.fail(exc_, work._what, tag=self.tag, sig=sig)
        finally:
            ops.recycle(ev)
        work._finish(exc)

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.pending and not self.closed:
                    self.parked = True
                    self.urgent = False
                    self.cond.wait()
                    self.parked = False
                if self.closed:
                    return
                head = self.pending[0]
                # A caller waiting on it sends it itself, without a hand-off: give it DEFER to do so
                # (unless a stream waits for it: then nobody will).
                if not self.urgent:
                    self.cond.wait(self.DEFER)
                if self.closed:
                    return
                if not self.pending or self.pending[0] is not head:
                    continue  # taken (by a caller): look at what is queued now
            with self.send_lock:
                with self.cond:
                    item = self.pending.popleft() if self.pending else None
                if item is not None:
                    if self.peer.ops.streamed(item[1]):
                        try:
                            self.peer.ops.bind_thread(item[1].device)
                        except Exception as exc:  # noqa: BLE001 - _send reports what fails with the device
                            log.debug("binding the sender thread to %s: %s", item[1].device, exc)
                    self._send(item)

    def close(self, reason: BaseException) -> None:
        with self.cond:
            self.closed = True
            pending, self.pending = list(self.pending), collections.deque()
            self.cond.notify_all()
            thread = self.thread
        for item in pending:
            item[0]._finish(reason)
            self.peer.ops.recycle(item[4])
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)
        with self.cond:
            flag, self.flag = self.flag, None
        if flag is not None:
            self.peer.ops.give_flag(flag)


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
        if self.tcp is not None and tensor.is_contiguous() and not self.ops.streamed(tensor):
            # TCP, host memory: the sender's bytes land in the tensor itself
            work = RecvWork(self, chan, tensor, sig, hdr, None)
            if self.error is not None:
                work._finish(self.error)
                return work
            n = sig.nbytes
            try:
                chan.post_wire(work, _host_bytes(tensor, n) if n else _EMPTY, tensor)
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
            work._flag = chan.flag_for(tensor)
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
        for rchan in list(self._recv.values()):
            rchan.close()
        self.link.close()


def check_tag(tag: int) -> int:
    if not isinstance(tag, int) or not 0 <= tag <= MAX_TAG:
        raise ConfigError(f"backend 'tensorwire' takes tags in [0, {MAX_TAG}], got {tag!r}")
    return tag
