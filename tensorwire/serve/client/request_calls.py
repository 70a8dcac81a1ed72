"""Requests and replies of the data-plane request path (:mod:`tensorwire.serve.client.request_path` has the
overview): the request and reply buffers, a request sent and its reply awaited, and the posted reads.

Posted reads (a TCP session whose daemon takes them, ``wire.FLAG_POSTED``): a
get or get_rows of a name whose spec this client has seen posts the receive of
the payload it expects -- straight into ``out`` when that fits -- before it
sends the request, so the receive's credit rides on the request and the daemon
sends reply and bytes without waiting for a credit: one round trip, where
posting after the reply costs two, with a wake-up of each process in between.
When the daemon holds another spec, it completes that receive with an empty
message and the read goes on as without it.
"""

from __future__ import annotations

import collections
import math
from typing import TYPE_CHECKING

from tensorwire.buffers import as_bytes
from tensorwire.errors import ProtocolError, TensorWireError, TransportError
from tensorwire.serve.client.context import ClientContext, Progress
from tensorwire.serve.protocol import wire
from tensorwire.serve.protocol.common import ERROR_CLASSES, TAG_DOWN, TAG_REPLY, TAG_REQUEST
from tensorwire.spec import TensorSpec

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.serve.client.session import Session
    from tensorwire.serve.client.window import ShardView

__all__ = ["RequestCalls"]

#: Data-plane requests that carry the expected shard layout of their tensor (see Client.expect_layout).
_LAYOUT_OPS = frozenset((wire.OP_GET, wire.OP_GET_ROWS, wire.OP_PUT, wire.OP_PUT_ROWS, wire.OP_ADD_ROWS))


class RequestCalls:
    """The requests and replies of one session's request path (its base class; see the module docstring)."""

    requests = True
    #: Bytes go through shared memory (:class:`~tensorwire.serve.client.shm_path.ShmPath`).
    shm = False
    #: Flags of this path's get / put / row update requests.
    flags = 0

    def __init__(self, ctx: ClientContext, session: "Session") -> None:
        self.ctx = ctx
        self.session = session
        self.transport = session.transport
        self.req_id = 0  # requests sent on the session (tag 4 steps)
        self.replies = 0  # replies received on it (tag 5 steps)
        self._req_buf: "torch.Tensor | None" = None
        self._req_view: memoryview = memoryview(b"")  # the bytes of _req_buf (made with it, not per request)
        self._reply_bufs: "list[torch.Tensor]" = []
        self._reply_views: "list[memoryview]" = []  # the bytes of each of _reply_bufs
        self._posted: "collections.deque[torch.Tensor]" = collections.deque()  # on tag 5, in order
        #: Reads post their payload's receive before the request (see the module docstring): over TCP only (UCX
        #: pipelines a get_rows in chunks instead), never through shared memory.
        self.posting = session.posted_reads and session.kind == "tcp" and not self.shm

    def _take_over(self, other: "RequestCalls") -> None:
        """Continue the requests ``other`` sent on the same session (its counters and buffers)."""
        self.req_id, self.replies = other.req_id, other.replies
        self._req_buf, self._reply_bufs, self._posted = other._req_buf, other._reply_bufs, other._posted
        self._req_view, self._reply_views = other._req_view, other._reply_views

    def close(self) -> None:
        self.session.close(self.ctx)

    def pin_view(self, name: str, rows: int, pr: Progress) -> "ShardView | None":
        """No shared memory on this path (see ShmPath.pin_view)."""
        return None

    # -- requests and replies ------------------------------------------------------------------------
    def _request_view(self, size: int) -> memoryview:
        """The bytes of the request buffer, at least ``size`` of them (the buffer grown if need be; its view is
        made with it, not per request)."""
        import torch

        b = self._req_buf
        if b is None or b.numel() < size:
            b = self._req_buf = torch.empty(max(64 << 10, 1 << (size - 1).bit_length()), dtype=torch.uint8)
            self._req_view = memoryview(b.numpy())
        return self._req_view

    def post_reply(self, pr: Progress) -> None:
        """Post a reply buffer on tag 5 (replies fill them in the order they were posted)."""
        import torch

        if not self._reply_bufs:
            self._reply_bufs = [torch.zeros(wire.REPLY_BYTES, dtype=torch.uint8) for _ in range(3)]
            self._reply_views = [memoryview(b.numpy()) for b in self._reply_bufs]
        buf = next(b for b in self._reply_bufs if all(b is not q for q in self._posted))
        try:
            self.transport.post_recv(TAG_REPLY, buf)
        except TensorWireError as exc:
            pr.lost = exc
            raise
        self._posted.append(buf)

    def prepost_reply(self, pr: Progress) -> None:
        """Have the next request's reply buffer posted already (done while waiting for the server anyway)."""
        if not self._posted:
            self.post_reply(pr)

    def send_request(self, op: int, name: str, *, flags: int = 0) -> None:
        """Send a request that no reply answers (a RELEASE)."""
        nb = self.ctx.name_bytes(name)
        size = wire.request_size(len(nb), 0)
        view = self._request_view(size)
        req_id = self.req_id + 1
        wire.pack_request(view, op=op, req_id=req_id, name=nb, flags=flags)
        self.req_id = req_id
        self.transport.send(TAG_REQUEST, view[:size], step=req_id, timeout=self.ctx.timeout)

    def call(
        self,
        pr: Progress,
        op: int,
        name: str,
        *,
        index: "torch.Tensor | None" = None,
        dtype: int = 0,
        shape: tuple[int, ...] = (),
        flags: int = 0,
    ) -> "wire.Reply":
        """Send one data-plane request; returns its first reply (OK, or GO for a write).

        Raises:
            the error class of an ERROR reply (nothing changed; the session stays).
        """
        self._send_request(pr, op, name, index=index, dtype=dtype, shape=shape, flags=flags)
        return self.reply(pr, op)

    def _send_request(
        self,
        pr: Progress,
        op: int,
        name: str,
        *,
        index: "torch.Tensor | None",
        dtype: int,
        shape: tuple[int, ...],
        flags: int,
    ) -> None:
        ctx = self.ctx
        nb = ctx.name_bytes(name)
        n = 0 if index is None else index.numel()
        layout = ctx.expect_packed.get(name, b"") if op in _LAYOUT_OPS else b""
        if layout:
            flags |= wire.FLAG_LAYOUT
        size = wire.request_size(len(nb), n, layout=bool(layout))
        view = self._request_view(size)
        req_id = self.req_id + 1
        off = wire.pack_request(
            view,
            op=op,
            req_id=req_id,
            name=nb,
            timeout_ms=ctx.timeout_ms(pr),
            dtype=dtype,
            shape=shape,
            nindex=n,
            flags=flags,
            layout=layout,
        )
        if n:
            assert index is not None
            view[off : off + 8 * n] = memoryview(index.contiguous().numpy()).cast("B")  # (1-D int64, on the CPU)
        self.prepost_reply(pr)
        try:
            self.req_id = req_id
            self.transport.send(TAG_REQUEST, view[:size], step=req_id, timeout=pr.left(ctx.timeout))
            if self.shm and len(self._posted) < 2:
                # the next request's reply buffer, while the daemon works on this one (a shared-memory
                # operation has no bytes to wait for, during which the socket paths post it)
                self.post_reply(pr)
        except TensorWireError as exc:
            pr.lost = exc
            raise

    def call_posted(
        self,
        pr: Progress,
        op: int,
        name: str,
        dest: "torch.Tensor",
        expect: TensorSpec,
        shape: tuple[int, ...],
        *,
        index: "torch.Tensor | None" = None,
    ) -> "tuple[wire.Reply, bool]":
        """A read with ``dest`` posted first for a payload of ``shape`` of ``expect``'s dtype (``FLAG_POSTED``).

        Returns the first reply and whether the payload is in ``dest`` (False: the daemon holds another spec and
        sends the payload, if any, as the reply says, as without the flag).

        Raises:
            the error class of an ERROR reply (nothing changed; the session stays).
        """
        t = self.transport
        try:
            t.post_recv(TAG_DOWN, dest)
        except TensorWireError as exc:
            pr.lost = exc
            raise
        self._send_request(
            pr, op, name, index=index, dtype=wire.dtype_code(expect.dtype), shape=shape, flags=wire.FLAG_POSTED
        )
        try:
            try:  # the payload comes right behind the reply (or the empty message before it)
                r = t.wait_recv(TAG_DOWN, timeout=pr.left(self.ctx.timeout + 5))
            finally:
                t.forget_buffer(dest)
        except TensorWireError as exc:
            pr.lost = exc
            raise
        rep = self.reply(pr, op)
        step = rep.step if r.step is None else r.step  # (transports without steps: nothing to check)
        if r.nbytes == 0 and (rep.nbytes == 0 or rep.step == step + 1):
            return rep, False
        if r.nbytes != dest.numel() or rep.nbytes != r.nbytes or rep.chunk != r.nbytes or rep.step != step:
            raise self.lost(
                pr,
                f"{wire.OPS[op]} {name}: {r.nbytes} bytes (step {step}) came for a posted receive of "
                f"{dest.numel()}; the reply says {rep.nbytes} in messages of {rep.chunk} from step {rep.step}",
            )
        self.prepost_reply(pr)
        return rep, True

    def _posted_dest(
        self, name: str, out: "torch.Tensor | None", shape: tuple[int, ...] | None, kind: str
    ) -> "tuple[TensorSpec, torch.Tensor, bool] | None":
        """Where a posted read of ``name`` puts the payload it expects (``shape`` of the spec seen last; None:
        the stored shape): ``(that spec, flat bytes, whether they are out's own)``; None: no posted read (no
        spec seen, no bytes, or an ``out`` that does not fit it -- the read then says why)."""
        spec = self.ctx.specs.get(name)
        if spec is None:
            return None
        shape = spec.shape if shape is None else shape
        nbytes = spec.itemsize * math.prod(shape)
        if nbytes <= 0:
            return None
        if out is not None:
            if tuple(out.shape) != shape or out.dtype != spec.torch_dtype:
                return None
            if out.device.type == "cpu" and out.is_contiguous():
                return spec, as_bytes(out), True
        return spec, self.ctx.pool(name, kind).acquire(nbytes), False

    def reply(self, pr: Progress, op: int) -> "wire.Reply":
        """Wait for the next reply (its buffer is posted); an ERROR reply raises its error class."""
        try:
            # The daemon answers within its own deadline (a little shorter: ClientContext.timeout_ms).
            r = self.transport.wait_recv(TAG_REPLY, timeout=pr.left(self.ctx.timeout + 5))
            buf = self._posted.popleft()
            self.replies += 1
            if r.nbytes != wire.REPLY_BYTES or (r.step is not None and r.step != self.replies):
                raise ProtocolError(
                    f"reply of {r.nbytes} bytes (step {r.step}); expected {wire.REPLY_BYTES} (step {self.replies})"
                )
            try:
                rep = wire.parse_reply(self._reply_view(buf))
            except ValueError as exc:
                raise ProtocolError(f"bad reply from the server: {exc}") from None
            if rep.req_id != self.req_id or rep.op != op:
                raise ProtocolError(f"reply to request {rep.req_id} op {rep.op}; expected {self.req_id} op {op}")
        except TensorWireError as exc:
            pr.lost = exc
            raise
        if rep.status == wire.ERROR:
            cls = ERROR_CLASSES.get(rep.error)
            if cls is None:
                raise TransportError(f"{wire.OPS[op]}: {rep.message or 'the server failed'}")
            raise cls(rep.message)
        return rep

    def _reply_view(self, buf: "torch.Tensor") -> memoryview:
        """The bytes of reply buffer ``buf`` (made with the buffers, not per reply)."""
        for b, v in zip(self._reply_bufs, self._reply_views):
            if b is buf:
                return v
        return memoryview(buf.numpy())

    @staticmethod
    def lost(pr: Progress, msg: str) -> ProtocolError:
        """A reply this client cannot follow: the session is dropped (no retry)."""
        exc = ProtocolError(msg)
        pr.lost = exc
        return exc
