"""The ``tensorwire.v1.Store`` gRPC servicer and the token-auth interceptor.

Every handler validates its request completely before it reserves, pins or
allocates anything, and before it schedules a transfer: an error reported to
the client (with the ``tw-error`` trailing metadata naming its class) means
nothing was scheduled and nothing changed.

The validation of the row operations (:func:`plan_rows`,
:func:`plan_row_update`) and their commit (:func:`commit_rows`) are shared
with the data-plane requests (:mod:`tensorwire.serve.daemon.datapath`), which a
session whose client and server both speak them (``data_requests`` in
OpenSession) uses instead of Get / GetRows / BeginPut / PutRows / CommitPut.
"""

from __future__ import annotations

import functools
import hmac
import logging
import secrets
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import grpc

from tensorwire import errors
from tensorwire._proto import spec_from_proto, spec_to_proto
from tensorwire.spec import MAX_NAME_LEN
from tensorwire.transport.select import auto_preference, host_id
from tensorwire.transport.base import new_nonce
from tensorwire.v1 import store_pb2, store_pb2_grpc, types_pb2
from tensorwire.serve.protocol.common import (
    AUTH_KEY,
    DATA_REQUESTS_VERSION,
    ERROR_KEY,
    LIST_PAGE,
    MAX_INDEX_ROWS,
    MAX_ROWS_BYTES,
    PROTOCOL_VERSION,
    SESSION_ID_LEN,
    TAG_DOWN,
    TAG_UP,
    SessionLost,
    decode_index,
)
from tensorwire.serve.protocol.layout import ShardLayout
from tensorwire.serve.daemon.ops import Draining, commit_rows, plan_row_update, plan_rows, status_of
from tensorwire.serve.daemon.ops import check_tensor_name as _name
from tensorwire.serve.daemon.ops import recv as _recv
from tensorwire.serve.daemon.ops import send as _send
from tensorwire.serve.daemon.ops import timeout_of as _timeout
from tensorwire.serve.daemon.ops import typed_view as _typed
from tensorwire.serve.daemon.peers import client_key
from tensorwire.serve.daemon.session import Job, PendingWrite, Session
from tensorwire.serve.daemon.store import Entry, Info, Store, normalise_spec
from tensorwire.serve.protocol.shm import SHM_VERSION, ShmError
from tensorwire.serve.daemon.snapshot import write_snapshot
from tensorwire.serve.daemon.limits import WaitGate
from tensorwire.serve.protocol.wire import MAX_REQUEST_BYTES

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.transport.base import Listener, Transport
    from tensorwire.serve.daemon.config import ServeConfig
    from tensorwire.serve.daemon.metrics import Metrics

__all__ = ["StoreService", "TokenAuthInterceptor", "status_of"]

log = logging.getLogger(__name__)


def _rpc(op: str, *, new_work: bool = False) -> Callable:
    """Wrap a handler: draining check, error translation, metrics."""

    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def handler(self: "StoreService", request: Any, context: grpc.ServicerContext) -> Any:
            t0 = time.monotonic()
            status = "ok"
            try:
                if new_work and self.draining:
                    raise Draining("the server is shutting down and takes no new work")
                return fn(self, request, context)
            except errors.TensorWireError as exc:
                code = status_of(exc)
                status = code.name
                name = type(exc).__name__
                if isinstance(exc, Draining):
                    name = "PeerLostError"
                elif isinstance(exc, errors.ClosedError) and "session" in str(exc):
                    name = "SessionLost"
                if self.metrics is not None:
                    self.metrics.errors.labels(name).inc()
                log.debug("%s failed: %s: %s", op, name, exc)
                context.set_trailing_metadata(((ERROR_KEY, name),))
                context.abort(code, str(exc))
            except Exception:
                status = "INTERNAL"
                if self.metrics is not None:
                    self.metrics.errors.labels("internal").inc()
                log.exception("%s: internal error", op)
                context.abort(grpc.StatusCode.INTERNAL, "internal error (see the daemon's log)")
            finally:
                if self.metrics is not None:
                    self.metrics.operations.labels(op, status).inc()
                    self.metrics.operation_seconds.labels(op).observe(time.monotonic() - t0)

        return handler

    return deco


def _info_proto(info: Info) -> store_pb2.TensorInfo:
    return store_pb2.TensorInfo(
        spec=spec_to_proto(info.spec),
        version=info.version,
        nbytes=info.nbytes,
        layout=info.layout.to_proto() if info.layout is not None else None,
    )


class StoreService(store_pb2_grpc.StoreServicer):
    """The Store service: sessions, the store, and transfer scheduling."""

    def __init__(
        self,
        config: "ServeConfig",
        store: Store,
        listeners: "dict[str, Listener]",
        primary: str,
        metrics: "Metrics | None",
        *,
        connect_timeout: float = 30.0,
        default_timeout: float = 60.0,
    ) -> None:
        self.config = config
        self.store = store
        self.listeners = listeners
        self.primary = primary
        self.metrics = metrics
        self.connect_timeout = connect_timeout
        self.default_timeout = default_timeout
        self.draining = False
        #: The data-plane request format sessions may use (tensorwire.serve.protocol.wire); 0 = none (gRPC calls only).
        self.data_requests = DATA_REQUESTS_VERSION
        #: The shared-memory protocol sessions may use (tensorwire.serve.protocol.shm), when the store has regions; 0 = none.

        self.shm_version = SHM_VERSION
        self._data_handler: Any = None

        #: Bounds waits in gRPC handler threads (see tensorwire.serve.daemon.limits).
        self.waits = WaitGate(config.max_waiting_calls or max(1, config.workers // 4))
        self._sessions: dict[str, Session] = {}
        #: Per-client session counts (--max-sessions-per-client): session id -> client key, key -> count.
        self._owner: dict[str, str] = {}
        self._per_client: dict[str, int] = {}
        #: The control port clients connect to (set by the server once bound): finds a loopback caller's uid.
        self.port: int | None = None
        self._lock = threading.Lock()
        self._snapshot_lock = threading.Lock()
        if metrics is not None:
            metrics.before_collect(self._fold_pages)
            metrics.inflight.set_function(self._inflight)

    def _fold_pages(self) -> None:
        """Before a scrape: add what clients read through read leases (counted in their sessions' pages) and
        what the sessions' data-plane requests counted."""
        for s in self.sessions():
            s.fold_page()
            s.fold_tally()

    def _inflight(self) -> float:
        """Transfers scheduled or running, over every session (the tensorwire_inflight_transfers gauge)."""
        return float(sum(s.active for s in self.sessions()))

    # -- sessions ---------------------------------------------------------------------
    def _session(self, sid: str) -> Session:
        if len(sid) != SESSION_ID_LEN:
            raise SessionLost("unknown session (open a new one)")
        with self._lock:
            s = self._sessions.get(sid)
        if s is None or s.closed:
            raise SessionLost("unknown or closed session (open a new one)")
        s.touch()
        return s

    def _client_key(self, context: grpc.ServicerContext) -> str:
        return client_key(context, server_port=self.port)

    def _forget(self, s: Session) -> None:
        with self._lock:
            if self._sessions.pop(s.id, None) is not None:
                key = self._owner.pop(s.id, None)
                if key is not None:
                    left = self._per_client.get(key, 1) - 1
                    if left > 0:
                        self._per_client[key] = left
                    else:
                        self._per_client.pop(key, None)
            n = len(self._sessions)
        if self.metrics is not None:
            self.metrics.sessions.set(n)

    def sessions(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def busy(self) -> int:
        """Transfers scheduled or running plus writes awaiting their commit."""
        return sum(s.active + (1 if s.pending is not None else 0) for s in self.sessions())

    def close_all(self, reason: str) -> None:
        for s in self.sessions():
            s.close(reason)

    def reap(self, idle_timeout: float) -> None:
        now = time.monotonic()
        for s in self.sessions():
            p = s.pending
            if p is not None and p.shm_op and p.deadline is not None and now > p.deadline:
                # a client that reserved a slot in shared memory and neither committed nor went away
                s.close(f"shared-memory {p.shm_op} not committed within its timeout")
            elif now - s.last_used > idle_timeout and s.active == 0 and p is None:
                s.close(f"idle for more than {idle_timeout:.0f}s")

    def _addresses(self, first: str) -> list[types_pb2.TransportAddress]:
        order = [first] + [k for k in self.listeners if k != first]
        out = []
        for kind in order:
            host, port = self.listeners[kind].address
            out.append(types_pb2.TransportAddress(kind=kind, host=host, port=port))
        return out

    @_rpc("OpenSession", new_work=True)
    def OpenSession(self, request: store_pb2.OpenSessionRequest, context: grpc.ServicerContext) -> Any:
        if request.protocol_version not in (0, PROTOCOL_VERSION):
            raise errors.VersionMismatchError(
                f"client speaks store protocol v{request.protocol_version}, this server v{PROTOCOL_VERSION}"
            )
        want = request.transport or "auto"
        if want == "auto":
            kind = self.primary
            if (
                "ucx" in self.listeners
                and request.host_id
                and request.host_id == host_id()
                and auto_preference() != "tcp"
            ):
                kind = "ucx"  # same machine and IPC namespace: shared memory / cma / cuda_ipc beat a socket
        elif want in self.listeners:
            kind = want
        else:
            raise errors.ConfigError(
                f"this server has no {want!r} data listener (it offers {', '.join(self.listeners)})"
            )
        client = request.client[:128]
        data_requests = min(request.data_requests, self.data_requests)
        # Shared memory rides on data-plane requests; offered when this daemon keeps its slots there.
        shm_version = min(request.shm, self.shm_version) if data_requests and self.store.shm is not None else 0
        handler = None
        charged = 0
        if data_requests:
            # the request thread's buffers (two, a third with shared memory) count against --max-bytes; where
            # they do not fit the session goes without data-plane requests (the gRPC calls, no buffers of its own)

            need = (3 if shm_version else 2) * MAX_REQUEST_BYTES
            try:
                self.store.charge(need, "a session's request buffers", buffers=True)
                charged = need
            except errors.ResourceExhaustedError as exc:
                log.info("session without data-plane requests: %s", exc)
                data_requests = shm_version = 0
        if data_requests:
            if self._data_handler is None:
                from tensorwire.serve.daemon.datapath import DataRequests

                self._data_handler = DataRequests(self)
            handler = self._data_handler
        owner = self._client_key(context)
        with self._lock:
            if len(self._sessions) >= self.config.max_sessions:
                if charged:
                    self.store.uncharge(charged, buffers=True)
                raise errors.ResourceExhaustedError(
                    f"the server holds the maximum of {self.config.max_sessions} sessions"
                )
            cap = self.config.max_sessions_per_client
            if self._per_client.get(owner, 0) >= cap:
                raise errors.ResourceExhaustedError(
                    f"this client ({owner}) holds the maximum of {cap} sessions per client "
                    f"(--max-sessions-per-client): close one (a tw.Client holds one) or raise the cap"
                )
            sid = secrets.token_hex(SESSION_ID_LEN // 2)
            nonce = new_nonce()
            s = Session(
                sid,
                nonce,
                self.listeners[kind],
                connect_timeout=self.connect_timeout,
                metrics=self.metrics,
                on_close=self._forget,
                client=client,
                handler=handler,
                store=self.store,
                charged=charged,
            )
            self._sessions[sid] = s
            self._owner[sid] = owner
            self._per_client[owner] = self._per_client.get(owner, 0) + 1
            n = len(self._sessions)
        if self.metrics is not None:
            self.metrics.sessions.set(n)
        hello = ""
        if shm_version:
            try:
                s.shm_version = shm_version
                hello = s.offer_shm(self.store.shm)
            except ShmError as exc:
                log.debug("session %s: no shared memory offered: %s", sid[:8], exc)
                shm_version = 0
        log.info(
            "session %s opened (%s%s%s, client %r, peer %s as %s)",
            sid[:8],
            kind,
            ", data-plane requests" if data_requests else "",
            ", shared memory offered" if shm_version else "",
            client,
            context.peer(),
            owner,
        )
        return store_pb2.OpenSessionResponse(
            session_id=sid,
            nonce=nonce,
            data=self._addresses(kind),
            protocol_version=PROTOCOL_VERSION,
            max_bytes=self.store.max_bytes,
            max_index_rows=MAX_INDEX_ROWS,
            max_rows_bytes=MAX_ROWS_BYTES,
            data_requests=data_requests,
            shm=shm_version,
            shm_hello=hello,
            layouts=1,
        )

    @_rpc("CloseSession")
    def CloseSession(self, request: store_pb2.CloseSessionRequest, context: grpc.ServicerContext) -> Any:
        try:
            s = self._session(request.session_id)
        except SessionLost:
            return store_pb2.CloseSessionResponse()
        s.close("closed by client")
        return store_pb2.CloseSessionResponse()

    # -- declarations -------------------------------------------------------------------
    @_rpc("Declare", new_work=True)
    def Declare(self, request: store_pb2.DeclareRequest, context: grpc.ServicerContext) -> Any:
        spec = normalise_spec(spec_from_proto(request.spec))
        e, created = self.store.declare(spec, layout=ShardLayout.from_field(request))
        return store_pb2.DeclareResponse(info=_info_proto(e.info()), created=created)

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

    @_rpc("BeginPut", new_work=True)
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

    @_rpc("PutRows", new_work=True)
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

    @_rpc("CommitPut")
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
        return store_pb2.CommitPutResponse(info=_info_proto(info))

    @_rpc("AbortPut")
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

    @_rpc("Get", new_work=True)
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

    @_rpc("GetRows", new_work=True)
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

    # -- names ----------------------------------------------------------------------------------
    @_rpc("List")
    def List(self, request: store_pb2.ListRequest, context: grpc.ServicerContext) -> Any:
        size = request.page_size or LIST_PAGE
        size = max(1, min(size, LIST_PAGE))
        if len(request.page_token) > MAX_NAME_LEN:
            raise errors.SpecError("bad page token")
        entries, nxt = self.store.names_after(request.page_token, size)
        return store_pb2.ListResponse(tensors=[_info_proto(e.info()) for e in entries], next_page_token=nxt)

    @_rpc("Stat")
    def Stat(self, request: store_pb2.StatRequest, context: grpc.ServicerContext) -> Any:
        e: Entry = self.store.get(_name(request.name))
        return store_pb2.StatResponse(info=_info_proto(e.info()))

    @_rpc("Delete", new_work=True)
    def Delete(self, request: store_pb2.DeleteRequest, context: grpc.ServicerContext) -> Any:
        name = _name(request.name)
        if request.HasField("layout"):  # a sharded client deletes its own shards only
            self.store.check_layout(name, ShardLayout.from_field(request))
        self.store.delete(name)
        return store_pb2.DeleteResponse()

    @_rpc("Snapshot", new_work=True)
    def Snapshot(self, request: store_pb2.SnapshotRequest, context: grpc.ServicerContext) -> Any:
        res = self.snapshot()
        return store_pb2.SnapshotResponse(path=res.path, tensors=res.tensors, nbytes=res.nbytes, seconds=res.seconds)

    def snapshot(self):
        """Write the snapshot now. A failure is raised (and counted, and logged as an ERROR), never swallowed.

        Raises:
            ConfigError: no ``--snapshot-dir``.
            SnapshotError: the snapshot was not written; the previous one is unchanged.
        """
        if not self.config.snapshot_dir:
            raise errors.ConfigError("this server has no --snapshot-dir")
        with self._snapshot_lock:
            try:
                res = write_snapshot(self.store, self.config.snapshot_dir)
            except (errors.TensorWireError, OSError) as exc:
                if self.metrics is not None:
                    self.metrics.snapshots.labels("error").inc()
                log.error("snapshot to %s failed: %s", self.config.snapshot_dir, exc)
                if isinstance(exc, OSError):
                    raise errors.SnapshotError(f"snapshot to {self.config.snapshot_dir} failed: {exc}") from exc
                raise
        if self.metrics is not None:
            self.metrics.snapshots.labels("ok").inc()
        return res


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Rejects every call that does not carry ``authorization: Bearer <token>``.

    The comparison is constant-time (:func:`hmac.compare_digest`). The
    standard health service stays open (probes carry no credentials; it
    reveals nothing but SERVING/NOT_SERVING).
    """

    OPEN_PREFIXES = ("/grpc.health.v1.Health/",)

    def __init__(self, token: str, metrics: "Metrics | None" = None) -> None:
        if not token:
            raise errors.ConfigError("empty token")
        self._expected = b"Bearer " + token.encode("utf-8")
        self._metrics = metrics

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.set_trailing_metadata(((ERROR_KEY, "AuthError"),))
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        method = handler_call_details.method or ""
        if method.startswith(self.OPEN_PREFIXES):
            return continuation(handler_call_details)
        presented = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_KEY:
                presented = value.encode("utf-8", "replace") if isinstance(value, str) else bytes(value)
                break
        if hmac.compare_digest(presented, self._expected):
            return continuation(handler_call_details)
        if self._metrics is not None:
            self._metrics.errors.labels("AuthError").inc()
            self._metrics.operations.labels(method.rsplit("/", 1)[-1][:32], "UNAUTHENTICATED").inc()
        log.warning("rejected %s: missing or wrong token", method[:80])
        return self._deny
