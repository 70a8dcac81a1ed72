"""The ``tensorwire.v1.Store`` gRPC servicer: sessions, declarations, names and snapshots.

Every handler validates its request completely before it reserves, pins or
allocates anything, and before it schedules a transfer: an error reported to
the client (with the ``tw-error`` trailing metadata naming its class, see
:func:`~tensorwire.serve.daemon.rpc.rpc`) means nothing was scheduled and nothing
changed.

The calls that move bytes (Get / GetRows / BeginPut / PutRows / CommitPut /
AbortPut) are the :class:`~tensorwire.serve.daemon.transfers.TransferCalls` part of
:class:`StoreService`. The validation of the row operations
(:func:`~tensorwire.serve.daemon.ops.plan_rows`,
:func:`~tensorwire.serve.daemon.ops.plan_row_update`) and their commit
(:func:`~tensorwire.serve.daemon.ops.commit_rows`) are shared with the data-plane
requests (:mod:`tensorwire.serve.daemon.datapath`), which a session whose client
and server both speak them (``data_requests`` in OpenSession) uses instead of
those calls. The token check is :class:`~tensorwire.serve.daemon.auth.TokenAuthInterceptor`.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import TYPE_CHECKING, Any

import grpc

from tensorwire import errors
from tensorwire._proto import spec_from_proto
from tensorwire.settings import setting
from tensorwire.spec import MAX_NAME_LEN
from tensorwire.transport.select import auto_preference, host_id
from tensorwire.transport.base import new_nonce
from tensorwire.v1 import store_pb2, store_pb2_grpc, types_pb2
from tensorwire.serve.protocol.common import (
    DATA_REQUESTS_LEVEL,
    LIST_PAGE,
    MAX_INDEX_ROWS,
    MAX_ROWS_BYTES,
    PROTOCOL_VERSION,
    SESSION_ID_LEN,
    SessionLost,
)
from tensorwire.serve.protocol.layout import ShardLayout
from tensorwire.serve.daemon.ops import status_of
from tensorwire.serve.daemon.ops import check_tensor_name as _name
from tensorwire.serve.daemon.peers import client_key
from tensorwire.serve.daemon.session import Session
from tensorwire.serve.daemon.entry import Entry
from tensorwire.serve.daemon.store import Store, normalise_spec
from tensorwire.serve.protocol.shm import SHM_VERSION, ShmError
from tensorwire.serve.daemon.snapshot import write_snapshot
from tensorwire.serve.daemon.limits import WaitGate
from tensorwire.serve.protocol.wire import MAX_REQUEST_BYTES
from tensorwire.serve.daemon.auth import TokenAuthInterceptor
from tensorwire.serve.daemon.datapath import DataRequests
from tensorwire.serve.daemon.rpc import info_proto, rpc
from tensorwire.serve.daemon.transfers import TransferCalls

if TYPE_CHECKING:  # pragma: no cover
    from tensorwire.transport.base import Listener
    from tensorwire.serve.daemon.config import ServeConfig
    from tensorwire.serve.daemon.metrics import Metrics

__all__ = ["StoreService", "TokenAuthInterceptor", "status_of"]

log = logging.getLogger(__name__)


class StoreService(TransferCalls, store_pb2_grpc.StoreServicer):
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
        #: TENSORWIRE_SERVE_SPIN_US, read once (a bad value stops the start, not a session later)
        self.spin_us: float = setting("serve_spin_us")
        self.default_timeout = default_timeout
        self.draining = False
        #: The data-plane requests sessions may use (tensorwire.serve.protocol.common.DATA_REQUESTS_LEVEL); 0 = none
        #: (gRPC calls only).
        self.data_requests = DATA_REQUESTS_LEVEL
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

    @rpc("OpenSession", new_work=True)
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
                spin_us=self.spin_us,
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

    @rpc("CloseSession")
    def CloseSession(self, request: store_pb2.CloseSessionRequest, context: grpc.ServicerContext) -> Any:
        try:
            s = self._session(request.session_id)
        except SessionLost:
            return store_pb2.CloseSessionResponse()
        s.close("closed by client")
        return store_pb2.CloseSessionResponse()

    # -- declarations -------------------------------------------------------------------
    @rpc("Declare", new_work=True)
    def Declare(self, request: store_pb2.DeclareRequest, context: grpc.ServicerContext) -> Any:
        spec = normalise_spec(spec_from_proto(request.spec))
        e, created = self.store.declare(spec, layout=ShardLayout.from_field(request))
        return store_pb2.DeclareResponse(info=info_proto(e.info()), created=created)

    # -- names ----------------------------------------------------------------------------------
    @rpc("List")
    def List(self, request: store_pb2.ListRequest, context: grpc.ServicerContext) -> Any:
        size = request.page_size or LIST_PAGE
        size = max(1, min(size, LIST_PAGE))
        if len(request.page_token) > MAX_NAME_LEN:
            raise errors.SpecError("bad page token")
        entries, nxt = self.store.names_after(request.page_token, size)
        return store_pb2.ListResponse(tensors=[info_proto(e.info()) for e in entries], next_page_token=nxt)

    @rpc("Stat")
    def Stat(self, request: store_pb2.StatRequest, context: grpc.ServicerContext) -> Any:
        e: Entry = self.store.get(_name(request.name))
        return store_pb2.StatResponse(info=info_proto(e.info()))

    @rpc("Delete", new_work=True)
    def Delete(self, request: store_pb2.DeleteRequest, context: grpc.ServicerContext) -> Any:
        name = _name(request.name)
        if request.HasField("layout"):  # a sharded client deletes its own shards only
            self.store.check_layout(name, ShardLayout.from_field(request))
        self.store.delete(name)
        return store_pb2.DeleteResponse()

    @rpc("Snapshot", new_work=True)
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
