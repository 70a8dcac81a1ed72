"""The data-plane request path: each hot operation is a small binary request on the session's data connection.

With a daemon that takes them (``data_requests`` in OpenSession), get,
get_rows, put, put_rows and add_rows make no gRPC call once the session is
open: each is a request (format: :mod:`tensorwire.serve.protocol.wire`) on
tag 4, answered by a fixed-size reply on tag 5 and followed by the tensor
bytes (tag 1 down, tag 2 up). A read's reply buffer for the next request is
posted while this one's bytes arrive.

Posted reads (a TCP session whose daemon takes them): a get or get_rows of
a name whose spec this client has seen posts its payload's receive before the
request (see :mod:`~tensorwire.serve.client.request_calls`, where the requests
and replies are).

Failures are reported through the operation's
:class:`~tensorwire.serve.client.context.Progress`: ``lost`` set means the
connection can no longer be trusted (the client drops the session, and runs
the operation once more on a new one when it cannot have changed anything);
``sent`` means a write may have been committed (never repeated). An ERROR
reply raises its error class and leaves the session as it is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from tensorwire.buffers import as_bytes
from tensorwire.errors import ProtocolError, ShapeMismatchError, TensorWireError
from tensorwire.serve.client.common import TensorStat
from tensorwire.serve.client.context import Progress, RowUpdate, typed
from tensorwire.serve.client.request_calls import RequestCalls
from tensorwire.serve.protocol import wire
from tensorwire.serve.protocol.common import TAG_DOWN, TAG_UP
from tensorwire.spec import TensorSpec

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["RequestPath", "RECV_WINDOW"]

#: A chunked read keeps at most this many receives posted ahead of the one it waits for.
RECV_WINDOW = 8


class RequestPath(RequestCalls):
    """The hot operations of one session as data-plane requests (see the module docstring)."""

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
        posted = self._posted_dest(name, out, None, "get") if self.posting else None
        if posted is not None:
            rep, landed = self.call_posted(pr, wire.OP_GET, name, posted[1], posted[0], posted[0].shape)
        else:
            rep, landed = self.call(pr, wire.OP_GET, name, flags=self.flags), False
        spec = ctx.reply_spec(name, rep)
        if rep.nbytes != spec.nbytes:
            raise self.lost(pr, f"get {name}: the server sends {rep.nbytes} bytes of {spec.describe()}")
        if landed:
            assert posted is not None
            return (
                out
                if posted[2] and out is not None
                else ctx.result(typed(posted[1], spec.torch_dtype, spec.shape), out)
            )
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
        if self.posting:
            got = self._get_rows_posted(name, idx, out, pr)
            if got is not None:
                return got

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

    def _get_rows_posted(
        self, name: str, idx: "torch.Tensor", out: "torch.Tensor | None", pr: Progress
    ) -> "torch.Tensor | None":
        """get_rows in one posted read (see :meth:`call_posted`); None, before anything is sent, where it does not
        apply: no spec of ``name`` seen yet, no bytes, more rows than one request takes, an ``out`` that does not fit."""
        ctx = self.ctx
        seen = ctx.specs.get(name)
        n = idx.numel()
        if seen is None or not seen.shape or n > ctx.chunk_rows(name):
            return None
        shape = (n, *seen.shape[1:])
        posted = self._posted_dest(name, out, shape, "rows")
        if posted is None:
            return None
        expect, dest, direct = posted
        rep, landed = self.call_posted(pr, wire.OP_GET_ROWS, name, dest, expect, shape, index=idx)
        got = ctx.reply_spec(name, rep)
        if landed:
            return out if direct and out is not None else ctx.result(typed(dest, got.torch_dtype, shape), out)
        try:  # another spec than the one seen last: the rows come as the reply says
            result, raw, row_bytes = ctx.rows_dest(name, got, n, out)
        except ShapeMismatchError:
            self.drain(pr, rep)
            raise
        if rep.nbytes != n * row_bytes:
            raise self.lost(pr, f"get_rows {name}: the server sends {rep.nbytes} bytes for {n} rows of {row_bytes}")
        self.receive(pr, rep, raw)
        return ctx.result(result, out)

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
