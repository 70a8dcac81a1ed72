"""The gRPC-call path: each hot operation is a gRPC call, its bytes on the session's data connection.

What a session uses when the daemon takes no data-plane requests (an older
daemon) or the client was made with ``data_requests=False``: Get / GetRows
schedule a transfer this client receives; BeginPut / PutRows grant one it
sends, and CommitPut commits it. The errors are those of the request paths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from tensorwire._proto import spec_from_proto, spec_to_proto
from tensorwire.buffers import as_bytes
from tensorwire.errors import NotFoundError, ProtocolError, ShapeMismatchError, TensorWireError
from tensorwire.serve.client.common import TensorStat
from tensorwire.serve.client.context import ClientContext, Progress, RowUpdate, stat_of, typed
from tensorwire.serve.protocol.common import Busy, SessionLost, encode_index, rpc_error
from tensorwire.spec import TensorSpec

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.serve.client.session import Session
    from tensorwire.serve.client.window import ShardView

__all__ = ["GrpcPath"]


class GrpcPath:
    """The hot operations of one session as gRPC calls (see the module docstring).

    The operations' ``pr`` is unused here: a failure that leaves the data
    connection out of step drops the session at once (the client's
    ``drop_session``), and a SessionLost answer makes the client open a new
    session and call once more.
    """

    #: The daemon takes data-plane requests on this path's session (no: one gRPC call per operation).
    requests = False
    #: Bytes go through shared memory.
    shm = False

    def __init__(self, ctx: ClientContext, session: "Session") -> None:
        self.ctx = ctx
        self.session = session
        self.transport = session.transport

    def close(self) -> None:
        self.session.close(self.ctx)

    def pin_view(self, name: str, rows: int, pr: Progress) -> "ShardView | None":
        """No shared memory on this path (see ShmPath.pin_view)."""
        return None

    # -- the operations ------------------------------------------------------------------------------
    def get(self, name: str, out: "torch.Tensor | None", pr: Progress) -> "torch.Tensor":
        from tensorwire.v1 import store_pb2

        ctx = self.ctx
        resp = ctx.rpc(
            "Get",
            store_pb2.GetRequest(
                session_id=self.session.sid, name=name, timeout_ms=ctx.timeout_ms(pr), layout=ctx.expect_pb.get(name)
            ),
            timeout=pr.left(ctx.timeout),
            data_op=True,
        )
        spec = spec_from_proto(resp.info.spec)
        ctx.specs[name] = spec
        tr = resp.transfer
        if out is not None:
            try:
                ctx.check_out(spec, out, spec.shape)
            except ShapeMismatchError:
                self._drain(tr, pr)
                raise
            if out.device.type == "cpu" and out.is_contiguous():
                self._recv(tr, as_bytes(out), pr)
                return out
        raw = ctx.pool(name, "get").acquire(tr.nbytes)
        self._recv(tr, raw, pr)
        return ctx.result(typed(raw, spec.torch_dtype, spec.shape), out)

    def get_rows(self, name: str, idx: "torch.Tensor", out: "torch.Tensor | None", pr: Progress) -> "torch.Tensor":
        from tensorwire.v1 import store_pb2

        ctx = self.ctx
        first = True

        def fetch(part: "torch.Tensor") -> tuple[TensorSpec, int, Callable[..., None], Callable[[], None]]:
            nonlocal first
            req = store_pb2.GetRowsRequest(
                session_id=self.session.sid,
                name=name,
                index=encode_index(part),
                timeout_ms=ctx.timeout_ms(pr),
                layout=ctx.expect_pb.get(name),
            )
            resp = ctx.rpc("GetRows", req, timeout=pr.left(ctx.timeout), data_op=True)
            tr = resp.transfer
            got = spec_from_proto(resp.info.spec)
            if first:
                ctx.specs[name] = got
                first = False
            return got, tr.nbytes, lambda _rows, _row_bytes, dest: self._recv(tr, dest, pr), lambda: self._drain(tr, pr)

        return ctx.rows_in_parts(name, idx, out, fetch)

    def put(self, name: str, tensor: "torch.Tensor", spec: TensorSpec, pr: Progress) -> TensorStat:
        from tensorwire.v1 import store_pb2

        ctx = self.ctx
        src = ctx.source(name, tensor)
        req = store_pb2.BeginPutRequest(
            session_id=self.session.sid,
            spec=spec_to_proto(spec),
            timeout_ms=ctx.timeout_ms(pr),
            layout=ctx.expect_pb.get(name),
        )
        resp = ctx.rpc("BeginPut", req, timeout=pr.left(ctx.timeout + 10), data_op=True)
        return self._send_commit(resp.transfer, src, pr)

    def update(self, upd: RowUpdate, add: bool, pr: Progress) -> TensorStat:
        from tensorwire.v1 import store_pb2

        ctx, name = self.ctx, upd.name
        st: TensorStat | None = None
        for part, vspec, _nbytes, _fill, data in upd.parts():
            req = store_pb2.PutRowsRequest(
                session_id=self.session.sid,
                name=name,
                index=encode_index(part),
                values=spec_to_proto(vspec),
                add=add,
                timeout_ms=ctx.timeout_ms(pr),
                layout=ctx.expect_pb.get(name),
            )
            resp = ctx.rpc("PutRows", req, timeout=pr.left(ctx.timeout), data_op=True)
            st = self._send_commit(resp.transfer, data(), pr)
        assert st is not None
        return st

    # -- the bytes -----------------------------------------------------------------------------------
    def _recv(self, tr: Any, raw: "torch.Tensor", pr: Progress) -> None:
        t = self.transport
        try:
            t.post_recv(tr.tag, raw)
            r = t.wait_recv(tr.tag, timeout=pr.left(self.ctx.timeout))
        except TensorWireError:
            self.ctx.drop_session()
            raise
        finally:
            t.forget_buffer(raw)
        if r.nbytes != tr.nbytes or (r.step is not None and r.step != tr.step):
            self.ctx.drop_session()
            raise ProtocolError(f"received {r.nbytes} bytes (step {r.step}); expected {tr.nbytes} (step {tr.step})")

    def _drain(self, tr: Any, pr: Progress) -> None:
        """Receive and discard a scheduled transfer (keeps the session in step)."""
        self._recv(tr, self.ctx.pool("", "discard").acquire(tr.nbytes), pr)

    def _send_commit(self, tr: Any, src: "torch.Tensor", pr: Progress) -> TensorStat:
        import grpc

        from tensorwire.v1 import store_pb2

        ctx, sid = self.ctx, self.session.sid
        if tr.nbytes != src.numel():
            ctx.drop_session()
            raise ProtocolError(f"server expects {tr.nbytes} bytes, this client has {src.numel()}")
        fut = ctx.stub.CommitPut.future(
            store_pb2.CommitPutRequest(session_id=sid, op_id=tr.op_id),
            timeout=pr.left(ctx.timeout + 10),
            metadata=ctx.md,
        )
        try:
            self.transport.send(tr.tag, src, step=tr.step, timeout=pr.left(ctx.timeout))
        except TensorWireError:
            fut.cancel()
            ctx.drop_session()
            raise
        try:
            try:
                resp = fut.result()
            except grpc.RpcError as exc:
                if not isinstance(rpc_error(exc, "CommitPut"), Busy):
                    raise
                # the bytes are still arriving: ask again (with backoff) until they are in
                resp = ctx.rpc(
                    "CommitPut",
                    store_pb2.CommitPutRequest(session_id=sid, op_id=tr.op_id),
                    timeout=pr.left(ctx.timeout + 10),
                )
        except grpc.RpcError as exc:
            err = rpc_error(exc, "CommitPut", tls=ctx.tls is not None)
            if not isinstance(err, (NotFoundError, SessionLost)):
                ctx.drop_session()
            raise err from exc
        except TensorWireError as err:
            if not isinstance(err, (NotFoundError, SessionLost)):
                ctx.drop_session()
            raise
        return stat_of(resp.info)
