"""A client's session with one daemon, and how it is opened.

:func:`open_session` asks the daemon for a session (OpenSession), connects
its data listener (UCX or TCP; ``auto`` falls back from UCX to TCP with a
WARNING once), proves shared memory when both sides offer it, and returns
the one path object the session's hot operations go through:

- :class:`~tensorwire.serve.client.shm_path.ShmPath`: data-plane requests,
  the bytes through shared memory (a daemon on this host);
- :class:`~tensorwire.serve.client.request_path.RequestPath`: data-plane
  requests, the bytes on the data connection;
- :class:`~tensorwire.serve.client.grpc_path.GrpcPath`: gRPC calls per
  operation (an older daemon, or ``data_requests=False``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from tensorwire.errors import ConfigError, ProtocolError, TensorWireError
from tensorwire.settings import setting
from tensorwire.serve.client.context import ClientContext, Progress, warn_once
from tensorwire.serve.client.grpc_path import GrpcPath
from tensorwire.serve.client.request_path import RequestPath
from tensorwire.serve.client import shm_maps
from tensorwire.serve.client.shm_path import ShmMemory, ShmPath
from tensorwire.serve.protocol.common import DATA_REQUESTS_LEVEL, POSTED_READS, PROTOCOL_VERSION
from tensorwire.serve.protocol import shm, wire
from tensorwire.serve.protocol.shm import LEASE_VERSION, SHM_VERSION
from tensorwire.transport.base import get_factory
from tensorwire.transport.select import host_id

if TYPE_CHECKING:  # pragma: no cover
    from tensorwire.transport.base import Transport

__all__ = ["Session", "Path", "open_session", "prove_shm"]

log = logging.getLogger(__name__)

#: The path object of a session (what :meth:`Client._run` hands each operation).
Path = GrpcPath | RequestPath


class Session:
    """One open session: its id, data connection (``kind``: ``ucx`` or ``tcp``) and what the daemon offers."""

    __slots__ = ("sid", "transport", "kind", "layouts", "requests", "posted_reads", "closed")

    def __init__(
        self, sid: str, transport: "Transport", kind: str, *, layouts: bool, requests: bool, posted_reads: bool = False
    ) -> None:
        self.sid = sid
        self.transport = transport
        self.kind = kind
        #: The daemon records and checks shard layouts.
        self.layouts = layouts
        #: The daemon takes data-plane requests on this session.
        self.requests = requests
        #: ... and reads whose payload receive is posted before the request (``wire.FLAG_POSTED``).
        self.posted_reads = posted_reads
        self.closed = False

    def close(self, ctx: ClientContext) -> None:
        """CloseSession (best effort) and abort the data connection. Idempotent."""
        if self.closed:
            return
        self.closed = True
        ctx.close_remote(self.sid)
        self.transport.abort()


def open_session(
    ctx: ClientContext, *, want: str, want_dp: bool, mem: ShmMemory, deadline: float | None = None
) -> Path:
    """Open a session (see the module docstring) and return its path object.

    Each step waits at most ``connect_timeout``, and all of them end by ``deadline`` (``time.monotonic()``;
    an operation's, when it has to open the session again).

    Raises:
        ConfigError: ``want`` is ``shm`` and shared memory is not available (the message says why), or
            the transport the daemon names cannot be used here.
        AuthError, PeerLostError, ConnectTimeout, ...: from OpenSession or the data connection.
    """
    from tensorwire.v1 import store_pb2

    kinds: list[str]
    if want in ("tcp", "ucx"):
        kinds = [want]
    else:
        try:
            get_factory("ucx")
            kinds = ["auto", "tcp"]
        except ImportError as exc:
            warn_once("ucx-import", "transport auto: UCX is not available here (%s); using TCP", exc)
            kinds = ["tcp"]
    last: BaseException | None = None
    pr = Progress(deadline)
    for kind in kinds:
        offer_shm = want in ("auto", "shm") and want_dp and not mem.broken
        req = store_pb2.OpenSessionRequest(
            protocol_version=PROTOCOL_VERSION,
            transport=kind,
            client=ctx.name,
            host_id=host_id(),
            data_requests=DATA_REQUESTS_LEVEL if want_dp else 0,
            shm=(SHM_VERSION if mem.use_ahead else LEASE_VERSION) if offer_shm else 0,
            layouts=1,
        )
        resp = ctx.rpc("OpenSession", req, timeout=min(ctx.connect_timeout, pr.left(ctx.connect_timeout)))
        if not resp.data:
            raise ProtocolError("the server offered no data listener")
        addr = resp.data[0]
        host = addr.host
        if host in ("0.0.0.0", "::", ""):
            host = ctx.host
        try:
            t = get_factory(addr.kind).connect(
                host, addr.port, resp.nonce, timeout=min(ctx.connect_timeout, pr.left(ctx.connect_timeout))
            )
        except (ImportError, TensorWireError, OSError) as exc:
            ctx.close_remote(resp.session_id)
            if kind == "auto" and addr.kind == "ucx":
                warn_once("ucx-connect", "transport auto: UCX did not connect (%s); using TCP", exc)
                last = exc
                continue
            if isinstance(exc, ImportError):
                raise ConfigError(f"transport {addr.kind!r} is not available here: {exc}") from exc
            raise
        spin = setting("serve_spin_us") if addr.kind == "tcp" else 0.0
        if spin:
            t.set_spin(spin)
        if want == "auto" and kind == "auto" and all(d.kind != "ucx" for d in resp.data):
            warn_once("ucx-server", "transport auto: the server offers no UCX; using TCP")
        session = Session(
            resp.session_id,
            t,
            addr.kind,
            layouts=resp.layouts >= 1,
            requests=want_dp and resp.data_requests >= 1,
            posted_reads=want_dp and resp.data_requests >= POSTED_READS,
        )
        path = _path_of(ctx, session, mem, resp, offer_shm=offer_shm, pr=pr)
        if want == "shm" and not isinstance(path, ShmPath):
            path.close()
            raise ConfigError(f"transport='shm': shared memory with the daemon is not available: {mem.why}")
        log.debug("session %s open over %s%s", session.sid[:8], t.describe(), " + shared memory" if path.shm else "")
        return path
    raise last if last is not None else ProtocolError("no usable data transport")  # pragma: no cover


def _path_of(ctx: ClientContext, session: Session, mem: ShmMemory, resp: Any, *, offer_shm: bool, pr: Progress) -> Path:
    """The path object of a session the daemon opened (``resp``: its OpenSessionResponse)."""
    if mem.broken:
        pass  # the reason stays
    elif not offer_shm:
        mem.why = mem.why or "data_requests=False (shared memory rides on data-plane requests)"
    elif not (session.requests and resp.shm >= 1 and resp.shm_hello):
        mem.why = "the daemon offers no shared memory (--no-shm, an older daemon, or /dev/shm unusable there)"
    else:
        path = RequestPath(ctx, session)
        try:
            shm_path = prove_shm(path, mem, resp.shm_hello, resp.shm, pr.deadline)
        except BaseException:
            path.close()
            raise
        return shm_path if shm_path is not None else path
    return RequestPath(ctx, session) if session.requests else GrpcPath(ctx, session)


def prove_shm(
    base: RequestPath, mem: ShmMemory, hello: str, version: int, deadline: float | None = None
) -> ShmPath | None:
    """Prove to the daemon that this process maps its memory (read the hello region's nonce, echo it), and
    return the session's :class:`~tensorwire.serve.client.shm_path.ShmPath` over ``base`` (its request path).

    ``version``: the shared-memory protocol version the session negotiated. None (``mem.why`` says
    why): not reachable from here, or refused; the session goes on over its data connection.

    Raises:
        TensorWireError: the connection failed (the caller drops the session).
    """
    try:
        nonce = shm_maps.read_hello(hello)
    except shm.ShmError as exc:
        log.debug(
            "shared memory: the daemon's region is not reachable from this process (%s); using the data connection",
            exc,
        )
        mem.why = f"the daemon's shared memory is not reachable from this process ({exc})"
        return None
    pr = Progress(deadline)
    try:
        ok = base.call(pr, wire.OP_SHM_HELLO, nonce.hex())
    except TensorWireError as exc:
        if pr.lost is not None:
            raise
        log.debug("shared memory: the daemon refused the proof (%s); using the data connection", exc)
        mem.why = f"the daemon refused the shared-memory proof ({exc})"
        return None
    mem.why = ""
    path = ShmPath(base, mem)
    leases = bool(ok.message) and mem.use_leases
    if not (leases or (mem.use_ahead and version >= shm.AHEAD_VERSION)):
        return path
    try:
        path.page = shm_maps.SessionPage(hello)
    except shm.ShmError as exc:
        log.debug("shared memory: no read leases or write-ahead grants (the session page: %s)", exc)
        return path
    if leases:
        try:
            path.lease_tab = shm_maps.LeaseTable(ok.message)
        except shm.ShmError as exc:
            log.debug("shared memory: no read leases (%s)", exc)
    return path
