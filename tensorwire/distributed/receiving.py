"""The receive side of a peer channel: ``irecv`` work and the per-tag receive queue.

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
"""

from __future__ import annotations

import collections
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from ..errors import TransferTimeout
from .errors import SignatureMismatch, WorkTimeout
from .messages import SLICE, wire_view
from .signatures import Signature, decode
from .streams import Flag
from .work import Work

if TYPE_CHECKING:  # pragma: no cover
    from ..transport.base import Received
    from .channel import Peer

__all__ = ["RecvWork", "RecvChannel"]


class RecvWork(Work):
    """``irecv``: done once the message is in the tensor (checked against the sender's signature)."""

    __slots__ = (
        "_peer",
        "_chan",
        "_tensor",
        "_sig",
        "_hdr",
        "_staging",
        "_posted",
        "_device_side",
        "_ready",
        "_flag",
        "_seq",
    )

    def __init__(
        self,
        peer: "Peer",
        chan: "RecvChannel",
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
        self._device_side = False  # CUDA tensor (stream semantics)
        self._ready: Any = None  # staged CUDA receive: the caller's stream reached irecv (copy into the tensor after)
        self._flag: Flag | None = None  # CUDA: the channel's flag, released with ``_seq`` once the bytes are in
        self._seq: int | None = None

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
                    ops.copy(self._tensor.detach(), self._staging)  # detached: a leaf may require grad
                except BaseException as exc:  # noqa: BLE001
                    self._release()
                    self._finish(self._peer.fail(exc, self._what))
                    return
                finally:
                    ops.recycle(ready)
            else:
                self._tensor.detach().copy_(self._staging)  # into a non-contiguous host tensor
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


class RecvChannel:
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
        self.poster: threading.Thread | None = None
        self.post_wanted = False
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
                t.post_recv(self.tag, wire_view(t, buf), header=True)
                work._posted = True
                self.fifo.append(work)
            else:
                self.fifo.append(work)
                self.unposted.append((work, buf, after))
                self._post_later(buf.device)

    def _post_later(self, device: torch.device) -> None:
        """A receive waits for its caller's stream to reach it: a thread posts it then, whoever waits on what.

        Without it the receive would be posted only when its caller waits on it; two ranks that each wait on
        their ``isend`` first (``batch_isend_irecv`` and pipelining's schedules do) would each hold the receive
        the other's send needs a credit for -- a deadlock until the timeout (seen on two GPUs over UCX).
        """
        with self.cond:
            self.post_wanted = True
            if self.poster is None:
                self.poster = threading.Thread(
                    target=self._run_poster,
                    args=(device,),
                    daemon=True,
                    name=f"tw-dist-post-{self.peer.peer}-{self.tag - 1}",
                )
                self.poster.start()
            else:
                self.cond.notify_all()

    def _run_poster(self, device: torch.device) -> None:
        self.peer.ops.bind_thread(device)  # UCX's CUDA transports expect a context in the posting thread
        while True:
            with self.cond:
                while not self.post_wanted and not self.closed:
                    self.cond.wait()
                if self.closed:
                    return
                self.post_wanted = False
            try:
                # waits on events only (no GPU work queued, nothing allocated): safe while a stream waits
                self.flush(time.monotonic() + self.peer.timeout)
            except BaseException:  # noqa: BLE001 - flush failed the pair; the receives' callers see it
                return

    def post_wire(self, work: RecvWork, wire: Any, buf: torch.Tensor) -> None:
        """Post a host receive (no stream to wait for) whose transport view is ``wire`` (:func:`wire_view` of ``buf``)."""
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
                        t.post_recv(self.tag, wire_view(t, buf), header=True)
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
            threads = (self.thread, self.poster)
        for thread in threads:
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=5.0)
        with self.post_lock:
            for _work, _buf, ev in self.unposted:
                self.peer.ops.recycle(ev)
            self.unposted.clear()
            flag, self.flag = self.flag, None
        if flag is not None:
            self.peer.ops.give_flag(flag)
