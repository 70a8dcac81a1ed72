"""The gRPC calls of the Store service that move tensor bytes: Get, GetRows, BeginPut, PutRows, CommitPut
and AbortPut (the :class:`TransferCalls` part of :class:`tensorwire.serve.daemon.service.StoreService`).

Each validates its request completely, then schedules one transfer on the
caller's session (:meth:`~tensorwire.serve.daemon.session.Session.schedule`) and
answers with the step the bytes will carry. A write is pending on its session
until CommitPut (or AbortPut). A session whose client speaks data-plane requests
uses those instead (:mod:`tensorwire.serve.daemon.datapath`).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import grpc

from tensorwire import errors
from tensorwire._proto import spec_from_proto, spec_to_proto
from tensorwire.v1 import store_pb2
from tensorwire.serve.protocol.common import TAG_DOWN, TAG_UP, decode_index
from tensorwire.serve.protocol.layout import ShardLayout
from tensorwire.serve.daemon.ops import commit_rows, plan_row_update, plan_rows
from tensorwire.serve.daemon.ops import check_tensor_name as _name
from tensorwire.serve.daemon.ops import recv as _recv
from tensorwire.serve.daemon.ops import send as _send
from tensorwire.serve.daemon.ops import timeout_of as _timeout
from tensorwire.serve.daemon.ops import typed_view as _typed
from tensorwire.serve.daemon.jobs import Job, PendingWrite
from tensorwire.serve.daemon.session import Session
from tensorwire.serve.daemon.entry import Info
from tensorwire.serve.daemon.store import Store, normalise_spec
from tensorwire.serve.daemon.limits import WaitGate
from tensorwire.serve.daemon.rpc import info_proto, rpc

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.transport.base import Transport
    from tensorwire.serve.daemon.metrics import Metrics

__all__ = ["TransferCalls"]


class TransferCalls:
    """The transfer calls of the Store service (see the module docstring)."""

    # what the service provides
    store: Store
    waits: WaitGate
    default_timeout: float
    draining: bool
    metrics: "Metrics | None"
    _session: Callable[[str], Session]

    # -- writes ------------------------------------------------------------------------------
    def _start_write(
        self,
        s: Session,
        kind: str,
        nbytes: int,
        deadline: float,
        recv_into: Callable[["Transport", int], Any],
        commit: Callable[[Any], Info],
        abort: Callable[[], None],
    ) -> store_pb2.Transfer:
        op_id = s.next_op_id()
        job = Job(kind, recv_into, deadline=deadline, direction="in", nbytes=nbytes)
        pending = PendingWrite(op_id, job, lambda: commit(job.result), abort)
        with s._lock:
            busy = s.pending is not None
            if not busy:
                s.pending = pending
        if busy:
            abort()
            raise errors.ProtocolError("another write is pending on this session: commit or abort it first")
        try:
            step = s.schedule(job, up=True)
        except BaseException:
            with s._lock:
                s.pending = None
            abort()
            raise
        return store_pb2.Transfer(tag=TAG_UP, step=step, nbytes=nbytes, op_id=op_id)

    @rpc("BeginPut", new_work=True)
    def BeginPut(self, request: store_pb2.BeginPutRequest, context: grpc.ServicerContext) -> Any:
        s = self._session(request.session_id)
        if s.pending is not None:
            raise errors.ProtocolError("another write is pending on this session: commit or abort it first")
        spec = normalise_spec(spec_from_proto(request.spec))
        timeout = _timeout(request.timeout_ms, self.default_timeout)
        deadline = time.monotonic() + timeout
        e, created = self.store.declare(spec, layout=ShardLayout.from_field(request))
        idx = self.waits.run(e.begin_put, deadline, f"BeginPut {spec.name}")
        raw = e.slot(idx).raw
        nbytes = e.nbytes

        def recv(t: "Transport", step: int) -> None:
            _recv(t, raw, nbytes, step, deadline)

        def commit(_: Any) -> Info:
            return e.commit_put(idx, time.monotonic() + timeout)

        transfer = self._start_write(s, "put", nbytes, deadline, recv, commit, e.end_put)
        return store_pb2.BeginPutResponse(transfer=transfer, created=created)

    @rpc("PutRows", new_work=True)
    def PutRows(self, request: store_pb2.PutRowsRequest, context: grpc.ServicerContext) -> Any:
        s = self._session(request.session_id)
        if s.pending is not None:
            raise errors.ProtocolError("another write is pending on this session: commit or abort it first")
        add = request.add
        self.store.check_layout(request.name, ShardLayout.from_field(request))
        p = plan_row_update(
            self.store,
            request.name,
            lambda rows: decode_index(request.index, rows),
            spec_from_proto(request.values),
            add,
        )
        nbytes = p.nbytes
        s.reserve_scratch(nbytes)  # charged against --max-bytes before anything is scheduled
        timeout = _timeout(request.timeout_ms, self.default_timeout)
        deadline = time.monotonic() + timeout
        dtype = p.spec.torch_dtype

        def recv(t: "Transport", step: int) -> "torch.Tensor":
            buf = s.scratch(nbytes)
            _recv(t, buf, nbytes, step, deadline)
            return _typed(buf, dtype, p.shape)

        def commit(vals: "torch.Tensor") -> Info:
            return commit_rows(p, vals, add, timeout)

        transfer = self._start_write(s, "add_rows" if add else "put_rows", nbytes, deadline, recv, commit, lambda: None)
        return store_pb2.PutRowsResponse(transfer=transfer)

    def _claim(self, s: Session, op_id: int) -> PendingWrite:
        with s._lock:
            p = s.pending
            if p is None or p.op_id != op_id or p.finished:
                raise errors.ProtocolError(f"no pending write {op_id} on this session")
            return p

    @rpc("CommitPut")
    def CommitPut(self, request: store_pb2.CommitPutRequest, context: grpc.ServicerContext) -> Any:
        s = self._session(request.session_id)
        p = self._claim(s, request.op_id)
        # The job is bounded by its own deadline; it fails (and closes the session) past it. Until then
        # this handler waits for the bytes a slice at a time (Busy: the client calls CommitPut again).
        self.waits.run(lambda until: p.job.wait(max(0.0, until - time.monotonic())), p.job.deadline + 5.0, "CommitPut")
        with s._lock:
            if p.finished:
                raise errors.ClosedError(f"session closed: {s.close_reason}")
            p.finished = True
            s.pending = None
        info = p.commit()
        return store_pb2.CommitPutResponse(info=info_proto(info))

    @rpc("AbortPut")
    def AbortPut(self, request: store_pb2.AbortPutRequest, context: grpc.ServicerContext) -> Any:
        s = self._session(request.session_id)
        p = self._claim(s, request.op_id)
        if not p.job.done.is_set():
            # A posted receive cannot be taken back: closing the session is what guarantees
            # nothing lands in the staging slot later. The client opens a new one.
            s.close("write aborted before its bytes arrived")
            return store_pb2.AbortPutResponse()
        with s._lock:
            if p.finished:
                return store_pb2.AbortPutResponse()
            p.finished = True
            s.pending = None
        p.abort()
        return store_pb2.AbortPutResponse()

    # -- reads -------------------------------------------------------------------------------
    def _no_pending(self, s: Session) -> None:
        if s.pending is not None:
            raise errors.ProtocolError("a write is pending on this session: commit or abort it first")

    @rpc("Get", new_work=True)
    def Get(self, request: store_pb2.GetRequest, context: grpc.ServicerContext) -> Any:
        s = self._session(request.session_id)
        self._no_pending(s)
        self.store.check_layout(request.name, ShardLayout.from_field(request))
        e = self.store.get(_name(request.name))
        timeout = _timeout(request.timeout_ms, self.default_timeout)
        deadline = time.monotonic() + timeout
        idx, version = self.waits.run(e.acquire_read, deadline, f"Get {e.spec.name}")
        try:
            raw = e.slot(idx).raw
            job = Job(
                "get",
                lambda t, step: _send(t, raw, step, deadline),
                deadline=deadline,
                cleanup=lambda: e.release_read(idx),
                direction="out",
                nbytes=e.nbytes,
            )
            step = s.schedule(job, up=False)
        except BaseException:
            e.release_read(idx)
            raise
        info = store_pb2.TensorInfo(spec=spec_to_proto(e.spec), version=version, nbytes=e.nbytes)
        transfer = store_pb2.Transfer(tag=TAG_DOWN, step=step, nbytes=e.nbytes)
        return store_pb2.GetResponse(info=info, transfer=transfer)

    @rpc("GetRows", new_work=True)
    def GetRows(self, request: store_pb2.GetRowsRequest, context: grpc.ServicerContext) -> Any:
        import torch

        s = self._session(request.session_id)
        self._no_pending(s)
        self.store.check_layout(request.name, ShardLayout.from_field(request))
        p = plan_rows(self.store, request.name, lambda rows: decode_index(request.index, rows), "request")
        e, spec, index, shape, nbytes = p.entry, p.spec, p.index, p.shape, p.nbytes
        s.reserve_scratch(nbytes)  # charged against --max-bytes before anything is pinned or scheduled
        timeout = _timeout(request.timeout_ms, self.default_timeout)
        deadline = time.monotonic() + timeout
        idx, version = self.waits.run(e.acquire_read, deadline, f"GetRows {spec.name}")
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                e.release_read(idx)

        dtype = spec.torch_dtype

        def run(t: "Transport", step: int) -> None:
            buf = s.scratch(nbytes)
            try:
                if p.n:
                    torch.index_select(e.slot(idx).tensor, 0, index, out=_typed(buf, dtype, shape))
            finally:
                release()
            _send(t, buf, step, deadline)

        try:
            job = Job("get_rows", run, deadline=deadline, cleanup=release, direction="out", nbytes=nbytes)
            step = s.schedule(job, up=False)
        except BaseException:
            release()
            raise
        info = store_pb2.TensorInfo(spec=spec_to_proto(spec), version=version, nbytes=e.nbytes)
        transfer = store_pb2.Transfer(tag=TAG_DOWN, step=step, nbytes=nbytes)
        return store_pb2.GetRowsResponse(info=info, transfer=transfer, shape=list(shape))
