"""The send side of a peer channel: ``isend`` work and the per-tag send queue.

Send (``isend``): never waits. A host tensor is posted in the caller's thread
when that cannot block (UCX: the receiver's credit is already there; TCP:
:meth:`~tensorwire.transport.tcp.TcpTransport.try_send` -- a credit or an
eager buffer of the peer's is there and the socket takes the frame at once);
otherwise the message is queued, and the caller waiting on it or the tag's
sender thread sends it (messages of one tag keep their order either way). A
frame the socket took in part is finished the same way, before anything else.

Messages up to ``EAGER_MAX`` (256 KiB) over TCP: every pair offers the other
``EAGER_SLOTS`` buffers of ``EAGER_MAX`` bytes when the group is made (and waits
for the other's offer), so such a message goes before its receive is posted or
its credit has come back, instead of being queued (which wakes the tag's
thread). A 4 KiB ping-pong is then one ``sendmsg`` and one ``recv`` per
message on each side, in the caller's thread, with no lock contended, no
Event and no thread woken (``bench/results/archive/distributed_cpu2_2026-11-24-2.md``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from ..errors import TransferTimeout
from ..transport.tcp import PartialSend
from .errors import WorkTimeout, translate
from .messages import EMPTY, host_bytes, wire_view
from .signatures import Signature
from .streams import Flag
from .work import Work

if TYPE_CHECKING:  # pragma: no cover
    from .channel import Peer

__all__ = ["SendWork", "SendChannel"]

log = logging.getLogger(__name__)


class SendWork(Work):
    """``isend``: done once the bytes are out of the tensor."""

    __slots__ = ("_peer", "_sig", "_tag", "_op", "_keep", "_chan", "_staging", "_flag", "_seq", "_precopied")

    def __init__(self, peer: "Peer", sig: Signature, tag: int, tensors: list[torch.Tensor]) -> None:
        super().__init__(peer.timeout, tensors)
        self._peer = peer
        self._sig = sig
        self._tag = tag
        self._completer = peer.completer
        self._op: Any = None  # UCX send posted in the caller's thread: complete it in wait()
        self._keep: Any = None  # what UCX reads until the send completes
        self._chan: SendChannel | None = None  # queued: the channel whose queue holds it
        self._staging: tuple[Signature, str, torch.Tensor] | None = None  # slot to give back when done
        self._flag: Flag | None = None  # CUDA: the channel's flag, released with ``_seq`` when done
        self._seq = 0
        self._precopied = False  # the slot was filled on the caller's stream (in order before the event of ``mark``)

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


class SendChannel:
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

    CUDA messages go out in the caller's thread on the same terms as host ones
    when UCX reads the tensor in place, no flag is involved (stream waits off)
    and the caller's stream is idle at ``isend``; the others queue (with an
    event recorded on the caller's stream, or none when that stream was idle)
    and take sequence numbers of the channel's flag in queue order; they
    complete in that order.
    """

    DEFER = 0.0005
    #: CUDA messages whose stream is idle go out in the caller's thread (see :meth:`_submit`); False hands
    #: every CUDA message to the sender thread (kept to measure the difference)
    DIRECT_CUDA = True

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
                            sent = tcp.try_send(self.tag, host_bytes(tensor, n) if n else EMPTY, shape=hdr)
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
        ev = flag = None
        direct = not device_side
        marked = False  # ev holds the caller's stream at this isend
        if device_side:
            flag = self.flag_for(tensor)
            if (
                flag is None
                and self.DIRECT_CUDA
                and t.reaches_cuda
                and t.async_send
                and not self.pending
                and tensor.is_contiguous()
            ):
                # A CUDA tensor that UCX reads in place, and no stream will wait on a flag for it (wait() blocks
                # the host): out in this thread too when its bytes are final now (nothing queued on the caller's
                # stream before the call). Measured on two H100s: handing it to the sender thread instead cost
                # ~100 us per dist.send/dist.recv round trip.
                ev = peer.ops.mark(tensor)
                marked = True
                direct = ev is None
        if direct and not self.pending and self.send_lock.acquire(blocking=False):
            try:
                if not self.pending:
                    data = wire_view(t, tensor)
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
        if device_side:
            # A slot is taken here, in the caller's thread, before any stream waits on this send: allocating
            # pinned or device memory synchronizes with the device, which would deadlock in the sender thread
            # while the caller's stream waits on the flag that thread releases.
            if not t.reaches_cuda:  # through a pinned host slot (TCP)
                work._staging = (sig, "pinned", peer.pool.take(sig, "pinned"))
            elif not tensor.is_contiguous():
                work._staging = (sig, "same", peer.pool.take(sig, "same", tensor.device))
            staging = work._staging
            if flag is not None and staging is not None:
                # GPU work that a thread of tensorwire's queues while the caller's stream waits on a flag that
                # thread releases may never run (measured on an H100: a copy kernel, and now and then a copy,
                # never completed). The copy into the slot goes on the caller's stream, in order, right now;
                # the thread only sends the slot once the stream has reached the event after it.
                peer.ops.copy_on_stream(staging[2], tensor)
                work._precopied = True
            if not marked:
                ev = peer.ops.mark(tensor)  # the bytes are final once the caller's stream reaches it
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
                staging = work._staging  # (taken by the caller's thread: see _submit)
                if staging is not None:  # through a pinned host slot (TCP) or out of a non-contiguous tensor
                    slot = staging[2]
                    if not work._precopied:
                        ops.copy(slot, tensor)
                    tensor = slot
            t.send(self.tag, wire_view(t, tensor), shape=hdr, timeout=peer.timeout)
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
