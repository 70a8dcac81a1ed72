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

import time
from typing import Any

from tensorwire.errors import PeerLostError, ProtocolError, TensorWireError, TransferTimeout
from tensorwire.transport.base import HEADER_DIMS, Received
from tensorwire.transport.ucx._ucxx import ucx
from tensorwire.transport.ucx.connection import BYE_GRACE_S, EpState, UcxConnection
from tensorwire.transport.ucx.engine import CUDA_SPIN, Engine, as_array, is_cuda
from tensorwire.transport.ucx.tagstate import Post, TagState
from tensorwire.transport.ucx.wire import F_HEADER, check_tag

__all__ = ["UcxTransport"]

#: byte count -> Received(byte count) of a header-less tag (immutable, shared)
_RECEIVED: dict[int, Received] = {}


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
    #: Messages per tag a sender may post before the receiver's credit for them came (0: never). Only a
    #: message of the size and shape the last credit on its tag admitted, to a receiver that takes headers,
    #: goes ahead: UCX holds it (eager bytes, or a rendezvous' announcement) until the receive is posted,
    #: and the credit, when it comes, is checked against it. Set on both sides by users whose receives are
    #: posted only when the caller asks (backend "tensorwire"): the credit then trails the data.
    send_ahead = 0

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

    def _tagst(self, tag: int) -> TagState:
        """The state of ``tag``, made on first use (which checks the tag)."""
        st = self._st.get(tag)
        if st is None:
            check_tag(tag)
            st = self._st[tag] = TagState(self._rid, self._peer_rid, tag)
        return st

    # -- receiving -----------------------------------------------------------------
    def prepare_recv(self, buf: Any) -> Post:
        """``buf`` described once (its UCX descriptor and the record of its receive), for buffers posted
        again and again (a Link's slots): :meth:`post_recv` and :meth:`repost_and_wait` take it in place of
        ``buf`` and then build nothing per message. Valid while ``buf`` lives at the same address."""
        return Post(*as_array(buf, writable=True))

    def post_recv(self, tag: int, buf: Any, *, header: bool = False) -> None:
        st = self._st.get(tag) or self._tagst(tag)
        p = buf if type(buf) is Post and not buf.busy else self._fresh(buf)
        eng = self._eng
        eng.wanted.append(None)
        eng.lock.acquire()
        eng.wanted.pop()
        try:
            self._check_usable()
            self._post(st, p, header)
        finally:
            eng.lock.release()

    @staticmethod
    def _fresh(buf: Any) -> Post:
        """A new record for a plain buffer (or for a prepared one posted twice)."""
        return Post(buf.keep, buf.arr, buf.cap) if type(buf) is Post else Post(*as_array(buf, writable=True))

    def _post(self, st: TagState, p: Post, header: bool) -> None:
        """post_recv under the engine lock (usability already checked): a receive, and a credit for it."""
        if header:
            p.hbuf, p.harr = st.header_buffer()
        else:
            p.harr = None
        if self._bye_at is not None or self._lost_at is not None:
            # The peer said goodbye (or its endpoint failed moments ago): like a TCP
            # stream not yet read up to its end, accept the post; no credit goes out and
            # only a message already sent can fill it (else its wait raises PeerLostError).
            p.req = p.hreq = None
            st.posted.append(p)
            p.busy = True
            return
        ep = self._ep
        try:
            p.req = ep.tag_recv(p.arr, tag=st.data_rx)
            p.hreq = ep.tag_recv(p.harr, tag=st.hdr_rx) if header else None
            st.posted.append(p)
            p.busy = True
            # The credit: one 16-byte message, built once per buffer size (eager: usually out at once).
            cap = p.cap
            g = st.grants.get((cap, header)) or st.grant_message(cap, header)
            creq = ep.tag_send(g[1], tag=st.cred_tx)
        except ucx.UCXError as exc:
            raise self._fail_from(exc, f"posting a receive on tag {st.tag}") from exc
        sends = self._sends
        if not creq.completed:
            sends.append((creq, g))
        elif sends:
            while sends and sends[0][0].completed:
                sends.popleft()

    def wait_recv(self, tag: int, *, timeout: float | None) -> Received:
        return self._wait_recv(self._st.get(tag) or self._tagst(tag), timeout, None)

    def repost_and_wait(self, tag: int, buf: Any, *, header: bool = False, timeout: float | None) -> Received:
        # The post (a tag receive and a credit: ~10 us of Python per message on an H200 host)
        # runs inside the wait, once progress has done something -- normally picked up the
        # message the peer announced, whose rendezvous (the cuda_ipc copy) then overlaps the
        # post instead of following it -- or when the message is complete, or at the timeout.
        # It cannot be needed earlier: the peer spends this credit on the message after the
        # one awaited here. Measured on 2 x H200 (a probe in bench/'s history, tw-trace): posting
        # first put the post on the critical path of every message of a stream.
        st = self._st.get(tag) or self._tagst(tag)
        p = buf if type(buf) is Post and not buf.busy else self._fresh(buf)
        return self._wait_recv(st, timeout, (p, header))

    def _wait_recv(self, st: TagState, timeout: float | None, repost: tuple[Post, bool] | None) -> Received:
        eng = self._eng
        q = st.posted
        out: list[Received] = []
        events0 = eng.events

        def ready() -> bool:
            nonlocal repost
            if self._closed:
                # Closed by this side: its receives were released (completed empty), not filled.
                self._check_usable()
            # Nothing recorded, no goodbye, no loss, no control message waiting: what _check_usable
            # looks at, without its calls (the common case).
            c = self._ctrl_req
            healthy = (
                self._error is None and self._bye_at is None and self._lost_at is None and c is not None
            ) and not c.completed
            if q:
                p = q[0]
                r = p.req
                if r is not None and r.completed and (p.hreq is None or p.hreq.completed):
                    got = self._finish(st, p)
                    if got is not None:
                        q.popleft()
                        p.busy = False
                        out.append(got)
                        if repost is not None:
                            again, repost = repost, None
                            if not healthy:
                                self._check_usable()
                            self._post(st, *again)
                        return True
                if not healthy and (self._bye_at is not None or self._lost_at is not None):
                    self._salvage(st, p)  # (picked up at the next check)
            if repost is not None and (early or eng.events != events0 or not q):
                again, repost = repost, None  # (with nothing posted, the buffer is the one awaited)
                if not healthy:
                    self._check_usable()
                self._post(st, *again)
            if not healthy:
                self._check_usable()
                if self._bye_at is not None and time.monotonic() - self._bye_at >= BYE_GRACE_S:
                    raise PeerLostError(f"peer {self._peer} closed the link (nothing more arrived on tag {st.tag})")
            return False

        head = q[0].keep if q else (repost[0].keep if repost is not None else None)
        cuda = head is not None and is_cuda(head)
        # Host memory: the post goes first when the awaited message is not complete yet -- the wait is
        # idle then (a round trip: the peer has not answered), where after the message it would delay
        # the caller's answer by the post (a tag receive and a credit, ~4 us); in a stream it costs the
        # same either way (the copy of a host rendezvous runs inside progress, nothing to overlap).
        early = not cuda
        if not eng.wait(
            ready, None if timeout is None else time.monotonic() + timeout, spin=CUDA_SPIN if cuda else None
        ):
            if repost is not None:
                with eng.op():
                    self._check_usable()
                    self._post(st, *repost)
            raise TransferTimeout(f"receive on tag {st.tag} timed out after {timeout}s (peer {self._peer})")
        return out[0]

    def _finish(self, st: TagState, p: Post) -> Received | None:
        """A completed receive's result; None when UCX cancelled it (the peer's endpoint failed)."""
        try:
            p.req.check_error()
            if p.hreq is not None:
                p.hreq.check_error()
        except ucx.UCXCanceledError:
            return None  # not filled: _salvage looks for its message in UCX's unexpected queue
        except ucx.UCXError as exc:
            raise self._fail_from(exc, f"receive on tag {st.tag}") from exc
        if p.hreq is None:
            self.bytes_received += p.cap
            got = _RECEIVED.get(p.cap)
            if got is None:  # immutable: one per size (a frozen dataclass costs ~1 us to build)
                got = Received(p.cap)
                if len(_RECEIVED) < 4096:
                    _RECEIVED[p.cap] = got
            return got
        try:
            got = st.read_header(p)
        except ProtocolError as exc:
            self._fail(ProtocolError(f"peer {self._peer}: {exc}"))
            raise self._fail_from(exc, f"receive on tag {st.tag}") from exc  # (the error just recorded)
        self.bytes_received += got.nbytes
        return got

    def _salvage(self, st: TagState, p: Post) -> None:
        """The peer is gone: refill a receive UCX cancelled (or never posted) from the unexpected queue."""
        if not self._closed:
            try:
                st.salvage(self._eng.worker, self._rid, p)
            except ucx.UCXError as exc:
                raise self._fail_from(exc, f"receive on tag {st.tag}") from exc

    # -- sending -------------------------------------------------------------------
    def _try_post(
        self,
        st: TagState,
        keep: Any,
        arr: Any,
        n: int,
        step: int | None,
        shape: tuple[int, ...] | None,
        reqs: list[Any],
    ) -> bool:
        """Under the lock: spend a credit on the tag and post the message (True), or find none (False)."""
        c = self._ctrl_req
        if self._error is not None or self._bye_at is not None or self._lost_at is not None or c is None or c.completed:
            self._check_usable()
            if self._bye_at is not None:
                raise PeerLostError(f"peer {self._peer} closed the link")
            if self._lost_at is not None:
                self._fail(PeerLostError(f"peer {self._peer} lost (its connection closed or timed out)"))
                self._check_usable()
        try:
            credit = st.credits.popleft() if st.credits else st.take_credit(self._ep)
            while credit is not None and st.ahead:  # the credits of messages sent ahead come first
                st.settle_ahead(credit)
                credit = st.credits.popleft() if st.credits else st.take_credit(self._ep)
        except ucx.UCXError as exc:
            raise self._fail_from(exc, f"waiting for a credit on tag {st.tag}") from exc
        ahead = credit is None
        if credit is None:
            if not (self.send_ahead and len(st.ahead) < self.send_ahead and st.checked == (n, shape)):
                return False
            credit = (n, F_HEADER)
        try:
            st.post_message(self._ep, credit, keep, arr, n, step, shape, reqs)
        except ucx.UCXError as exc:
            raise self._fail_from(exc, f"send on tag {st.tag}") from exc
        if ahead:
            st.ahead.append(n)
        elif credit[1] & F_HEADER:
            st.checked = (n, shape)
        if st.cred_req is None:
            # Armed for the next credit after the data, so the message goes out first (credits sent
            # meanwhile wait in UCX's unexpected queue).
            try:
                st.cred_req = self._ep.tag_recv(st.cred_arr, tag=st.cred_rx)
            except ucx.UCXError as exc:
                raise self._fail_from(exc, f"waiting for a credit on tag {st.tag}") from exc
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

    def send(
        self,
        tag: int,
        buf: Any,
        *,
        step: int | None = None,
        shape: tuple[int, ...] | None = None,
        timeout: float | None,
    ) -> None:
        st = self._st.get(tag) or self._tagst(tag)
        keep, arr, n = as_array(buf, writable=False)
        if shape is not None and len(shape) > HEADER_DIMS:
            raise ProtocolError(f"rank {len(shape)} exceeds {HEADER_DIMS}")
        reqs: list[Any] = []  # (request, buffers it reads) once the message is posted
        eng = self._eng
        # Fast path (a credit in hand, an eager message out at once): one pass under the lock, no
        # waiting loop -- what eng.wait's first check does, without its set-up.
        eng.wanted.append(None)
        eng.lock.acquire()
        eng.wanted.pop()
        try:
            if self._try_post(st, keep, arr, n, step, shape, reqs) and self._sent(tag, reqs):
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
            if not reqs and not self._try_post(st, keep, arr, n, step, shape, reqs):
                return False
            return self._sent(tag, reqs)

        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            ok = eng.wait(progressed, deadline, spin=CUDA_SPIN if is_cuda(keep) else None)
        except TensorWireError:
            if reqs:
                with eng.op():
                    self._settle(reqs)
            raise
        if not ok:
            if not reqs:
                raise TransferTimeout(
                    f"no credit to send on tag {tag} within {timeout}s (peer {self._peer} posted no buffer)"
                )
            # The message is on its way and cannot be recalled: the link is broken.
            with eng.op():
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
        st = self._st.get(tag) or self._tagst(tag)
        deadline = None if timeout is None else time.monotonic() + timeout
        keep, arr, n = as_array(buf, writable=False)
        if shape is not None and len(shape) > HEADER_DIMS:
            raise ProtocolError(f"rank {len(shape)} exceeds {HEADER_DIMS}")
        reqs: list[Any] = []

        def posted() -> bool:
            if not self._try_post(st, keep, arr, n, step, shape, reqs):
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
