"""UcxTransport: the data path of a UCX connection -- posted receives, credits, sends.

:meth:`UcxTransport.post_recv` posts a real UCX tag receive on the slot's
memory (eager messages are copied in by UCX, rendezvous messages fetched
zero-copy into it) and sends the peer one 16-byte credit (the buffer's
capacity and whether it wants a header). :meth:`UcxTransport.send` spends one
credit per message: without one it waits, up to its timeout, and raises
:class:`~tensorwire.TransferTimeout` having sent nothing; a message that does
not fit the credit's buffer is refused on the sender. Header tags get a second
small receive for the 88-byte header (step, byte count, shape). Why credits,
and what they cost: ``docs/transports.md``.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Deque

from tensorwire.errors import PeerLostError, ProtocolError, TensorWireError, TransferTimeout
from tensorwire.transport.base import HEADER_DIMS, Received
from tensorwire.transport.ucx._ucxx import Array, Tag, cancelled, filled, u8, ucx
from tensorwire.transport.ucx.connection import BYE_GRACE_S, EpState, UcxConnection
from tensorwire.transport.ucx.credits import Credits, Tags
from tensorwire.transport.ucx.engine import CUDA_SPIN, Engine, as_array, is_cuda
from tensorwire.transport.ucx.wire import DATA, F_HEADER, HDR, HEADER, KIND_SHIFT, NO_SHAPE, check_tag

__all__ = ["UcxTransport"]

#: byte count -> Received(byte count) of a header-less tag (immutable, shared)
_RECEIVED: dict[int, Received] = {}


class _Post:
    __slots__ = ("req", "keep", "arr", "cap", "hreq", "hbuf", "harr")

    def __init__(self, req: Any, keep: Any, arr: Any, cap: int, hreq: Any, hbuf: Any, harr: Any) -> None:
        self.req = req  # None: posted after the peer left, filled only from UCX's unexpected queue
        self.keep = keep
        self.arr = arr
        self.cap = cap
        self.hreq = hreq
        self.hbuf = hbuf
        self.harr = harr


class _SendOp:
    """A message posted by :meth:`UcxTransport.start_send`; :meth:`UcxTransport.wait_send` completes it."""

    __slots__ = ("tag", "reqs", "n", "cuda", "finished", "error")

    def __init__(self, tag: int, reqs: list[Any], n: int, cuda: bool) -> None:
        self.tag = tag
        self.reqs = reqs
        self.n = n
        self.cuda = cuda
        self.finished = False
        self.error: BaseException | None = None

    def done(self) -> bool:
        """Whether the bytes are out (or the send failed); no progress is made here."""
        return self.finished or self.error is not None or all(r.completed for r, _ in self.reqs)


class UcxTransport(UcxConnection):
    """A UCX endpoint to one peer with credit flow control. See the module docstring."""

    kind = "ucx"
    reaches_cuda = True
    any_dtype = True
    async_send = True

    def __init__(
        self,
        eng: Engine,
        ep: Any,
        state: EpState,
        *,
        rid: int,
        peer_rid: int,
        peer: str,
        peer_timeout: float = 30.0,
        peer_errors: bool = True,
    ) -> None:
        # Called with the engine lock held.
        self._posted: dict[int, Deque[_Post]] = collections.defaultdict(collections.deque)
        self._credit = Credits(self)
        self._send_steps: dict[int, int] = collections.defaultdict(int)
        self._tag_objs: dict[int, Tags] = {}
        self.bytes_sent = 0
        self.bytes_received = 0
        super().__init__(
            eng,
            ep,
            state,
            rid=rid,
            peer_rid=peer_rid,
            peer=peer,
            peer_timeout=peer_timeout,
            peer_errors=peer_errors,
        )

    # -- public API ----------------------------------------------------------------
    def post_recv(self, tag: int, buf: Any, *, header: bool = False) -> None:
        check_tag(tag)
        keep, arr, cap = as_array(buf, writable=True)
        with self._eng.op():
            self._check_usable()
            self._post_locked(tag, keep, arr, cap, header)

    def _tags(self, tag: int) -> Tags:
        t = self._tag_objs.get(tag)
        if t is None:
            t = self._tag_objs[tag] = Tags(self._rid, self._peer_rid, tag)
        return t

    def _post_locked(self, tag: int, keep: Any, arr: Any, cap: int, header: bool) -> None:
        """post_recv under the engine lock (usability already checked)."""
        hbuf = harr = None
        if header:
            hbuf = u8(HDR.size)
            harr = Array(hbuf)
        if self._peer_gone():
            # The peer said goodbye (or its endpoint failed moments ago): like a TCP
            # stream not yet read up to its end, accept the post; no credit goes out and
            # only a message already sent can fill it (else its wait raises PeerLostError).
            self._posted[tag].append(_Post(None, keep, arr, cap, None, hbuf, harr))
            return
        try:
            tags = self._tag_objs.get(tag) or self._tags(tag)
            req = self._ep.tag_recv(arr, tag=tags.data_rx)
            hreq = None
            if header:
                hreq = self._ep.tag_recv(harr, tag=tags.hdr_rx)
            self._posted[tag].append(_Post(req, keep, arr, cap, hreq, hbuf, harr))
            self._credit.grant(tags, cap, F_HEADER if header else 0)
        except ucx.UCXError as exc:
            raise self._fail_from(exc, f"posting a receive on tag {tag}") from exc

    def wait_recv(self, tag: int, *, timeout: float | None) -> Received:
        return self._wait_recv(tag, timeout, None)

    def repost_and_wait(self, tag: int, buf: Any, *, header: bool = False, timeout: float | None) -> Received:
        # The post (a tag receive and a credit: ~10 us of Python per message on an H200 host)
        # runs inside the wait, once progress has done something -- normally picked up the
        # message the peer announced, whose rendezvous (the cuda_ipc copy) then overlaps the
        # post instead of following it -- or when the message is complete, or at the timeout.
        # It cannot be needed earlier: the peer spends this credit on the message after the
        # one awaited here. Measured on 2 x H200 (a probe in bench/'s history, tw-trace): posting
        # first put the post on the critical path of every message of a stream.
        check_tag(tag)
        keep, arr, cap = as_array(buf, writable=True)
        return self._wait_recv(tag, timeout, (keep, arr, cap, header))

    def _wait_recv(self, tag: int, timeout: float | None, repost: tuple[Any, Any, int, bool] | None) -> Received:
        deadline = None if timeout is None else time.monotonic() + timeout
        out: list[Received] = []
        eng = self._eng
        events0 = eng.events

        def post() -> None:
            nonlocal repost
            if repost is not None:
                r, repost = repost, None
                self._check_usable()
                self._post_locked(tag, *r)

        def ready() -> bool:
            if self._closed:
                # Closed by this side: its receives were released (completed empty), not filled.
                self._check_usable()
            q = self._posted.get(tag)
            if q:
                p = q[0]
                if self._peer_gone() and not self._closed:
                    self._salvage(tag, p)
                if filled(p.req) and (p.hreq is None or filled(p.hreq)):
                    q.popleft()
                    out.append(self._finish(tag, p))
                    post()
                    return True
            if repost is not None and (early or eng.events != events0 or not q):
                post()  # (with nothing posted, the buffer is the one awaited)
            self._check_usable()
            if self._bye_at is not None and time.monotonic() - self._bye_at >= BYE_GRACE_S:
                raise PeerLostError(f"peer {self._peer} closed the link (nothing more arrived on tag {tag})")
            return False

        q = self._posted.get(tag)
        head = q[0].keep if q else (repost[0] if repost is not None else None)
        cuda = head is not None and is_cuda(head)
        spin = CUDA_SPIN if cuda else None
        # Host memory: the post goes first when the awaited message is not complete yet -- the wait is
        # idle then (a round trip: the peer has not answered), where after the message it would delay
        # the caller's answer by the post (a tag receive and a credit, ~4 us); in a stream it costs the
        # same either way (the copy of a host rendezvous runs inside progress, nothing to overlap).
        early = not cuda
        if not self._eng.wait(ready, deadline, spin=spin):
            if repost is not None:
                with self._eng.op():
                    post()
            raise TransferTimeout(f"receive on tag {tag} timed out after {timeout}s (peer {self._peer})")
        return out[0]

    def _try_post(
        self, tag: int, keep: Any, arr: Any, n: int, step: int | None, shape: tuple[int, ...] | None, reqs: list[Any]
    ) -> bool:
        """Under the lock: spend a credit on ``tag`` and post the message (True), or find none (False)."""
        self._check_usable()
        if self._bye_at is not None:
            raise PeerLostError(f"peer {self._peer} closed the link")
        if self._lost_at is not None:
            self._fail(PeerLostError(f"peer {self._peer} lost (its connection closed or timed out)"))
            self._check_usable()
        tags = self._tag_objs.get(tag) or self._tags(tag)
        credit = self._credit.take(tag, tags)
        if credit is None:
            return False
        self._post_send(tag, credit, keep, arr, n, step, shape, reqs)
        self._credit.arm(tag, tags)  # after the data: the message goes out first
        return True

    def _sent(self, tag: int, reqs: list[Any]) -> bool:
        """Under the lock: whether every request of a posted message completed (raises its error)."""
        for r, _ in reqs:
            if not r.completed:
                self._check_usable()
                return False
        for r, _ in reqs:
            try:
                r.check_error()
            except ucx.UCXError as exc:
                raise self._fail_from(exc, f"send on tag {tag}") from exc
        return True

    @staticmethod
    def _prepare_send(
        tag: int, buf: Any, shape: tuple[int, ...] | None, timeout: float | None
    ) -> tuple[float | None, Any, Any, int]:
        """What send and start_send check first: (deadline, keep-alive, ucxx Array, nbytes)."""
        check_tag(tag)
        deadline = None if timeout is None else time.monotonic() + timeout
        keep, arr, n = as_array(buf, writable=False)
        if shape is not None and len(shape) > HEADER_DIMS:
            raise ProtocolError(f"rank {len(shape)} exceeds {HEADER_DIMS}")
        return deadline, keep, arr, n

    def send(
        self,
        tag: int,
        buf: Any,
        *,
        step: int | None = None,
        shape: tuple[int, ...] | None = None,
        timeout: float | None,
    ) -> None:
        deadline, keep, arr, n = self._prepare_send(tag, buf, shape, timeout)
        reqs: list[Any] = []  # (request, buffers it reads) once the message is posted
        eng = self._eng
        # Fast path (a credit in hand, an eager message out at once): one pass under the lock, no
        # waiting loop -- what eng.wait's first check does, without its set-up.
        eng.wanted.append(None)
        eng.lock.acquire()
        eng.wanted.pop()
        try:
            if self._try_post(tag, keep, arr, n, step, shape, reqs) and self._sent(tag, reqs):
                self.bytes_sent += n
                return
        except TensorWireError:
            if reqs:
                self._settle(reqs)
            raise
        finally:
            eng.lock.release()

        def progressed() -> bool:
            # phase 1: a credit, then post header + payload; phase 2: the payload is out of ``buf``
            # (eager sends usually finish right here)
            if not reqs and not self._try_post(tag, keep, arr, n, step, shape, reqs):
                return False
            return self._sent(tag, reqs)

        try:
            ok = self._eng.wait(progressed, deadline, spin=CUDA_SPIN if is_cuda(keep) else None)
        except TensorWireError:
            if reqs:
                with self._eng.op():
                    self._settle(reqs)
            raise
        if not ok:
            if not reqs:
                raise TransferTimeout(
                    f"no credit to send on tag {tag} within {timeout}s (peer {self._peer} posted no buffer)"
                )
            # The message is on its way and cannot be recalled: the link is broken.
            with self._eng.op():
                self._fail(PeerLostError(f"send on tag {tag} to {self._peer} stalled past its timeout"))
                self._teardown(goodbye=True)
                self._settle(reqs)
            raise TransferTimeout(f"send on tag {tag} did not complete within {timeout}s (peer {self._peer})")
        self.bytes_sent += n

    def start_send(
        self,
        tag: int,
        buf: Any,
        *,
        step: int | None = None,
        shape: tuple[int, ...] | None = None,
        timeout: float | None,
    ) -> "_SendOp":
        """Post a message without waiting for its bytes to leave ``buf``: :meth:`wait_send` does.

        Waits (up to ``timeout``) only for the receiver's credit, like :meth:`send`,
        and raises TransferTimeout having sent nothing if none comes. Several
        messages may be in flight at once (as many as the receiver posted
        buffers for); ``buf`` must stay untouched until the message is out.
        The transport keeps ``buf`` referenced until UCX is done with it, even
        if nobody waits.
        """
        deadline, keep, arr, n = self._prepare_send(tag, buf, shape, timeout)
        reqs: list[Any] = []

        def posted() -> bool:
            if not self._try_post(tag, keep, arr, n, step, shape, reqs):
                return False
            self._settle(reqs)  # referenced until complete, whoever waits (or nobody)
            return True

        if not self._eng.wait(posted, deadline, spin=CUDA_SPIN if is_cuda(keep) else None):
            raise TransferTimeout(
                f"no credit to send on tag {tag} within {timeout}s (peer {self._peer} posted no buffer)"
            )
        return _SendOp(tag, reqs, n, is_cuda(keep))

    def wait_send(self, op: "_SendOp", *, timeout: float | None) -> None:
        """Wait until the message of :meth:`start_send` is out of its buffer.

        Raises:
            TransferTimeout: not yet within ``timeout`` (the send goes on; wait again).
            PeerLostError, ClosedError, ...: the send failed.
        """
        if op.error is not None:
            raise op.error
        if op.finished:
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            ok = self._eng.wait(lambda: self._sent(op.tag, op.reqs), deadline, spin=CUDA_SPIN if op.cuda else None)
        except TensorWireError as exc:
            op.error = exc
            raise
        if not ok:
            raise TransferTimeout(
                f"send on tag {op.tag} not complete within {timeout}s (peer {self._peer}); it goes on"
            )
        op.finished = True
        self.bytes_sent += op.n

    def _post_send(
        self,
        tag: int,
        credit: tuple[int, int],
        keep: Any,
        arr: Any,
        n: int,
        step: int | None,
        shape: tuple[int, ...] | None,
        reqs: list[Any],
    ) -> None:
        """Spend ``credit``: post the header (if the receiver wants one) and the payload."""
        cap, flags = credit
        want_header = bool(flags & F_HEADER)
        if n > cap or (n != cap and not want_header):
            self._credit.refund(tag, credit)
            raise ProtocolError(
                f"{n} bytes do not fit the peer's {cap}-byte buffer on tag {tag}"
                + ("" if want_header else " (a tag without header takes exactly its buffer's size)")
            )
        s = self._send_steps[tag] = self._send_steps[tag] + 1
        tags = self._tag_objs.get(tag) or self._tags(tag)
        try:
            if want_header:
                hbuf = u8(HDR.size)
                if shape is None:
                    HDR.pack_into(hbuf, 0, s if step is None else step, n, NO_SHAPE, *((0,) * HEADER_DIMS))
                else:
                    dims = tuple(int(d) for d in shape) + (0,) * (HEADER_DIMS - len(shape))
                    HDR.pack_into(hbuf, 0, s if step is None else step, n, len(shape), *dims)
                harr = Array(hbuf)
                reqs.append((self._ep.tag_send(harr, tag=tags.hdr_tx), (hbuf, harr)))
            reqs.append((self._ep.tag_send(arr, tag=tags.data_tx), (keep, arr)))
        except ucx.UCXError as exc:
            raise self._fail_from(exc, f"send on tag {tag}") from exc

    # -- internals (engine lock held unless noted) ------------------------------------
    def _posted_requests(self) -> list[tuple[int, Any]]:
        tags: list[tuple[int, Any]] = []
        for tag, q in self._posted.items():
            for p in q:
                if p.req is not None and not p.req.completed:
                    tags.append((self._rid | (DATA << KIND_SHIFT) | tag, p.req))
                if p.hreq is not None and not p.hreq.completed:
                    tags.append((self._rid | (HEADER << KIND_SHIFT) | tag, p.hreq))
        return tags + self._credit.posted_requests(self._rid)

    def _receive_buffers(self) -> Any:
        return (dict(self._posted), self._credit.buffers())

    def _forget_requests(self) -> None:
        self._credit.forget()

    def _finish(self, tag: int, p: _Post) -> Received:
        try:
            p.req.check_error()
            if p.hreq is not None:
                p.hreq.check_error()
        except ucx.UCXError as exc:
            raise self._fail_from(exc, f"receive on tag {tag}") from exc
        if p.hreq is None:
            self.bytes_received += p.cap
            got = _RECEIVED.get(p.cap)
            if got is None:  # immutable: one per size (a frozen dataclass costs ~1 us to build)
                got = Received(p.cap)
                if len(_RECEIVED) < 4096:
                    _RECEIVED[p.cap] = got
            return got
        step, nbytes, ndim, *dims = HDR.unpack_from(p.hbuf)
        if nbytes > p.cap:
            self._fail(ProtocolError(f"peer {self._peer} announced {nbytes} bytes for a {p.cap}-byte slot"))
            self._check_usable()
        if ndim == NO_SHAPE:
            shape = None
        elif ndim <= HEADER_DIMS:
            shape = tuple(dims[:ndim])
        else:
            self._fail(ProtocolError(f"bad ndim {ndim} from {self._peer}"))
            self._check_usable()
        self.bytes_received += nbytes
        return Received(nbytes, shape, step)

    def _salvage(self, tag: int, p: _Post) -> None:
        """The peer is gone: refill a receive UCX cancelled (or never posted) from the unexpected queue."""
        worker = self._eng.worker
        for kind, attr, arr in ((DATA, "req", p.arr), (HEADER, "hreq", p.harr)):
            if arr is None or not cancelled(getattr(p, attr)):
                continue
            try:
                probe = worker.tag_probe(Tag(self._rid | (kind << KIND_SHIFT) | tag), remove=True)
                if probe.matched:
                    setattr(p, attr, worker.tag_recv_with_handle(arr, probe))
            except ucx.UCXError as exc:
                raise self._fail_from(exc, f"receive on tag {tag}") from exc
