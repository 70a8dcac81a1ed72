"""``Client``: talk to a ``tensorwire serve`` daemon.

::

    import tensorwire as tw

    with tw.Client("127.0.0.1:7100") as c:
        c.put("weights", torch.randn(1024, 256))
        w = c.get("weights")                      # the whole tensor, one version
        rows = c.get_rows("weights", [3, 17, 99])  # only these rows travel
        c.add_rows("weights", [3, 17], torch.ones(2, 256))

Control calls go over gRPC (small messages only); tensor bytes go over the
session's data transport (UCX or TCP) straight into preallocated buffers: the
daemon's slots on a put, this client's per-name receive buffers on a get.

Data-plane requests: when the daemon supports them (``data_requests`` in
OpenSession; ``tensorwire serve`` since request format 1), get,
get_rows, put, put_rows and add_rows make no gRPC call at all once the session
is open: each is a small binary request on the session's data connection
(format: :mod:`tensorwire.serve.protocol.wire`), answered by a fixed-size reply and
followed by the tensor bytes. With an older daemon, or ``data_requests=False``,
they use the gRPC calls (Get, GetRows, BeginPut/PutRows + CommitPut) as before.
The errors are the same either way.

Shared memory: with a daemon on the same host (``tensorwire serve`` with
``--shm``, the default), ``transport="auto"`` offers shared memory when it
opens a session; the daemon names a region it created under ``/dev/shm``, this
client maps it and echoes the nonce it holds over the data connection, and
from then on the hot operations move their bytes with one copy in this
process: ``get`` copies the pinned version out of the daemon's slot,
``get_rows`` gathers the rows from it (no index is sent, no second copy),
``put`` copies into the staging slot the daemon reserved, and ``put_rows`` /
``add_rows`` into the session's scratch region (numpy copies: no OpenMP team;
big ones split with one helper thread unless the machine is oversubscribed, see
:class:`tensorwire.serve.protocol.shm.Copier`). Each operation still is a data-plane
request (the daemon pins, reserves, commits, validates), so the guarantees
below are the same; a read's pin goes back with the next request, or with a
RELEASE a helper thread sends once the client has been idle for 2 ms. A read
also hands the client a *read lease* (x86 only; ``TENSORWIRE_SHM_LEASES=0``
turns leases off): until a writer or the daemon's exit changes the tensor's
generation in the daemon's lease table, the next get / get_rows of it reads
the same slot with no request at all, checking the generation before and
after its copy (:class:`tensorwire.serve.protocol.shm.Leases`); ``lease_reads`` counts
them. A client
that cannot map the region (another host, container or uid) uses the data
connection without a word (debug log); ``transport="shm"`` makes that an error
instead. ``data_path`` says which one a client uses, ``shm_bytes`` counts what
went through shared memory.

Buffers: ``get`` returns a tensor backed by a per-name receive buffer that is
reused by later gets **only once you no longer hold any reference to it**
(checked through the storage's use count), so a loop ``x = c.get(name)``
allocates nothing after its second iteration and a tensor you keep is never
overwritten. ``out=`` receives straight into your tensor when it is a
contiguous CPU tensor (else through the buffer plus one copy). CUDA tensors
are staged through pinned host memory.

Many daemons: ``Client(["h1:7100", "h2:7100", "h3:7100"])`` or
``Client("dns:///name:7100")`` returns a
:class:`tensorwire.serve.client.sharded_client.ShardedClient` (the same methods, over
all of them: whole tensors placed by rendezvous hashing, ``put(name, t,
shard="rows")`` for tables sharded by rows); a one-element list or a plain
address is this class, as before.

Errors are :class:`tensorwire.TensorWireError` subclasses: ``AuthError`` (token,
TLS), ``NotFoundError``, ``ShapeMismatchError`` (naming both specs),
``ResourceExhaustedError`` (``--max-bytes``), ``PeerLostError`` (server gone),
``TransferTimeout``, ``ClosedError`` (used after ``close()``).
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from tensorwire.errors import (
    ClosedError,
    ConfigError,
    NotFoundError,
    PeerLostError,
    ProtocolError,
    ShapeMismatchError,
    SpecError,
    TensorWireError,
    TransportError,
)
from tensorwire.serve.protocol import wire
from tensorwire.serve.protocol.tls import TLSConfig
from tensorwire.serve.protocol.layout import ShardLayout
from tensorwire.serve.protocol.common import (
    AUTH_KEY,
    DATA_REQUESTS_VERSION,
    ERROR_CLASSES,
    MAX_INDEX_ROWS,
    MAX_MESSAGE_BYTES,
    MAX_ROWS_BYTES,
    PROTOCOL_VERSION,
    TAG_DOWN,
    TAG_REPLY,
    TAG_REQUEST,
    TAG_UP,
    Busy,
    SessionLost,
    as_index,
    encode_index,
    error_name,
    rpc_error,
)
from tensorwire._proto import spec_from_proto, spec_to_proto
from tensorwire.serve.client.common import SnapshotInfo, TensorStat, parse_address
from tensorwire.serve.client.sharded_client import ShardedClient
from tensorwire.serve.client.window import ShardView
from tensorwire.settings import setting
from tensorwire.spec import TensorSpec, check_name
from tensorwire.serve.protocol.shm import LEASE_MACHINES, LEASE_VERSION, SHM_VERSION
from tensorwire.buffers import as_bytes, allocate_host
from tensorwire.transport.base import get_factory
from tensorwire.serve.protocol import shm
from tensorwire.transport.select import host_id

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.transport.base import Transport

__all__ = ["Client", "TensorStat", "SnapshotInfo", "TLSConfig"]

log = logging.getLogger(__name__)

_TRANSPORTS = ("auto", "shm", "ucx", "tcp")
_warned: set[str] = set()
_warn_lock = threading.Lock()


def _warn_once(key: str, msg: str, *args: Any) -> None:
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning(msg, *args)


def _stat(info: Any) -> TensorStat:
    return TensorStat(spec_from_proto(info.spec), int(info.version), int(info.nbytes), ShardLayout.from_field(info))


def _use_count(t: "torch.Tensor") -> int | None:
    import torch

    fn = getattr(torch._C, "_storage_Use_Count", None)
    if fn is None:  # pragma: no cover - a torch without it: never reuse
        return None
    return int(fn(t.untyped_storage()._cdata))


class _Pool:
    """Reusable host buffers for one name; a buffer is reused only when nobody else references it."""

    KEEP = 2

    def __init__(self, *, round_up: bool = False) -> None:
        self._bufs: list[tuple["torch.Tensor", int | None]] = []
        self._round_up = round_up
        self.allocations = 0

    def acquire(self, nbytes: int) -> "torch.Tensor":
        for raw, base in self._bufs:
            if raw.numel() >= nbytes and base is not None and _use_count(raw) == base:
                return raw[:nbytes]
        cap = nbytes
        if self._round_up and nbytes > 4096:
            cap = 1 << (nbytes - 1).bit_length()
        new = allocate_host(cap)
        self.allocations += 1
        entry = (new, _use_count(new))
        if len(self._bufs) < self.KEEP:
            self._bufs.append(entry)
        else:
            # replace a free buffer that was too small, if any; else this one is not pooled
            for i, (raw, base) in enumerate(self._bufs):
                if base is not None and _use_count(raw) == base:
                    self._bufs[i] = entry
                    break
        return new[:nbytes]


def _typed(raw: "torch.Tensor", dtype: "torch.dtype", shape: tuple[int, ...]) -> "torch.Tensor":
    import torch

    if raw.numel() == 0:
        return torch.empty(shape, dtype=dtype)
    return raw.view(dtype).view(shape)


#: A chunked read keeps at most this many receives posted ahead of the one it waits for.
_RECV_WINDOW = 8
#: Shared memory: the read pin of the last get / get_rows goes back to the daemon with this client's next
#: request; a client idle this long sends a RELEASE of its own (from a helper thread), so a writer waits
#: at most about this long for an idle reader. Measured on the 2-core VM: a RELEASE per read cost the
#: client ~40 us and the daemon ~60 us before it answered the next request.
_RELEASE_AFTER = 0.002
#: What :meth:`Client._lease_read` returns when the lease cannot serve the read.
_MISS = object()
#: ``TENSORWIRE_SHM_LEASES=0`` turns read leases off (every shared-memory read asks the daemon).
LEASES_ENV = "TENSORWIRE_SHM_LEASES"


#: ``TENSORWIRE_SHM_AHEAD=0`` turns write-ahead grants off (every shared-memory put reserves its slot first).
AHEAD_ENV = "TENSORWIRE_SHM_AHEAD"


def _ahead_wanted() -> bool:
    return bool(setting("shm_ahead"))


def _leases_wanted() -> bool:
    import platform

    if not setting("shm_leases"):
        return False
    return platform.machine().lower() in LEASE_MACHINES


class _Progress:
    """How far a data-plane operation got: ``lost`` (the connection failed), ``sent`` (a write may commit)."""

    __slots__ = ("lost", "sent")

    def __init__(self) -> None:
        self.lost: BaseException | None = None
        self.sent = False


#: Data-plane requests that carry the expected shard layout of their tensor (see Client.expect_layout).
_LAYOUT_OPS = frozenset((wire.OP_GET, wire.OP_GET_ROWS, wire.OP_PUT, wire.OP_PUT_ROWS, wire.OP_ADD_ROWS))


def _many(address: Any) -> bool:
    """Whether ``address`` names several daemons (a list of more than one, or ``dns:///``)."""
    if isinstance(address, (list, tuple)):
        return len(address) > 1
    return isinstance(address, str) and address.strip().startswith("dns:")


def _reply_spec(name: str, rep: "wire.Reply") -> TensorSpec:
    return TensorSpec(name, rep.shape, wire.dtype_name(rep.dtype))


def _as_bytes(t: "torch.Tensor") -> "torch.Tensor":
    return as_bytes(t)


class Client:
    """A connection to a ``tensorwire serve`` daemon. See the module docstring.

    Args:
        address: ``host:port`` of the daemon's control plane.
        token: bearer token (the content of the daemon's ``--token-file``).
        tls: :class:`TLSConfig` or a dict with ``ca``, ``cert``, ``key``
            (``server_name``); ``True`` for TLS with the system roots.
        transport: ``auto`` (shared memory with a daemon on this host that
            offers it; the data connection is UCX when the daemon offers it and
            it imports and connects here, else TCP with a logged WARNING),
            ``shm`` (shared memory or a ConfigError), ``ucx`` or ``tcp`` (that
            socket, no shared memory).
        timeout: seconds for each operation (control call and transfer).
        connect_timeout: seconds to reach the daemon and connect the data plane.
        data_requests: send get / get_rows / put / put_rows / add_rows as
            data-plane requests when the daemon supports them (no gRPC call per
            operation); False: always use the gRPC calls.

    Raises:
        AuthError: wrong or missing token, TLS mismatch.
        PeerLostError / ConnectTimeout: the daemon is not reachable.

    A client is thread-safe; its operations run one at a time (use one client
    per thread for parallel transfers: each has its own data connection).

    ``address`` may also be a list of daemons or ``"dns:///name:port"`` (every
    address of a headless Service): the result is then a
    :class:`~tensorwire.serve.client.sharded_client.ShardedClient` over all of them
    (same arguments); a one-element list is one daemon, as a plain address.
    """

    def __new__(cls, address: Any = None, **kwargs: Any) -> Any:
        if cls is Client and _many(address):
            return ShardedClient(address, single=cls, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        tls: "TLSConfig | Mapping[str, Any] | bool | None" = None,
        transport: str = "auto",
        timeout: float = 60.0,
        connect_timeout: float = 10.0,
        name: str = "",
        data_requests: bool = True,
    ) -> None:
        import grpc

        from tensorwire.v1 import store_pb2_grpc

        if transport not in _TRANSPORTS:
            raise ConfigError(f"transport must be one of {', '.join(_TRANSPORTS)}, got {transport!r}")
        if not timeout or timeout <= 0:
            raise ConfigError("timeout must be positive")
        if token is not None and (not isinstance(token, str) or not token.strip()):
            raise ConfigError("token must be a non-empty string")
        if isinstance(address, (list, tuple)) and len(address) == 1:
            address = address[0]
        self._host, self._port = parse_address(address)
        self.address = f"[{self._host}]:{self._port}" if ":" in self._host else f"{self._host}:{self._port}"
        self._tls = TLSConfig.coerce(tls)
        self._want = transport
        self._timeout = float(timeout)
        self._connect_timeout = float(connect_timeout)
        self._name = name[:128]
        self._md = ((AUTH_KEY, f"Bearer {token.strip()}"),) if token else ()
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # a daemon that restarts is reached again within ~2 s of being back (gRPC's default backoff
            # grows to 120 s, during which every call fails at once)
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        if self._tls is not None:
            ca, key, cert = self._tls.read()
            creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
            if self._tls.server_name:
                options.append(("grpc.ssl_target_name_override", self._tls.server_name))
            self._channel = grpc.secure_channel(self.address, creds, options=options)
        else:
            self._channel = grpc.insecure_channel(self.address, options=options)
        self._stub = store_pb2_grpc.StoreStub(self._channel)
        self._lock = threading.RLock()
        self._closed = False
        self._sid: str | None = None
        self._transport: "Transport | None" = None
        self.transport_kind: str | None = None
        self._specs: dict[str, TensorSpec] = {}
        self._pools: dict[tuple[str, str], _Pool] = {}
        self._want_dp = bool(data_requests)
        #: Shard layouts this client expects of names (sent with their requests; absent: a whole tensor).
        self._expect: dict[str, ShardLayout] = {}
        self._expect_pb: dict[str, Any] = {}
        self._expect_packed: dict[str, bytes] = {}
        #: Whether the daemon records and checks shard layouts (OpenSessionResponse.layouts).
        self.layout_checks = False
        self._dp = False  # the current session takes data-plane requests
        self._req_id = 0  # requests sent on the current session (tag 4 steps)
        self._replies = 0  # replies received on it (tag 5 steps)
        self._req_buf: "torch.Tensor | None" = None
        self._reply_bufs: "list[torch.Tensor]" = []
        self._replies_posted: "collections.deque[torch.Tensor]" = collections.deque()  # on tag 5, in order
        self._names: dict[str, bytes] = {}
        self._shm = False  # the current session moves bytes through shared memory
        self._shm_why = "" if transport in ("auto", "shm") else f"transport={transport!r} asks for a socket"
        self._shm_broken = False  # a region could not be mapped mid-operation: no more offers
        self._maps: Any = None  # tensorwire.serve.protocol.shm.ClientMaps, made on first use
        self._copier: Any = None  # tensorwire.serve.protocol.shm.Copier, made on first use
        self._regions_of: dict[str, set[str]] = {}  # tensor name -> region names mapped for it
        self._rows_views: dict[str, tuple[tuple[str, int, int], Any]] = {}  # name -> (key, uint8 [rows, row] array)
        # the read pin the daemon holds for this session (see _RELEASE_AFTER), and the helper that releases it
        self._pin: str | None = None
        self._pin_at = 0.0
        self._rel_cond = threading.Condition(threading.Lock())
        self._rel_parked = False
        self._releaser: threading.Thread | None = None
        #: Bytes this client copied through shared memory (all sessions).
        self.shm_bytes = 0
        # read leases (see tensorwire.serve.protocol.shm.Leases): name -> (cell, generation, region, offset, nbytes, spec)
        self._use_leases = _leases_wanted()
        self._leases: dict[str, tuple[int, int, str, int, int, TensorSpec]] = {}
        self._lease_tab: Any = None  # shm.LeaseTable of the current session's daemon
        self._in_lease = False  # a read from a lease is copying (see shm.Copier.take's pool)
        self._page: Any = None  # shm.SessionPage: lease-read counts for the daemon, the write-ahead ticket
        # write-ahead grant (see tensorwire.serve.protocol.shm.PageLock), or None
        self._use_ahead = _ahead_wanted()
        self._ahead: tuple[str, tuple[int, tuple[int, ...]], str, int] | None = (
            None  # name, (dtype, shape), region, ticket
        )
        #: Puts written into a write-ahead grant's slot (one round trip instead of two; all sessions).
        self.ahead_puts = 0
        #: Reads served from a read lease, without a request (all sessions), and leases found stale.
        self.lease_reads = 0
        self.lease_misses = 0
        try:
            self._open_session()
        except BaseException:
            self._channel.close()
            self._closed = True
            raise

    # -- plumbing ------------------------------------------------------------------------------
    def _rpc(self, method: str, request: Any, *, timeout: float | None = None, data_op: bool = False) -> Any:
        import grpc

        timeout = timeout or self._timeout
        deadline = time.monotonic() + timeout
        delay = 0.005
        while True:
            try:
                return getattr(self._stub, method)(
                    request, timeout=max(0.01, deadline - time.monotonic()), metadata=self._md
                )
            except grpc.RpcError as exc:
                err = rpc_error(exc, method, tls=self._tls is not None, connecting=method == "OpenSession")
                if isinstance(err, Busy) and deadline - time.monotonic() > delay:
                    # The server did nothing rather than wait for other clients in a control-plane thread.
                    time.sleep(delay)
                    delay = min(delay * 2, 0.2)
                    continue
                if data_op and error_name(exc) is None:
                    # Outcome unknown (deadline, connection lost): the server may have
                    # scheduled a transfer this client will never match. Start afresh.
                    self._drop_session()
                raise err from exc

    def _open_session(self) -> None:
        from tensorwire.v1 import store_pb2

        kinds: list[str]
        if self._want == "tcp":
            kinds = ["tcp"]
        elif self._want == "ucx":
            kinds = ["ucx"]
        else:
            try:
                get_factory("ucx")
                kinds = ["auto", "tcp"]
            except ImportError as exc:
                _warn_once("ucx-import", "transport auto: UCX is not available here (%s); using TCP", exc)
                kinds = ["tcp"]
        last: BaseException | None = None
        for kind in kinds:
            offer_shm = self._want in ("auto", "shm") and self._want_dp and not self._shm_broken
            req = store_pb2.OpenSessionRequest(
                protocol_version=PROTOCOL_VERSION,
                transport=kind,
                client=self._name,
                host_id=host_id(),
                data_requests=DATA_REQUESTS_VERSION if self._want_dp else 0,
                shm=(SHM_VERSION if self._use_ahead else LEASE_VERSION) if offer_shm else 0,
                layouts=1,
            )
            resp = self._rpc("OpenSession", req, timeout=self._connect_timeout + 5)
            if not resp.data:
                raise ProtocolError("the server offered no data listener")
            addr = resp.data[0]
            host = addr.host
            if host in ("0.0.0.0", "::", ""):
                host = self._host
            try:
                factory = get_factory(addr.kind)
                t = factory.connect(host, addr.port, resp.nonce, timeout=self._connect_timeout)
            except (ImportError, TensorWireError, OSError) as exc:
                self._close_remote(resp.session_id)
                if kind == "auto" and addr.kind == "ucx":
                    _warn_once("ucx-connect", "transport auto: UCX did not connect (%s); using TCP", exc)
                    last = exc
                    continue
                if isinstance(exc, ImportError):
                    raise ConfigError(f"transport {addr.kind!r} is not available here: {exc}") from exc
                raise
            if self._want == "auto" and kind == "auto" and all(d.kind != "ucx" for d in resp.data):
                _warn_once("ucx-server", "transport auto: the server offers no UCX; using TCP")
            self._sid = resp.session_id
            self._transport = t
            self.layout_checks = resp.layouts >= 1
            self.transport_kind = addr.kind
            self._dp = self._want_dp and resp.data_requests >= 1
            self._req_id = self._replies = 0
            self._replies_posted.clear()
            self._shm = False
            if self._shm_broken:
                pass  # the reason stays
            elif not offer_shm:
                self._shm_why = self._shm_why or "data_requests=False (shared memory rides on data-plane requests)"
            elif not (self._dp and resp.shm >= 1 and resp.shm_hello):
                self._shm_why = (
                    "the daemon offers no shared memory (--no-shm, an older daemon, or /dev/shm unusable there)"
                )
            else:
                self._shm_hello(t, resp.shm_hello, resp.shm)
            if self._want == "shm" and not self._shm:
                why = self._shm_why
                self._drop_session()
                raise ConfigError(f"transport='shm': shared memory with the daemon is not available: {why}")
            log.debug("session %s open over %s%s", self._sid[:8], t.describe(), " + shared memory" if self._shm else "")
            return
        raise last if last is not None else ProtocolError("no usable data transport")  # pragma: no cover

    def _close_remote(self, sid: str) -> None:
        from tensorwire.v1 import store_pb2

        try:
            self._stub.CloseSession(store_pb2.CloseSessionRequest(session_id=sid), timeout=2.0, metadata=self._md)
        except Exception:  # noqa: BLE001 - best effort
            pass

    def _shm_hello(self, t: "Transport", hello: str, version: int) -> None:
        """Prove to the daemon that this process maps its memory: read the hello region's nonce, echo it.
        ``version``: the shared-memory protocol version the session negotiated."""
        try:
            nonce = shm.read_hello(hello)
        except shm.ShmError as exc:
            log.debug(
                "shared memory: the daemon's region is not reachable from this process (%s); using the data connection",
                exc,
            )
            self._shm_why = f"the daemon's shared memory is not reachable from this process ({exc})"
            return
        pr = _Progress()
        try:
            ok = self._dp_call(t, pr, wire.OP_SHM_HELLO, nonce.hex())
        except TensorWireError as exc:
            if pr.lost is not None:
                self._drop_session()
                raise
            log.debug("shared memory: the daemon refused the proof (%s); using the data connection", exc)
            self._shm_why = f"the daemon refused the shared-memory proof ({exc})"
            return
        self._shm = True
        self._shm_why = ""
        leases = bool(ok.message) and self._use_leases
        if not (leases or (self._use_ahead and version >= shm.AHEAD_VERSION)):
            return
        try:
            self._page = shm.SessionPage(hello)
        except shm.ShmError as exc:
            log.debug("shared memory: no read leases or write-ahead grants (the session page: %s)", exc)
            return
        if leases:
            try:
                self._lease_tab = shm.LeaseTable(ok.message)
            except shm.ShmError as exc:
                log.debug("shared memory: no read leases (%s)", exc)

    @property
    def shm(self) -> bool:
        """Whether the current session moves tensor bytes through shared memory."""
        return self._shm and self._sid is not None

    @property
    def data_path(self) -> str | None:
        """How tensor bytes move: ``"shm"``, or the data connection's kind (``"ucx"``, ``"tcp"``)."""
        return "shm" if self.shm else self.transport_kind

    def _shm_flag(self) -> int:
        return wire.FLAG_SHM if self._shm else 0

    def _shm_view(self, pr: "_Progress", rep: "wire.Reply", name: str) -> "torch.Tensor":
        """The bytes an SHM reply names (a uint8 view of the daemon's region, mapped on first use)."""
        if self._maps is None:
            self._maps = shm.ClientMaps()
            self._copier = shm.Copier()
        try:
            view = self._maps.get(rep.message, rep.chunk, rep.nbytes)
        except shm.ShmError as exc:
            # Mapped once (the proof) but not now: stop using shared memory; the operation runs
            # once more on a new session over the data connection (nothing was read or written).
            self._shm_broken = True
            self._shm_why = f"a region of the daemon could not be mapped ({exc})"
            lost = PeerLostError(f"shared memory: {exc}")
            pr.lost = lost
            raise lost from None
        self._regions_of.setdefault(name, set()).add(rep.message)
        return view

    def _shm_release(self, t: "Transport", name: str) -> None:
        """RELEASE the read pin of the last SHM reply (no reply comes back). Under ``_lock``."""
        nb = self._name_bytes(name)
        size = wire.request_size(len(nb), 0)
        buf = self._request_buffer(size)
        req_id = self._req_id + 1
        wire.pack_request(memoryview(buf.numpy()), op=wire.OP_RELEASE, req_id=req_id, name=nb)
        self._pin = None
        self._req_id = req_id
        t.send(TAG_REQUEST, buf[:size], step=req_id, timeout=self._timeout)

    def _shm_read(
        self, t: "Transport", pr: "_Progress", rep: "wire.Reply", name: str, use: Callable[["torch.Tensor"], Any]
    ) -> Any:
        """Run ``use(bytes)`` on the region an SHM read reply names; its pin goes back with the next request
        (or the helper's RELEASE once this client is idle: :data:`_RELEASE_AFTER`)."""
        view = self._shm_view(pr, rep, name)
        try:
            result = use(view)
            self._keep_lease(name, rep)
            return result
        finally:
            self._hold_pin(name)

    def _keep_lease(self, name: str, rep: "wire.Reply") -> None:
        """Keep the read lease an SHM read reply hands out (if any)."""
        if rep.lease and self._lease_tab is not None and rep.lease < self._lease_tab.size:
            self._leases[name] = (
                rep.lease,
                rep.step,
                rep.message,
                rep.chunk,
                rep.nbytes,
                self._reply_spec(name, rep),
            )

    def _hold_pin(self, name: str) -> None:
        """The daemon holds a read pin of ``name`` for this session: it goes back with the next request, or
        with the helper's RELEASE once this client is idle (:data:`_RELEASE_AFTER`)."""
        with self._rel_cond:
            self._pin, self._pin_at = name, time.monotonic()
            if self._releaser is None:
                self._releaser = threading.Thread(
                    target=self._release_loop, name="tensorwire-client-release", daemon=True
                )
                self._releaser.start()
            elif self._rel_parked:
                self._rel_cond.notify()

    def _lease_read(self, name: str, use: Callable[[TensorSpec, "torch.Tensor", str], Any], op: str) -> Any:
        """A read served from this client's lease on ``name`` (no request), or :data:`_MISS`.

        ``use(spec, bytes, region)`` copies out of the region the lease names; the result counts only
        if the lease's generation is the same before and after (else the lease is dropped and the
        caller asks the daemon). Errors ``use`` raises (a wrong ``out``, a row out of range) are the
        caller's, as they would be on the pinned path.
        """
        with self._lock:
            self._check_open()
            lease = self._leases.get(name)
            tab = self._lease_tab
            if lease is None or tab is None or not self._shm:
                return _MISS
            cell, gen, region, offset, nbytes, spec = lease
            cells = tab.cells
            if cells[cell] != gen or not tab.alive():
                del self._leases[name]
                self.lease_misses += 1
                return _MISS
            try:
                view = self._maps.get(region, offset, nbytes)
            except shm.ShmError:
                del self._leases[name]
                return _MISS
            before = self.shm_bytes
            self._in_lease = True  # no request follows at once: the copy may use torch's thread pool
            try:
                result = use(spec, view, region)
            finally:
                self._in_lease = False
            if cells[cell] != gen:  # a writer came meanwhile: what was copied may be mixed
                del self._leases[name]
                self.shm_bytes = before
                self.lease_misses += 1
                return _MISS
            self.lease_reads += 1
            self._page.add(op, self.shm_bytes - before)
            return result

    def _release_loop(self) -> None:
        """The helper: RELEASE a pin the client has held for :data:`_RELEASE_AFTER` without sending anything."""
        cond = self._rel_cond
        while True:
            with cond:
                while not self._closed and self._pin is None:
                    self._rel_parked = True
                    cond.wait()
                self._rel_parked = False
                if self._closed:
                    return
                wait = self._pin_at + _RELEASE_AFTER - time.monotonic()
                if wait > 0:
                    cond.wait(wait)
                    continue
            if not self._lock.acquire(blocking=False):
                time.sleep(_RELEASE_AFTER)  # an operation is under way: its request gives the pin back
                continue
            try:
                name, t = self._pin, self._transport
                if name is not None and t is not None and time.monotonic() >= self._pin_at + _RELEASE_AFTER:
                    try:
                        self._shm_release(t, name)
                    except TensorWireError as exc:
                        log.debug("releasing a shared-memory read failed (%s); the session is dropped", exc)
                        self._drop_session()
            except Exception:
                log.exception("releasing a shared-memory read failed")
            finally:
                self._lock.release()

    def _shm_write(
        self,
        t: "Transport",
        pr: "_Progress",
        op: int,
        rep: "wire.Reply",
        name: str,
        nbytes: int,
        fill: Callable[["torch.Tensor"], None],
    ) -> TensorStat:
        """After an SHM reply to a write: ``fill`` the region, COMMIT, return the committed stat."""
        if rep.nbytes != nbytes:
            raise self._lost(pr, f"the server reserved {rep.nbytes} bytes, this client has {nbytes}")
        try:
            fill(self._shm_view(pr, rep, name))
        except BaseException as exc:
            if pr.lost is None:
                # The daemon holds the reservation until COMMIT or the session's end: end the session.
                pr.lost = exc if isinstance(exc, TensorWireError) else ProtocolError(f"write abandoned: {exc!r}")
                if not isinstance(exc, TensorWireError):
                    self._drop_session()
            raise
        pr.sent = True  # from here on the daemon may commit: never repeated
        done = self._dp_call(t, pr, wire.OP_COMMIT, name)
        return self._committed(pr, name, nbytes, done, put=op == wire.OP_PUT)

    def _committed(self, pr: "_Progress", name: str, nbytes: int, done: "wire.Reply", *, put: bool) -> TensorStat:
        """The stat of a shared-memory write from its COMMIT's OK reply (a put's may carry a write-ahead grant)."""
        if done.status != wire.OK:
            raise self._lost(pr, f"reply to a commit has status {done.status}")
        self.shm_bytes += nbytes
        if put:
            self._take_grant(name, nbytes, done)
        spec = self._reply_spec(name, done)
        return TensorStat(spec, int(done.version), spec.nbytes)

    def _take_grant(self, name: str, nbytes: int, done: "wire.Reply") -> None:
        """Keep the write-ahead grant a put's COMMIT reply carries (if any) for the next put of ``name``."""
        ok = done.message and done.step > 0 and done.nbytes == nbytes and self._page is not None and self._use_ahead
        self._ahead = (name, (done.dtype, tuple(done.shape)), done.message, int(done.step)) if ok else None

    def _put_ahead(
        self, t: "Transport", pr: "_Progress", spec: TensorSpec, fill: Callable[["torch.Tensor", str], None]
    ) -> "TensorStat | None":
        """A put into the slot of the session's write-ahead grant: one copy, one COMMIT. None: not this put
        (another name or spec: the daemon's answer to the ordinary request is what the caller gets), or the
        grant has ended (nothing was written that anyone will see); put the ordinary way."""
        grant, self._ahead = self._ahead, None
        page, name, nbytes = self._page, spec.name, spec.nbytes
        if (
            grant is None
            or page is None
            or grant[0] != name
            or grant[1] != (wire.dtype_code(spec.dtype), tuple(spec.shape))
        ):
            return None
        region, ticket = grant[2], grant[3]
        if not page.lock.try_lock():  # the daemon is revoking it right now
            return None
        try:
            if int(page.ahead[0]) != ticket:  # revoked (another writer, a delete)
                return None
            try:
                dst = self._maps.get(region, 0, nbytes)
            except shm.ShmError:
                return None
            self._regions_of.setdefault(name, set()).add(region)
            fill(dst, region)
            pr.sent = True  # from here on the daemon may commit: never repeated
            done = self._dp_call(t, pr, wire.OP_COMMIT, name, shape=(ticket,), flags=wire.FLAG_AHEAD)
        finally:
            page.lock.unlock()
        if done.status == wire.FALLBACK:  # the grant had ended before the COMMIT: nothing changed
            pr.sent = False
            return None
        st = self._committed(pr, name, nbytes, done, put=True)
        self.ahead_puts += 1
        return st

    def _drop_leases(self) -> None:
        self._leases.clear()
        self._ahead = None
        tab, self._lease_tab = self._lease_tab, None
        page, self._page = self._page, None
        if tab is not None:
            tab.close()
        if page is not None:
            page.close()

    def _drop_session(self) -> None:
        self._shm = False
        self._drop_leases()
        self._pin = None  # the daemon releases what a closed session held
        t, self._transport = self._transport, None
        sid, self._sid = self._sid, None
        if sid is not None:
            self._close_remote(sid)
        if t is not None:
            t.abort()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("client is closed")

    def _session(self) -> tuple[str, "Transport"]:
        if self._sid is None or self._transport is None or self._transport.closed:
            self._drop_session()
            self._open_session()
        assert self._sid is not None and self._transport is not None
        return self._sid, self._transport

    def _run(self, grpc_op: Callable[[str, "Transport"], Any], dp_op: Callable[["Transport", "_Progress"], Any]) -> Any:
        """Run an operation: ``dp_op`` when the session takes data-plane requests, else ``grpc_op`` (gRPC calls).

        A data-plane operation whose connection was lost (the daemon closed the
        session or restarted) runs once more on a fresh session when it cannot
        have changed anything: a read, or a write before its GO reply came.
        Errors the daemon replied with leave the session as it is.
        """
        with self._lock:
            self._check_open()
            for attempt in (0, 1):
                sid, t = self._session()
                if not self._dp:
                    try:
                        return grpc_op(sid, t)
                    except SessionLost:
                        self._drop_session()
                        if attempt:
                            raise
                        continue
                pr = _Progress()
                try:
                    return dp_op(t, pr)
                except TensorWireError as exc:
                    if pr.lost is None:
                        raise  # the daemon's answer (or a local check): the session is fine
                    self._drop_session()
                    if attempt or pr.sent or not isinstance(exc, (PeerLostError, ClosedError)):
                        raise
                    log.debug("data connection lost (%s); once more on a new session", exc)

    def _name_bytes(self, name: Any) -> bytes:
        nb = self._names.get(name) if isinstance(name, str) else None
        if nb is not None:
            return nb
        name = check_name(name)  # SpecError, as the daemon would answer
        try:
            nb = name.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise SpecError(f"tensor name {name!r} is not encodable as UTF-8: {exc}") from None
        if len(self._names) >= 4096:
            self._names.clear()
        self._names[name] = nb
        return nb

    def _request_buffer(self, size: int) -> "torch.Tensor":
        import torch

        b = self._req_buf
        if b is None or b.numel() < size:
            b = self._req_buf = torch.empty(max(64 << 10, 1 << (size - 1).bit_length()), dtype=torch.uint8)
        return b

    def _post_reply(self, t: "Transport", pr: "_Progress") -> None:
        """Post a reply buffer on tag 5 (replies fill them in the order they were posted)."""
        import torch

        if not self._reply_bufs:
            self._reply_bufs = [torch.zeros(wire.REPLY_BYTES, dtype=torch.uint8) for _ in range(3)]
        buf = next(b for b in self._reply_bufs if all(b is not q for q in self._replies_posted))
        try:
            t.post_recv(TAG_REPLY, buf)
        except TensorWireError as exc:
            pr.lost = exc
            raise
        self._replies_posted.append(buf)

    def _prepost_reply(self, t: "Transport", pr: "_Progress") -> None:
        """Have the next request's reply buffer posted already (done while waiting for the server anyway)."""
        if not self._replies_posted:
            self._post_reply(t, pr)

    def _dp_call(
        self,
        t: "Transport",
        pr: "_Progress",
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

        nb = self._name_bytes(name)
        n = 0 if index is None else index.numel()
        layout = self._expect_packed.get(name, b"") if op in _LAYOUT_OPS else b""
        if layout:
            flags |= wire.FLAG_LAYOUT
        size = wire.request_size(len(nb), n, layout=bool(layout))
        buf = self._request_buffer(size)
        req_id = self._req_id + 1
        off = wire.pack_request(
            memoryview(buf.numpy()),
            op=op,
            req_id=req_id,
            name=nb,
            timeout_ms=self._timeout_ms(),
            dtype=dtype,
            shape=shape,
            nindex=n,
            flags=flags,
            layout=layout,
        )
        if n:
            assert index is not None
            buf[off : off + 8 * n].view(torch.int64).copy_(index)
        self._prepost_reply(t, pr)
        if not flags & wire.FLAG_AHEAD:
            self._ahead = None  # any other request ends the session's write-ahead grant (the daemon's side too)
        try:
            self._req_id = req_id
            self._pin = None  # any request gives the last read's pin back (the daemon releases it first)
            t.send(TAG_REQUEST, buf[:size], step=req_id, timeout=self._timeout)
            if self._shm and len(self._replies_posted) < 2:
                # the next request's reply buffer, while the daemon works on this one (a shared-memory
                # operation has no bytes to wait for, during which the socket paths post it)
                self._post_reply(t, pr)
        except TensorWireError as exc:
            pr.lost = exc
            raise
        return self._dp_reply(t, pr, op)

    def _dp_reply(self, t: "Transport", pr: "_Progress", op: int) -> "wire.Reply":
        """Wait for the next reply (its buffer is posted); an ERROR reply raises its error class."""
        try:
            # The daemon answers within its own deadline (the same timeout); a little more for the way back.
            r = t.wait_recv(TAG_REPLY, timeout=self._timeout + 5)
            buf = self._replies_posted.popleft()
            self._replies += 1
            if r.nbytes != wire.REPLY_BYTES or (r.step is not None and r.step != self._replies):
                raise ProtocolError(
                    f"reply of {r.nbytes} bytes (step {r.step}); expected {wire.REPLY_BYTES} (step {self._replies})"
                )
            try:
                rep = wire.parse_reply(memoryview(buf.numpy()))
            except ValueError as exc:
                raise ProtocolError(f"bad reply from the server: {exc}") from None
            if rep.req_id != self._req_id or rep.op != op:
                raise ProtocolError(f"reply to request {rep.req_id} op {rep.op}; expected {self._req_id} op {op}")
        except TensorWireError as exc:
            pr.lost = exc
            raise
        if rep.status == wire.ERROR:
            cls = ERROR_CLASSES.get(rep.error)
            if cls is None:
                raise TransportError(f"{wire.OPS[op]}: {rep.message or 'the server failed'}")
            raise cls(rep.message)
        return rep

    def _reply_spec(self, name: str, rep: "wire.Reply") -> TensorSpec:
        """The stored spec a reply describes (the cached one when it has not changed)."""
        spec = self._specs.get(name)
        if spec is not None and spec.shape == rep.shape and spec.dtype == wire.dtype_name(rep.dtype):
            return spec
        spec = _reply_spec(name, rep)
        self._specs[name] = spec
        return spec

    def _lost(self, pr: "_Progress", msg: str) -> ProtocolError:
        """A reply this client cannot follow: the session is dropped (no retry)."""
        exc = ProtocolError(msg)
        pr.lost = exc
        return exc

    def _dp_receive(self, t: "Transport", pr: "_Progress", rep: "wire.Reply", dest: "torch.Tensor") -> None:
        """Receive a read's ``rep.nbytes`` (messages of ``rep.chunk`` bytes on tag 1) into ``dest``."""
        nb, ch = rep.nbytes, rep.chunk
        if nb == 0:
            self._prepost_reply(t, pr)
            return
        if ch <= 0 or dest.numel() != nb:
            raise self._lost(pr, f"the server sends {nb} bytes in messages of {ch}; this read expects {dest.numel()}")
        k = -(-nb // ch)
        parts = [dest] if k == 1 else [dest[i * ch : min(nb, (i + 1) * ch)] for i in range(k)]
        posted = 0
        try:
            for i, part in enumerate(parts):
                while posted < k and posted <= i + _RECV_WINDOW:
                    t.post_recv(TAG_DOWN, parts[posted])
                    posted += 1
                if i == 0:
                    self._prepost_reply(t, pr)  # while the server gathers / sends
                try:
                    r = t.wait_recv(TAG_DOWN, timeout=self._timeout)
                finally:
                    t.forget_buffer(part)
                if r.nbytes != part.numel() or (r.step is not None and r.step != rep.step + i):
                    raise ProtocolError(
                        f"received {r.nbytes} bytes (step {r.step}); expected {part.numel()} (step {rep.step + i})"
                    )
        except TensorWireError as exc:
            pr.lost = exc
            raise

    def _dp_drain(self, t: "Transport", pr: "_Progress", rep: "wire.Reply") -> None:
        """Receive and discard a read's bytes (keeps the session in step)."""
        self._dp_receive(t, pr, rep, self._pool("", "discard").acquire(rep.nbytes))

    def _dp_write(
        self, t: "Transport", pr: "_Progress", op: int, rep: "wire.Reply", src: "torch.Tensor", name: str
    ) -> TensorStat:
        """After a GO reply: send ``src`` on tag 2, return the committed stat from the final reply."""
        if rep.status != wire.GO or rep.nbytes != src.numel():
            raise self._lost(
                pr, f"the server expects {rep.nbytes} bytes (status {rep.status}), this client has {src.numel()}"
            )
        pr.sent = True  # from here on the daemon may commit: never repeated
        self._prepost_reply(t, pr)  # for the final reply
        try:
            if rep.nbytes:
                t.send(TAG_UP, src, step=rep.step, timeout=self._timeout)
        except TensorWireError as exc:
            pr.lost = exc
            raise
        self._post_reply(t, pr)  # the next request's, while the server commits
        done = self._dp_reply(t, pr, op)
        if done.status != wire.OK:
            raise self._lost(pr, f"final reply of a write has status {done.status}")
        spec = self._reply_spec(name, done)
        return TensorStat(spec, int(done.version), spec.nbytes)

    def _timeout_ms(self) -> int:
        return int(self._timeout * 1000)

    def expect_layout(self, name: str, layout: ShardLayout | None) -> None:
        """Send ``layout`` with every request of ``name`` from now on (None: expect a whole tensor, the default).

        The daemon refuses requests whose expectation differs from what it holds
        (:class:`~tensorwire.errors.LayoutMismatchError`). Used by the sharded
        client; a read lease on ``name`` taken under another expectation is dropped.
        """
        with self._lock:
            if self._expect.get(name) == layout:
                return
            self._leases.pop(name, None)
            if layout is None:
                self._expect.pop(name, None)
                self._expect_pb.pop(name, None)
                self._expect_packed.pop(name, None)
            else:
                self._expect[name] = layout
                self._expect_pb[name] = layout.to_proto()
                self._expect_packed[name] = layout.pack()

    # -- for the sharded client: one gather over several daemons' shared memory -------------------------
    @property
    def lock(self) -> "threading.RLock":
        """Held by each operation of this client. A sharded client holds the locks of several clients
        across one gather from their daemons' shared memory, so that their pins stay meanwhile."""
        return self._lock

    def shm_lease(self, name: str) -> ShardView | None:
        """The version of ``name`` this client's read lease names, if the lease holds now (no request).

        Call with :attr:`lock` held, and count the read only if :meth:`ShardView.valid` still holds
        after copying out of it (:meth:`shm_count`).
        """
        self._check_open()
        lease = self._leases.get(name)
        tab = self._lease_tab
        if lease is None or tab is None or not self._shm:
            return None
        cell, gen, region, offset, nbytes, spec = lease
        if tab.cells[cell] != gen or not tab.alive():
            del self._leases[name]
            self.lease_misses += 1
            return None
        return ShardView(region, offset, nbytes, spec, tab.cells, cell, gen)

    def shm_pin(self, name: str, rows: int) -> ShardView | None:
        """Have the daemon pin the current version of ``name`` for a gather of ``rows`` rows that this
        process makes itself (a shared-memory get_rows request without an index).

        None: this session moves no bytes through shared memory, or the tensor is not in it. Call with
        :attr:`lock` held until the gather is done: the pin goes back with this client's next request.

        Raises:
            as get_rows (NotFoundError, LayoutMismatchError, PeerLostError, ...).
        """

        def grpc_op(sid: str, t: "Transport") -> None:
            return None

        def dp(t: "Transport", pr: _Progress) -> ShardView | None:
            if not self._shm:
                return None
            rep = self._dp_call(t, pr, wire.OP_GET_ROWS, name, shape=(rows,), flags=wire.FLAG_SHM)
            if rep.status == wire.FALLBACK:
                return None
            if rep.status != wire.SHM:
                raise self._lost(pr, f"get_rows {name}: reply status {rep.status} to a shared-memory request")
            got = self._reply_spec(name, rep)
            if rep.nbytes != got.nbytes or not got.shape:
                raise self._lost(pr, f"get_rows {name}: the server names {rep.nbytes} bytes of {got.describe()}")
            self._keep_lease(name, rep)
            self._hold_pin(name)
            return ShardView(rep.message, rep.chunk, rep.nbytes, got)

        with self._lock:
            return self._run(grpc_op, dp)

    def shm_count(self, nbytes: int, *, leased: bool) -> None:
        """Count a gather of ``nbytes`` made out of a view of this client (a lease read: for the daemon too)."""
        self.shm_bytes += nbytes
        if leased:
            self.lease_reads += 1
            if self._page is not None:
                self._page.add("get_rows", nbytes)

    def _recv(self, t: "Transport", tr: Any, raw: "torch.Tensor") -> None:
        try:
            t.post_recv(tr.tag, raw)
            r = t.wait_recv(tr.tag, timeout=self._timeout)
        except TensorWireError:
            self._drop_session()
            raise
        finally:
            t.forget_buffer(raw)
        if r.nbytes != tr.nbytes or (r.step is not None and r.step != tr.step):
            self._drop_session()
            raise ProtocolError(f"received {r.nbytes} bytes (step {r.step}); expected {tr.nbytes} (step {tr.step})")

    def _send_commit(self, sid: str, t: "Transport", tr: Any, src: "torch.Tensor") -> TensorStat:
        import grpc

        from tensorwire.v1 import store_pb2

        if tr.nbytes != src.numel():
            self._drop_session()
            raise ProtocolError(f"server expects {tr.nbytes} bytes, this client has {src.numel()}")
        fut = self._stub.CommitPut.future(
            store_pb2.CommitPutRequest(session_id=sid, op_id=tr.op_id), timeout=self._timeout + 10, metadata=self._md
        )
        try:
            t.send(tr.tag, src, step=tr.step, timeout=self._timeout)
        except TensorWireError:
            fut.cancel()
            self._drop_session()
            raise
        try:
            try:
                resp = fut.result()
            except grpc.RpcError as exc:
                if not isinstance(rpc_error(exc, "CommitPut"), Busy):
                    raise
                # the bytes are still arriving: ask again (with backoff) until they are in
                resp = self._rpc(
                    "CommitPut", store_pb2.CommitPutRequest(session_id=sid, op_id=tr.op_id), timeout=self._timeout + 10
                )
        except grpc.RpcError as exc:
            err = rpc_error(exc, "CommitPut", tls=self._tls is not None)
            if not isinstance(err, (NotFoundError, SessionLost)):
                self._drop_session()
            raise err from exc
        except TensorWireError as err:
            if not isinstance(err, (NotFoundError, SessionLost)):
                self._drop_session()
            raise
        return _stat(resp.info)

    def _source(self, key: str, tensor: "torch.Tensor") -> "torch.Tensor":
        """Flat uint8 host bytes of ``tensor``: zero-copy when contiguous on CPU, else staged."""
        t = tensor.detach()
        if t.device.type == "cpu" and t.is_contiguous():
            return _as_bytes(t)
        nbytes = t.numel() * t.element_size()
        raw = self._pool(key, "send").acquire(nbytes)
        _typed(raw, t.dtype, tuple(t.shape)).copy_(t)
        return raw

    def _pool(self, name: str, kind: str) -> _Pool:
        p = self._pools.get((name, kind))
        if p is None:
            p = self._pools[(name, kind)] = _Pool(round_up=kind == "rows")
        return p

    @staticmethod
    def _check_tensor(what: str, tensor: Any) -> "torch.Tensor":
        import torch

        if not isinstance(tensor, torch.Tensor):
            raise SpecError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
        return tensor

    @staticmethod
    def _check_out(spec: TensorSpec, out: "torch.Tensor", shape: tuple[int, ...]) -> None:
        if tuple(out.shape) != shape or out.dtype != spec.torch_dtype:
            raise ShapeMismatchError(
                f"{spec.name}: out= is {str(out.dtype).removeprefix('torch.')}{list(out.shape)}, "
                f"the stored tensor gives {spec.dtype}{list(shape)}"
            )

    # -- the API -----------------------------------------------------------------------------------
    def declare(self, spec: TensorSpec) -> TensorStat:
        """Declare ``spec`` (the server preallocates it); a no-op if it exists with the same spec."""
        from tensorwire.v1 import store_pb2

        if not isinstance(spec, TensorSpec):
            raise SpecError("declare needs a TensorSpec")
        with self._lock:
            self._check_open()
            resp = self._rpc(
                "Declare", store_pb2.DeclareRequest(spec=spec_to_proto(spec), layout=self._expect_pb.get(spec.name))
            )
        st = _stat(resp.info)
        self._specs[st.name] = st.spec
        return st

    def put(self, name: str, tensor: "torch.Tensor") -> TensorStat:
        """Store ``tensor`` under ``name`` as a new version.

        The first put of a name declares its spec (dtype and shape); later puts
        must match it. Returns the new version's stat.

        Raises:
            ShapeMismatchError: naming the stored spec and this tensor's.
            ResourceExhaustedError: over the daemon's ``--max-bytes``; nothing changed.
        """
        from tensorwire.v1 import store_pb2

        tensor = self._check_tensor("put: tensor", tensor)
        spec = TensorSpec(name, tuple(tensor.shape), tensor.dtype, "cpu")

        def op(sid: str, t: "Transport") -> TensorStat:
            src = self._source(name, tensor)
            req = store_pb2.BeginPutRequest(
                session_id=sid,
                spec=spec_to_proto(spec),
                timeout_ms=self._timeout_ms(),
                layout=self._expect_pb.get(name),
            )
            resp = self._rpc("BeginPut", req, timeout=self._timeout + 10, data_op=True)
            return self._send_commit(sid, t, resp.transfer, src)

        def fill(dst: "torch.Tensor", region: str) -> None:  # one copy, straight from the caller's tensor (any layout)
            src = tensor.detach()
            if src.device.type == "cpu" and src.is_contiguous():
                if spec.nbytes:
                    self._copier.copy(dst.numpy(), _as_bytes(src).numpy())
                return
            if src.is_cuda:
                self._maps.pin_for_cuda(region)
            _typed(dst, src.dtype, tuple(src.shape)).copy_(src)

        def dp(t: "Transport", pr: _Progress) -> TensorStat:
            if self._ahead is not None and self._shm:
                st = self._put_ahead(t, pr, spec, fill)
                if st is not None:
                    return st
            rep = self._dp_call(
                t, pr, wire.OP_PUT, name, dtype=wire.dtype_code(spec.dtype), shape=spec.shape, flags=self._shm_flag()
            )
            if rep.status == wire.SHM:
                return self._shm_write(t, pr, wire.OP_PUT, rep, name, spec.nbytes, lambda dst: fill(dst, rep.message))
            return self._dp_write(t, pr, wire.OP_PUT, rep, self._source(name, tensor), name)

        st = self._run(op, dp)
        self._specs[name] = st.spec
        return st

    def get(self, name: str, *, out: "torch.Tensor | None" = None) -> "torch.Tensor":
        """The current version of ``name``, whole (never a mix of two puts).

        Without ``out``, returns a CPU tensor backed by this client's receive
        buffer for ``name`` (pinned when CUDA is available); it is not reused
        while you hold it. With ``out`` (any device), fills and returns it.

        Raises:
            NotFoundError: no such name (or declared but never written).
            ShapeMismatchError: ``out`` does not match the stored spec.
        """
        from tensorwire.v1 import store_pb2

        if out is not None:
            self._check_tensor("get: out", out)

        def copy_out(spec: TensorSpec, src: "torch.Tensor", region: str) -> "torch.Tensor":
            """From the daemon's pinned slot (shared memory) into ``out`` or a receive buffer: one copy."""
            if out is not None:
                self._check_out(spec, out, spec.shape)
                if out.device.type == "cpu" and out.is_contiguous():
                    if spec.nbytes:
                        self._copier.copy(_as_bytes(out).numpy(), src.numpy())
                else:
                    if out.is_cuda:
                        self._maps.pin_for_cuda(region)
                    if spec.nbytes:
                        out.copy_(_typed(src, spec.torch_dtype, spec.shape))
                result = out
            else:
                raw = self._pool(name, "get").acquire(spec.nbytes)
                if spec.nbytes:
                    self._copier.copy(raw.numpy(), src.numpy())
                result = _typed(raw, spec.torch_dtype, spec.shape)
            self.shm_bytes += spec.nbytes
            return result

        def op(sid: str, t: "Transport") -> "torch.Tensor":
            resp = self._rpc(
                "Get",
                store_pb2.GetRequest(
                    session_id=sid, name=name, timeout_ms=self._timeout_ms(), layout=self._expect_pb.get(name)
                ),
                data_op=True,
            )
            spec = spec_from_proto(resp.info.spec)
            self._specs[name] = spec
            tr = resp.transfer
            direct = out is not None and out.device.type == "cpu" and out.is_contiguous()
            if out is not None:
                try:
                    self._check_out(spec, out, spec.shape)
                except ShapeMismatchError:
                    self._drain(t, tr)
                    raise
            if direct:
                self._recv(t, tr, _as_bytes(out))
                return out
            raw = self._pool(name, "get").acquire(tr.nbytes)
            self._recv(t, tr, raw)
            result = _typed(raw, spec.torch_dtype, spec.shape)
            if out is not None:
                out.copy_(result)
                return out
            return result

        def dp(t: "Transport", pr: _Progress) -> "torch.Tensor":
            rep = self._dp_call(t, pr, wire.OP_GET, name, flags=self._shm_flag())
            spec = self._reply_spec(name, rep)
            if rep.nbytes != spec.nbytes:
                raise self._lost(pr, f"get {name}: the server sends {rep.nbytes} bytes of {spec.describe()}")
            if rep.status == wire.SHM:
                return self._shm_read(t, pr, rep, name, lambda src: copy_out(spec, src, rep.message))
            if out is not None:
                try:
                    self._check_out(spec, out, spec.shape)
                except ShapeMismatchError:
                    self._dp_drain(t, pr, rep)
                    raise
                if out.device.type == "cpu" and out.is_contiguous():
                    self._dp_receive(t, pr, rep, _as_bytes(out))
                    return out
            raw = self._pool(name, "get").acquire(rep.nbytes)
            self._dp_receive(t, pr, rep, raw)
            result = _typed(raw, spec.torch_dtype, spec.shape)
            if out is not None:
                out.copy_(result)
                return out
            return result

        if self._leases:
            got = self._lease_read(name, copy_out, "get")
            if got is not _MISS:
                return got
        return self._run(op, dp)

    def _drain(self, t: "Transport", tr: Any) -> None:
        """Receive and discard a scheduled transfer (keeps the session in step)."""
        raw = self._pool("", "discard").acquire(tr.nbytes)
        self._recv(t, tr, raw)

    def _row_spec(self, name: str) -> TensorSpec:
        spec = self._specs.get(name)
        if spec is None:
            spec = self.stat(name).spec
        return spec

    def _chunk_rows(self, spec: TensorSpec) -> int:
        if not spec.shape:
            raise SpecError(f"{spec.name}: a 0-d tensor has no rows")
        row_bytes = (
            max(1, spec.nbytes // spec.shape[0]) if spec.shape[0] else max(1, spec.itemsize * math.prod(spec.shape[1:]))
        )
        return max(1, min(MAX_INDEX_ROWS, MAX_ROWS_BYTES // row_bytes))

    def _rows_dest(
        self, name: str, got: TensorSpec, n: int, out: "torch.Tensor | None"
    ) -> tuple["torch.Tensor", "torch.Tensor", int]:
        """Where get_rows puts ``n`` rows of ``got``: ``(typed tensor, its bytes, bytes per row)``.

        ``out`` itself when it is a contiguous host tensor, else a pooled buffer (copied into ``out`` by
        :meth:`_rows_result`). Raises ShapeMismatchError when ``out`` does not fit (nothing written).
        """
        shape = (n, *got.shape[1:])
        row_bytes = (got.nbytes // got.shape[0]) if got.shape and got.shape[0] else 0
        if out is not None:
            self._check_out(got, out, shape)
            if out.device.type == "cpu" and out.is_contiguous():
                return out, _as_bytes(out), row_bytes
        raw = self._pool(name, "rows").acquire(n * row_bytes)
        return _typed(raw, got.torch_dtype, shape), raw, row_bytes

    @staticmethod
    def _rows_result(result: "torch.Tensor", out: "torch.Tensor | None") -> "torch.Tensor":
        if out is not None and result is not out:
            out.copy_(result)
            return out
        return result

    def _rows_in_parts(
        self,
        name: str,
        idx: "torch.Tensor",
        out: "torch.Tensor | None",
        fetch: Callable[["torch.Tensor"], tuple[TensorSpec, int, Callable[..., None], Callable[[], None]]],
    ) -> "torch.Tensor":
        """get_rows over a connection: the index in parts (each read whole), the rows received into one result.

        ``fetch(part)`` asks for one part and returns ``(spec, nbytes, receive, drain)``:
        ``receive(rows, row_bytes, dest)`` takes the part's bytes into ``dest``; ``drain()`` discards
        them (the session stays in step) when the part cannot be taken.
        """
        n = idx.numel()
        chunk = self._chunk_rows(self._row_spec(name))
        spec: TensorSpec | None = None
        result = dest_raw = None
        row_bytes = 0
        for start in range(0, max(n, 1), chunk):
            part = idx[start : start + chunk]
            got, nbytes, receive, drain = fetch(part)
            if spec is None:
                spec = got
                try:
                    result, dest_raw, row_bytes = self._rows_dest(name, got, n, out)
                except ShapeMismatchError:
                    drain()
                    raise
            elif got != spec:
                drain()
                raise ShapeMismatchError(f"{name} was replaced by {got.describe()} during get_rows")
            assert dest_raw is not None
            receive(part.numel(), row_bytes, dest_raw[start * row_bytes : start * row_bytes + nbytes])
        assert result is not None
        return self._rows_result(result, out)

    def get_rows(self, name: str, index: Any, *, out: "torch.Tensor | None" = None) -> "torch.Tensor":
        """Rows ``index`` of dim 0 of ``name``, gathered by the server: only they travel.

        ``index`` is any 1-D integer sequence (list, ndarray, tensor); the
        result has shape ``[len(index), *shape[1:]]``. Requests above 262,144
        rows (or 256 MiB) are split, each part being read whole.

        Raises:
            SpecError: an index out of range (nothing is sent).
        """
        from tensorwire.v1 import store_pb2

        idx = as_index(index)
        if out is not None:
            self._check_tensor("get_rows: out", out)
        n = idx.numel()

        def op(sid: str, t: "Transport") -> "torch.Tensor":
            first = True

            def fetch(part: "torch.Tensor") -> tuple[TensorSpec, int, Callable[..., None], Callable[[], None]]:
                nonlocal first
                req = store_pb2.GetRowsRequest(
                    session_id=sid,
                    name=name,
                    index=encode_index(part),
                    timeout_ms=self._timeout_ms(),
                    layout=self._expect_pb.get(name),
                )
                resp = self._rpc("GetRows", req, data_op=True)
                tr = resp.transfer
                got = spec_from_proto(resp.info.spec)
                if first:
                    self._specs[name] = got
                    first = False
                return (
                    got,
                    tr.nbytes,
                    lambda _rows, _row_bytes, dest: self._recv(t, tr, dest),
                    lambda: self._drain(t, tr),
                )

            return self._rows_in_parts(name, idx, out, fetch)

        def gather(got: TensorSpec, src: "torch.Tensor", region: str) -> "torch.Tensor":
            """The rows, gathered by this process from the daemon's pinned version (shared memory): one copy."""
            if not got.shape:
                raise SpecError(f"{name}: a 0-d tensor has no rows")
            rows = got.shape[0]
            inp = idx.numpy()
            if n:
                lo, hi = int(inp.min()), int(inp.max())
                if lo < 0 or hi >= rows:
                    raise SpecError(f"index: row {lo if lo < 0 else hi} out of range for a tensor of {rows} rows")
            dest, dest_raw, row_bytes = self._rows_dest(name, got, n, out)
            if n and row_bytes:
                key = (region, rows, row_bytes)
                cached = self._rows_views.get(name)
                if cached is None or cached[0] != key:
                    if len(self._rows_views) >= 64:
                        self._rows_views.clear()
                    cached = self._rows_views[name] = (key, src.numpy().reshape(rows, row_bytes))
                # rows as bytes: any dtype (numpy's take or torch's index_select: see tensorwire.serve.protocol.shm.Copier)
                self._copier.take(cached[1], inp, dest_raw.numpy().reshape(n, row_bytes), pool=self._in_lease)
            self.shm_bytes += n * row_bytes
            return self._rows_result(dest, out)

        def dp(t: "Transport", pr: _Progress) -> "torch.Tensor":
            if self._shm:
                rep = self._dp_call(t, pr, wire.OP_GET_ROWS, name, shape=(n,), flags=wire.FLAG_SHM)
                if rep.status == wire.SHM:
                    got = self._reply_spec(name, rep)
                    if rep.nbytes != got.nbytes:
                        raise self._lost(
                            pr, f"get_rows {name}: the server names {rep.nbytes} bytes of {got.describe()}"
                        )
                    return self._shm_read(t, pr, rep, name, lambda src: gather(got, src, rep.message))
                if rep.status != wire.FALLBACK:
                    raise self._lost(pr, f"get_rows {name}: reply status {rep.status} to a shared-memory request")
                # the tensor is not in shared memory: the request again, with the index, over the connection

            def fetch(part: "torch.Tensor") -> tuple[TensorSpec, int, Callable[..., None], Callable[[], None]]:
                rep = self._dp_call(t, pr, wire.OP_GET_ROWS, name, index=part)

                def receive(rows: int, row_bytes: int, dest: "torch.Tensor") -> None:
                    if rep.nbytes != rows * row_bytes:
                        raise self._lost(
                            pr, f"get_rows {name}: the server sends {rep.nbytes} bytes for {rows} rows of {row_bytes}"
                        )
                    self._dp_receive(t, pr, rep, dest)

                return self._reply_spec(name, rep), rep.nbytes, receive, lambda: self._dp_drain(t, pr, rep)

            return self._rows_in_parts(name, idx, out, fetch)

        if self._leases:
            got = self._lease_read(name, gather, "get_rows")
            if got is not _MISS:
                return got
        return self._run(op, dp)

    def put_rows(self, name: str, index: Any, values: "torch.Tensor") -> TensorStat:
        """Overwrite rows ``index`` of dim 0 of ``name`` with ``values`` (``[len(index), *shape[1:]]``).

        Indices must be unique. Atomic per request (262,144 rows / 256 MiB at most; larger ones are split).
        """
        return self._rows(name, index, values, add=False)

    def add_rows(self, name: str, index: Any, values: "torch.Tensor") -> TensorStat:
        """Add ``values`` to rows ``index`` of ``name`` server-side (duplicates accumulate)."""
        return self._rows(name, index, values, add=True)

    def update_rows(
        self, name: str, index: Any, values: "torch.Tensor", *, add: bool, pick: "torch.Tensor | None" = None
    ) -> TensorStat:
        """``add_rows`` (``add``) or ``put_rows`` with the values ``values[pick]`` (all of ``values``: None).

        The sharded client's part of an update: each value row is copied once, from the caller's tensor
        straight to where it goes (the daemon's shared-memory scratch, or the bytes sent), with no
        ``values[pick]`` tensor in between.
        """
        return self._rows(name, index, values, add=add, pick=pick)

    def _rows(
        self, name: str, index: Any, values: "torch.Tensor", *, add: bool, pick: "torch.Tensor | None" = None
    ) -> TensorStat:
        import numpy as np

        from tensorwire.v1 import store_pb2

        idx = as_index(index)
        values = self._check_tensor("values", values)
        n = idx.numel()
        if pick is not None:
            pick = as_index(pick)
            if pick.numel() != n:
                raise ShapeMismatchError(f"{name}: {n} indices but {pick.numel()} value rows picked")
            if values.dim() < 1 or (n and not 0 <= int(pick.min()) <= int(pick.max()) < values.shape[0]):
                raise ShapeMismatchError(f"{name}: value rows picked outside values of shape {list(values.shape)}")
            if not (values.device.type == "cpu" and values.is_contiguous()):
                values, pick = values.index_select(0, pick.to(values.device)), None
        if pick is None and (values.dim() < 1 or values.shape[0] != n):
            raise ShapeMismatchError(f"{name}: {n} indices but values of shape {list(values.shape)}")

        def parts() -> "Iterator[tuple[torch.Tensor, TensorSpec, int, Callable[[Any], None], Callable[[], Any]]]":
            """Per request of at most _chunk_rows rows: (indices, spec of their values, their value bytes,
            fill(dst: a flat uint8 numpy array), data() -> a flat uint8 tensor of them)."""
            chunk = self._chunk_rows(self._row_spec(name))
            vshape = tuple(values.shape[1:])
            row_bytes = values.element_size() * math.prod(vshape)
            if pick is None:
                src = self._source(name, values)
            else:
                rows_np = _as_bytes(values).numpy().reshape(values.shape[0], row_bytes)
                pick_np = pick.numpy()
            for start in range(0, max(n, 1), chunk):
                part = idx[start : start + chunk]
                k = part.numel()
                nbytes = k * row_bytes
                if pick is None:
                    data = src[start * row_bytes : start * row_bytes + nbytes]

                    def fill(dst: Any, d: "torch.Tensor" = data) -> None:
                        self._copier.copy(dst, d.numpy())

                    def get(d: "torch.Tensor" = data) -> "torch.Tensor":
                        return d
                else:
                    which = pick_np[start : start + k]

                    def fill(dst: Any, which: Any = which, k: int = k) -> None:
                        self._copier.take(rows_np, which, dst.reshape(k, row_bytes))

                    def get(which: Any = which, k: int = k, nbytes: int = nbytes) -> "torch.Tensor":
                        raw = self._pool(name, "send").acquire(nbytes)
                        if nbytes:
                            np.take(rows_np, which, axis=0, out=raw.numpy().reshape(k, row_bytes), mode="clip")
                        return raw

                yield part, TensorSpec(name, (k, *vshape), values.dtype), nbytes, fill, get

        def op(sid: str, t: "Transport") -> TensorStat:
            st: TensorStat | None = None
            for part, vspec, _nbytes, _fill, data in parts():
                req = store_pb2.PutRowsRequest(
                    session_id=sid,
                    name=name,
                    index=encode_index(part),
                    values=spec_to_proto(vspec),
                    add=add,
                    timeout_ms=self._timeout_ms(),
                    layout=self._expect_pb.get(name),
                )
                resp = self._rpc("PutRows", req, data_op=True)
                st = self._send_commit(sid, t, resp.transfer, data())
            assert st is not None
            return st

        wop = wire.OP_ADD_ROWS if add else wire.OP_PUT_ROWS

        def dp(t: "Transport", pr: _Progress) -> TensorStat:
            st: TensorStat | None = None
            for part, vspec, nbytes, fill, data in parts():
                rep = self._dp_call(
                    t,
                    pr,
                    wop,
                    name,
                    index=part,
                    dtype=wire.dtype_code(vspec.dtype),
                    shape=vspec.shape,
                    flags=self._shm_flag(),
                )
                if rep.status == wire.SHM:  # the values into the session's scratch region; the daemon applies them
                    st = self._shm_write(t, pr, wop, rep, name, nbytes, lambda dst, f=fill: f(dst.numpy()))
                    continue
                st = self._dp_write(t, pr, wop, rep, data(), name)
            assert st is not None
            return st

        return self._run(op, dp)

    def list(self) -> dict[str, TensorSpec]:
        """Every name the store holds, with its spec."""
        return {k: v.spec for k, v in self.stats().items()}

    def stats(self) -> dict[str, TensorStat]:
        """Every name the store holds, with its spec, version and size."""
        from tensorwire.v1 import store_pb2

        out: dict[str, TensorStat] = {}
        token = ""
        with self._lock:
            self._check_open()
            while True:
                resp = self._rpc("List", store_pb2.ListRequest(page_token=token))
                for info in resp.tensors:
                    st = _stat(info)
                    out[st.name] = st
                token = resp.next_page_token
                if not token:
                    return out

    def stat(self, name: str) -> TensorStat:
        """Spec, version and size of ``name``.

        Raises:
            NotFoundError: no such name.
        """
        from tensorwire.v1 import store_pb2

        with self._lock:
            self._check_open()
            resp = self._rpc("Stat", store_pb2.StatRequest(name=name))
        st = _stat(resp.info)
        self._specs[name] = st.spec
        return st

    def delete(self, name: str) -> None:
        """Delete ``name`` (its memory is freed once in-flight reads finish).

        Raises:
            NotFoundError: no such name.
        """
        from tensorwire.v1 import store_pb2

        with self._lock:
            self._check_open()
            self._rpc("Delete", store_pb2.DeleteRequest(name=name, layout=self._expect_pb.get(name)))
            self._specs.pop(name, None)
            for key in [k for k in self._pools if k[0] == name]:
                del self._pools[key]
            regions = self._regions_of.pop(name, ())
            self._rows_views.pop(name, None)
            if self._maps is not None:
                for r in regions:
                    self._maps._drop(r)  # the daemon unlinked them: give the memory back

    def snapshot(self) -> SnapshotInfo:
        """Ask the daemon to write its snapshot now (needs ``--snapshot-dir``)."""
        from tensorwire.v1 import store_pb2

        with self._lock:
            self._check_open()
            resp = self._rpc("Snapshot", store_pb2.SnapshotRequest(), timeout=max(self._timeout, 600.0))
        return SnapshotInfo(resp.path, int(resp.tensors), int(resp.nbytes), float(resp.seconds))

    def bytes_moved(self) -> int:
        """Data-plane bytes sent + received on the current session (when the transport counts them), plus the
        bytes this client copied through shared memory."""
        t = self._transport
        return int(getattr(t, "bytes_sent", 0) or 0) + int(getattr(t, "bytes_received", 0) or 0) + self.shm_bytes

    def close(self) -> None:
        """Close the session, the data connection and the channel. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._drop_session()
            self._channel.close()
            self._rows_views.clear()
            if self._maps is not None:
                self._maps.close()
                self._copier.close()
        with self._rel_cond:
            self._rel_cond.notify_all()  # the release helper exits

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else (self.data_path or "not connected")
        return f"Client({self.address!r}, {state})"
