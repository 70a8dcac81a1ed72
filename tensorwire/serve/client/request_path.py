"""The data-plane request path: each hot operation is a small binary request on the session's data connection.

With a daemon that takes them (``data_requests`` in OpenSession), get,
get_rows, put, put_rows and add_rows make no gRPC call once the session is
open: each is a request (format: :mod:`tensorwire.serve.protocol.wire`) on
tag 4, answered by a fixed-size reply on tag 5 and followed by the tensor
bytes (tag 1 down, tag 2 up). A read's reply buffer for the next request is
posted while this one's bytes arrive.

Failures are reported through the operation's
:class:`~tensorwire.serve.client.context.Progress`: ``lost`` set means the
connection can no longer be trusted (the client drops the session, and runs
the operation once more on a new one when it cannot have changed anything);
``sent`` means a write may have been committed (never repeated). An ERROR
reply raises its error class and leaves the session as it is.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Any, Callable

from tensorwire.buffers import as_bytes
from tensorwire.errors import ProtocolError, ShapeMismatchError, TensorWireError, TransportError
from tensorwire.serve.client.common import TensorStat
from tensorwire.serve.client.context import ClientContext, Progress, RowUpdate, typed
from tensorwire.serve.protocol import wire
from tensorwire.serve.protocol.common import ERROR_CLASSES, TAG_DOWN, TAG_REPLY, TAG_REQUEST, TAG_UP
from tensorwire.spec import TensorSpec

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.serve.client.session import Session
    from tensorwire.serve.client.window import ShardView

__all__ = ["RequestPath", "RECV_WINDOW"]

#: A chunked read keeps at most this many receives posted ahead of the one it waits for.
RECV_WINDOW = 8
#: Data-plane requests that carry the expected shard layout of their tensor (see Client.expect_layout).
_LAYOUT_OPS = frozenset((wire.OP_GET, wire.OP_GET_ROWS, wire.OP_PUT, wire.OP_PUT_ROWS, wire.OP_ADD_ROWS))


class RequestPath:
    """The hot operations of one session as data-plane requests (see the module docstring)."""

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
        self._reply_bufs: "list[torch.Tensor]" = []
        self._posted: "collections.deque[torch.Tensor]" = collections.deque()  # on tag 5, in order

    def _take_over(self, other: "RequestPath") -> None:
        """Continue the requests ``other`` sent on the same session (its counters and buffers)."""
        self.req_id, self.replies = other.req_id, other.replies
        self._req_buf, self._reply_bufs, self._posted = other._req_buf, other._reply_bufs, other._posted

    def close(self) -> None:
        self.session.close(self.ctx)

    def pin_view(self, name: str, rows: int, pr: Progress) -> "ShardView | None":
        """No shared memory on this path (see ShmPath.pin_view)."""
        return None

    # -- requests and replies ------------------------------------------------------------------------
    def _request_buffer(self, size: int) -> "torch.Tensor":
        import torch

        b = self._req_buf
        if b is None or b.numel() < size:
            b = self._req_buf = torch.empty(max(64 << 10, 1 << (size - 1).bit_length()), dtype=torch.uint8)
        return b

    def post_reply(self, pr: Progress) -> None:
        """Post a reply buffer on tag 5 (replies fill them in the order they were posted)."""
        import torch

        if not self._reply_bufs:
            self._reply_bufs = [torch.zeros(wire.REPLY_BYTES, dtype=torch.uint8) for _ in range(3)]
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
        buf = self._request_buffer(size)
        req_id = self.req_id + 1
        wire.pack_request(memoryview(buf.numpy()), op=op, req_id=req_id, name=nb, flags=flags)
        self.req_id = req_id
        self.transport.send(TAG_REQUEST, buf[:size], step=req_id, timeout=self.ctx.timeout)

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
        import torch

        ctx = self.ctx
        nb = ctx.name_bytes(name)
        n = 0 if index is None else index.numel()
        layout = ctx.expect_packed.get(name, b"") if op in _LAYOUT_OPS else b""
        if layout:
            flags |= wire.FLAG_LAYOUT
        size = wire.request_size(len(nb), n, layout=bool(layout))
        buf = self._request_buffer(size)
        req_id = self.req_id + 1
        off = wire.pack_request(
            memoryview(buf.numpy()),
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
            buf[off : off + 8 * n].view(torch.int64).copy_(index)
        self.prepost_reply(pr)
        try:
            self.req_id = req_id
            self.transport.send(TAG_REQUEST, buf[:size], step=req_id, timeout=pr.left(ctx.timeout))
            if self.shm and len(self._posted) < 2:
                # the next request's reply buffer, while the daemon works on this one (a shared-memory
                # operation has no bytes to wait for, during which the socket paths post it)
                self.post_reply(pr)
        except TensorWireError as exc:
            pr.lost = exc
            raise
        return self.reply(pr, op)

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
                rep = wire.parse_reply(memoryview(buf.numpy()))
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

    @staticmethod
    def lost(pr: Progress, msg: str) -> ProtocolError:
        """A reply this client cannot follow: the session is dropped (no retry)."""
        exc = ProtocolError(msg)
        pr.lost = exc
        return exc

    # -- the bytes -----------------------------------------------------------------------------------
    def receive(self, pr: Progress, rep: "wire.Reply", dest: "torch.Tensor") -> None:
        """Receive a read's ``rep.nbytes`` (messages of ``rep.chunk`` bytes on tag 1) into ``dest``."""
        t = self.transport
        nb, ch = rep.nbytes, rep.chunk
        if nb == 0:
            self.prepost_reply(pr)
            return
        if ch <= 0 or dest.numel() != nb:
            raise self.lost(pr, f"the server sends {nb} bytes in messages of {ch}; this read expects {dest.numel()}")
        k = -(-nb // ch)
        parts = [dest] if k == 1 else [dest[i * ch : min(nb, (i + 1) * ch)] for i in range(k)]
        posted = 0
        try:
            for i, part in enumerate(parts):
                while posted < k and posted <= i + RECV_WINDOW:
                    t.post_recv(TAG_DOWN, parts[posted])
                    posted += 1
                if i == 0:
                    self.prepost_reply(pr)  # while the server gathers / sends
                try:
                    r = t.wait_recv(TAG_DOWN, timeout=pr.left(self.ctx.timeout))
                finally:
                    t.forget_buffer(part)
                if r.nbytes != part.numel() or (r.step is not None and r.step != rep.step + i):
                    raise ProtocolError(
                        f"received {r.nbytes} bytes (step {r.step}); expected {part.numel()} (step {rep.step + i})"
                    )
        except TensorWireError as exc:
            pr.lost = exc
            raise

    def drain(self, pr: Progress, rep: "wire.Reply") -> None:
        """Receive and discard a read's bytes (keeps the session in step)."""
        self.receive(pr, rep, self.ctx.pool("", "discard").acquire(rep.nbytes))

    def write(self, pr: Progress, op: int, rep: "wire.Reply", src: "torch.Tensor", name: str) -> TensorStat:
        """After a GO reply: send ``src`` on tag 2, return the committed stat from the final reply."""
        if rep.status != wire.GO or rep.nbytes != src.numel():
            raise self.lost(
                pr, f"the server expects {rep.nbytes} bytes (status {rep.status}), this client has {src.numel()}"
            )
        pr.sent = True  # from here on the daemon may commit: never repeated
        self.prepost_reply(pr)  # for the final reply
        try:
            if rep.nbytes:
                self.transport.send(TAG_UP, src, step=rep.step, timeout=pr.left(self.ctx.timeout))
        except TensorWireError as exc:
            pr.lost = exc
            raise
        self.post_reply(pr)  # the next request's, while the server commits
        done = self.reply(pr, op)
        if done.status != wire.OK:
            raise self.lost(pr, f"final reply of a write has status {done.status}")
        spec = self.ctx.reply_spec(name, done)
        return TensorStat(spec, int(done.version), spec.nbytes)

    # -- shared memory (ShmPath): an SHM reply here is one this session never asked for -------------------
    def read_shm(
        self, pr: Progress, rep: "wire.Reply", name: str, spec: TensorSpec, out: "torch.Tensor | None"
    ) -> "torch.Tensor":
        raise self.lost(pr, f"{name}: a shared-memory reply on a session without shared memory")

    def write_shm(
        self, pr: Progress, op: int, rep: "wire.Reply", name: str, nbytes: int, fill: Callable[[Any], None]
    ) -> TensorStat:
        raise self.lost(pr, f"{name}: a shared-memory reply on a session without shared memory")

    # -- the operations ------------------------------------------------------------------------------
    def get(self, name: str, out: "torch.Tensor | None", pr: Progress) -> "torch.Tensor":
        ctx = self.ctx
        rep = self.call(pr, wire.OP_GET, name, flags=self.flags)
        spec = ctx.reply_spec(name, rep)
        if rep.nbytes != spec.nbytes:
            raise self.lost(pr, f"get {name}: the server sends {rep.nbytes} bytes of {spec.describe()}")
        if rep.status == wire.SHM:
            return self.read_shm(pr, rep, name, spec, out)
        if out is not None:
            try:
                ctx.check_out(spec, out, spec.shape)
            except ShapeMismatchError:
                self.drain(pr, rep)
                raise
            if out.device.type == "cpu" and out.is_contiguous():
                self.receive(pr, rep, as_bytes(out))
                return out
        raw = ctx.pool(name, "get").acquire(rep.nbytes)
        self.receive(pr, rep, raw)
        return ctx.result(typed(raw, spec.torch_dtype, spec.shape), out)

    def get_rows(self, name: str, idx: "torch.Tensor", out: "torch.Tensor | None", pr: Progress) -> "torch.Tensor":
        ctx = self.ctx

        def fetch(part: "torch.Tensor") -> tuple[TensorSpec, int, Callable[..., None], Callable[[], None]]:
            rep = self.call(pr, wire.OP_GET_ROWS, name, index=part)

            def receive(rows: int, row_bytes: int, dest: "torch.Tensor") -> None:
                if rep.nbytes != rows * row_bytes:
                    raise self.lost(
                        pr, f"get_rows {name}: the server sends {rep.nbytes} bytes for {rows} rows of {row_bytes}"
                    )
                self.receive(pr, rep, dest)

            return ctx.reply_spec(name, rep), rep.nbytes, receive, lambda: self.drain(pr, rep)

        return ctx.rows_in_parts(name, idx, out, fetch)

    def put(self, name: str, tensor: "torch.Tensor", spec: TensorSpec, pr: Progress) -> TensorStat:
        rep = self.call(pr, wire.OP_PUT, name, dtype=wire.dtype_code(spec.dtype), shape=spec.shape, flags=self.flags)
        return self.write(pr, wire.OP_PUT, rep, self.ctx.source(name, tensor), name)

    def update(self, upd: RowUpdate, add: bool, pr: Progress) -> TensorStat:
        wop = wire.OP_ADD_ROWS if add else wire.OP_PUT_ROWS
        name = upd.name
        st: TensorStat | None = None
        for part, vspec, nbytes, fill, data in upd.parts():
            rep = self.call(
                pr, wop, name, index=part, dtype=wire.dtype_code(vspec.dtype), shape=vspec.shape, flags=self.flags
            )
            if rep.status == wire.SHM:  # the values into the session's scratch region; the daemon applies them

                def fill_scratch(dst: "torch.Tensor", fill: Callable[[Any, Any], None] = fill) -> None:
                    fill(dst.numpy(), self.copier)

                st = self.write_shm(pr, wop, rep, name, nbytes, fill_scratch)
                continue
            st = self.write(pr, wop, rep, data(), name)
        assert st is not None
        return st

    @property
    def copier(self) -> Any:
        """What copies into shared memory (ShmPath's; None here, where nothing is)."""
        return None
