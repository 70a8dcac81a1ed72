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

Each session has one path object that the hot operations (get, get_rows,
put, put_rows, add_rows) go through, chosen when the session opens
(:mod:`tensorwire.serve.client.session`):

- shared memory (:mod:`~tensorwire.serve.client.shm_path`): with a daemon on
  the same host (``--shm``, the default) and ``transport="auto"`` or
  ``"shm"``, this process copies the bytes in and out of the daemon's memory
  itself, one copy; repeated reads of an unchanged tensor need no request at
  all (read leases). A client that cannot map the daemon's memory (another
  host, container or uid) uses the data connection without a word (debug
  log); ``transport="shm"`` makes that an error instead;
- data-plane requests (:mod:`~tensorwire.serve.client.request_path`): each
  operation is a small binary request on the session's data connection,
  answered by a fixed-size reply and followed by the tensor bytes: no gRPC
  call once the session is open;
- gRPC calls (:mod:`~tensorwire.serve.client.grpc_path`): Get, GetRows,
  BeginPut/PutRows + CommitPut, with an older daemon or
  ``data_requests=False``.

The errors are the same on every path. ``data_path`` says which one a client
uses, ``shm_bytes`` counts what went through shared memory.

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
``ResourceExhaustedError`` (``--max-bytes``), ``PeerLostError`` (server gone; ``ConnectError``,
a subclass, when it was never reached),
``TransferTimeout``, ``ClosedError`` (used after ``close()``). A client still open at interpreter
exit is closed then (:mod:`tensorwire.lifecycle`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Mapping

from tensorwire import lifecycle
from tensorwire.errors import ClosedError, ConfigError, PeerLostError, SpecError, TensorWireError
from tensorwire.serve.client.arrays import As, check_as, convert
from tensorwire.serve.client.client_shm import ClientShm
from tensorwire.serve.client.common import SnapshotInfo, TensorStat
from tensorwire.serve.client.context import ClientContext, Progress, RowUpdate
from tensorwire.serve.client.request_path import RequestPath
from tensorwire.serve.client.session import Path, open_session
from tensorwire.serve.client.sharded_client import ShardedClient
from tensorwire.serve.client.shm_path import AHEAD_ENV, LEASES_ENV, Releaser, ShmMemory, ShmPath
from tensorwire.serve.client.shm_rows import MISS, lease_rows
from tensorwire.serve.protocol.common import SessionLost, as_index
from tensorwire.serve.protocol.layout import ShardLayout
from tensorwire.serve.protocol.tls import TLSConfig
from tensorwire.spec import TensorSpec

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.transport.base import Transport

__all__ = ["Client", "TensorStat", "SnapshotInfo", "TLSConfig", "LEASES_ENV", "AHEAD_ENV"]

log = logging.getLogger(__name__)

_TRANSPORTS = ("auto", "shm", "ucx", "tcp")


def _many(address: Any) -> bool:
    """Whether ``address`` names several daemons (a list of more than one, or ``dns:///``)."""
    if isinstance(address, (list, tuple)):
        return len(address) > 1
    return isinstance(address, str) and address.strip().startswith("dns:")


class Client(ClientShm):
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
        PeerLostError / ConnectTimeout: the daemon is not reachable (ConnectError: nothing listens there).

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
        if transport not in _TRANSPORTS:
            raise ConfigError(f"transport must be one of {', '.join(_TRANSPORTS)}, got {transport!r}")
        if not timeout or timeout <= 0:
            raise ConfigError("timeout must be positive")
        if token is not None and (not isinstance(token, str) or not token.strip()):
            raise ConfigError("token must be a non-empty string")
        if isinstance(address, (list, tuple)) and len(address) == 1:
            address = address[0]
        self._ctx = ctx = ClientContext(
            address, token=token, tls=tls, timeout=timeout, connect_timeout=connect_timeout, name=name
        )
        self.address = ctx.address
        self._want = transport
        self._want_dp = bool(data_requests)
        self._lock = threading.RLock()
        self._closed = False
        self._path: Path | None = None  # the session's path object (None: no session now)
        self._requests: RequestPath | None = None  # its data-plane request path, if it has one
        self._releaser = Releaser(self._lock, self._shm_path, self._drop_session)
        self._mem = ShmMemory(
            self._releaser, why="" if transport in ("auto", "shm") else f"transport={transport!r} asks for a socket"
        )
        ctx.drop_session = self._drop_session
        self.transport_kind: str | None = None
        #: Whether the daemon records and checks shard layouts (OpenSessionResponse.layouts).
        self.layout_checks = False
        try:
            self._open_session()
        except BaseException:
            ctx.close()
            self._closed = True
            raise
        lifecycle.track(self)  # closed at interpreter exit if the script does not (tensorwire.lifecycle)

    # -- sessions ----------------------------------------------------------------------------------
    def _open_session(self, deadline: float | None = None) -> None:
        path = open_session(self._ctx, want=self._want, want_dp=self._want_dp, mem=self._mem, deadline=deadline)
        self._path = path
        self._requests = path if isinstance(path, RequestPath) else None
        self.transport_kind = path.session.kind
        self.layout_checks = path.session.layouts

    def _drop_session(self) -> None:
        p, self._path = self._path, None
        r, self._requests = self._requests, None
        for q in (p, r) if r is not p else (p,):
            if q is not None:
                q.close()

    def _current(self, deadline: float | None = None) -> Path:
        """The session's path object (a new session, opened by ``deadline``, if there is none or its data
        connection closed)."""
        p = self._path
        if p is None or p.transport.closed:
            self._drop_session()
            self._open_session(deadline)
            p = self._path
            assert p is not None
        return p

    def _shm_path(self) -> ShmPath | None:
        r = self._requests
        return r if isinstance(r, ShmPath) else None

    def _run(self, op: str, *args: Any) -> Any:
        """``path.<op>(*args, progress)`` on the session's path object.

        All of it -- a new session if one is needed, the retry below -- ends
        within the client's ``timeout`` (a daemon cut off is an error by then,
        not after its connection's own timeouts). An operation whose data
        connection was lost (the daemon closed the session or restarted) runs
        once more on a fresh session when it cannot have changed anything: a
        read, or a write before its GO reply came. A gRPC call the daemon
        answers SessionLost runs once more too. Errors the daemon replied with
        leave the session as it is.
        """
        with self._lock:
            self._check_open()
            deadline = time.monotonic() + self._ctx.timeout
            for attempt in (0, 1):
                path = self._current(deadline)
                pr = Progress(deadline)
                try:
                    return getattr(path, op)(*args, pr)
                except TensorWireError as exc:
                    if pr.lost is None:
                        if isinstance(exc, SessionLost) and not path.requests:
                            self._drop_session()  # the daemon forgot the session; the call did nothing
                            if attempt:
                                raise
                            continue
                        raise  # the daemon's answer (or a local check): the session is fine
                    self._drop_session()
                    if attempt or pr.sent or not isinstance(exc, (PeerLostError, ClosedError)):
                        raise
                    log.debug("data connection lost (%s); once more on a new session", exc)
        raise AssertionError("unreachable")  # pragma: no cover

    def _lease_rows(self, name: str, idx: "torch.Tensor", out: "torch.Tensor") -> Any:
        """get_rows into ``out`` from a read lease of the current session, without :meth:`_run`'s deadline
        and retry (a lease read sends nothing: there is nothing to time out or to run again); MISS when no
        lease serves it (then :meth:`_run` takes it, on whatever path it needs). ~10 us less per read on the
        2-core VM, where a lease read of a few rows took ~25 us in all."""
        with self._lock:
            r = self._requests
            if self._closed or not isinstance(r, ShmPath) or not r.leases or r.transport.closed:
                return MISS
            return lease_rows(r, name, idx, out)

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError("client is closed")

    # -- the API -----------------------------------------------------------------------------------
    def declare(self, spec: TensorSpec) -> TensorStat:
        """Declare ``spec`` (the server preallocates it); a no-op if it exists with the same spec."""
        if not isinstance(spec, TensorSpec):
            raise SpecError("declare needs a TensorSpec")
        with self._lock:
            self._check_open()
            return self._ctx.declare(spec)

    def put(self, name: str, tensor: Any) -> TensorStat:
        """Store ``tensor`` under ``name`` as a new version.

        ``tensor``: a torch tensor or any array with ``__dlpack__`` (NumPy, CuPy, JAX), read where it
        lies (no copy on the way; see :mod:`tensorwire.serve.client.arrays`). The first put of a name
        declares its spec (dtype and shape); later puts must match it. Returns the new version's stat.

        Raises:
            ShapeMismatchError: naming the stored spec and this tensor's.
            ResourceExhaustedError: over the daemon's ``--max-bytes``; nothing changed.
            SpecError: not a tensor or a DLPack array.
        """
        tensor = self._ctx.check_tensor("put: tensor", tensor)
        spec = TensorSpec(name, tuple(tensor.shape), tensor.dtype, "cpu")
        st: TensorStat = self._run("put", name, tensor, spec)
        self._ctx.specs[name] = st.spec
        return st

    def get(self, name: str, *, out: Any = None, as_: "As | None" = None) -> Any:
        """The current version of ``name``, whole (never a mix of two puts).

        Without ``out``, returns a CPU tensor backed by this client's receive
        buffer for ``name`` (pinned when CUDA is available); it is not reused
        while you hold it. ``as_="numpy"`` returns a NumPy array over that
        buffer, ``as_="cupy"`` a CuPy array filled on the GPU. With ``out``
        (a tensor on any device, or any writable array with ``__dlpack__``:
        NumPy, CuPy), fills and returns it.

        Raises:
            NotFoundError: no such name (or declared but never written).
            ShapeMismatchError: ``out`` does not match the stored spec (nothing written).
            SpecError: ``out`` is not a writable tensor or array.
            ConfigError: ``as_`` is not one of "torch", "numpy", "cupy", or given with ``out``.
        """
        kind = check_as(as_, out)
        if out is not None:
            t = self._ctx.check_tensor("get: out", out, writable=True)
            got = self._run("get", name, t)
            return got if t is out else out
        if kind == "cupy":
            return convert(self._run("get", name, self._cuda_dest(name, None)), kind)
        return convert(self._run("get", name, None), kind)

    def get_rows(self, name: str, index: Any, *, out: Any = None, as_: "As | None" = None) -> Any:
        """Rows ``index`` of dim 0 of ``name``, gathered by the server: only they travel.

        ``index`` is any 1-D integer sequence (list, ndarray, tensor); the
        result has shape ``[len(index), *shape[1:]]``. Requests above 262,144
        rows (or 256 MiB) are split, each part being read whole. ``out`` and
        ``as_``: as :meth:`get`.

        Raises:
            SpecError: an index out of range (nothing is sent).
        """
        idx = as_index(index)
        kind = check_as(as_, out)
        if out is not None:
            t = self._ctx.check_tensor("get_rows: out", out, writable=True)
            got = self._lease_rows(name, idx, t)
            if got is MISS:
                got = self._run("get_rows", name, idx, t)
            return got if t is out else out
        if kind == "cupy":
            return convert(self._run("get_rows", name, idx, self._cuda_dest(name, idx.numel())), kind)
        return convert(self._run("get_rows", name, idx, None), kind)

    def _cuda_dest(self, name: str, rows: int | None) -> "torch.Tensor":
        """A new CUDA tensor for ``name`` (``rows`` rows of it; None: all of it), on the current device."""
        import torch

        spec = self._ctx.specs.get(name) or self.stat(name).spec
        shape = spec.shape if rows is None else (rows, *spec.shape[1:])
        if rows is not None and not spec.shape:
            raise SpecError(f"{name}: a 0-d tensor has no rows")
        return torch.empty(shape, dtype=spec.torch_dtype, device=torch.device("cuda", torch.cuda.current_device()))

    def put_rows(self, name: str, index: Any, values: Any) -> TensorStat:
        """Overwrite rows ``index`` of dim 0 of ``name`` with ``values`` (``[len(index), *shape[1:]]``; a
        tensor or any array with ``__dlpack__``, read where it lies).

        Indices must be unique. Atomic per request (262,144 rows / 256 MiB at most; larger ones are split).
        """
        return self.update_rows(name, index, values, add=False)

    def add_rows(self, name: str, index: Any, values: Any) -> TensorStat:
        """Add ``values`` to rows ``index`` of ``name`` server-side (duplicates accumulate)."""
        return self.update_rows(name, index, values, add=True)

    def update_rows(
        self, name: str, index: Any, values: Any, *, add: bool, pick: "torch.Tensor | None" = None
    ) -> TensorStat:
        """``add_rows`` (``add``) or ``put_rows`` with the values ``values[pick]`` (all of ``values``: None).

        The sharded client's part of an update: each value row is copied once, from the caller's tensor
        straight to where it goes (the daemon's shared-memory scratch, or the bytes sent), with no
        ``values[pick]`` tensor in between.
        """
        upd = RowUpdate(self._ctx, name, as_index(index), values, pick)
        st: TensorStat = self._run("update", upd, add)
        return st

    def list(self) -> dict[str, TensorSpec]:
        """Every name the store holds, with its spec."""
        return {k: v.spec for k, v in self.stats().items()}

    def stats(self) -> dict[str, TensorStat]:
        """Every name the store holds, with its spec, version and size."""
        with self._lock:
            self._check_open()
            return self._ctx.stats()

    def stat(self, name: str) -> TensorStat:
        """Spec, version and size of ``name``.

        Raises:
            NotFoundError: no such name.
        """
        with self._lock:
            self._check_open()
            return self._ctx.stat(name)

    def delete(self, name: str) -> None:
        """Delete ``name`` (its memory is freed once in-flight reads finish).

        Raises:
            NotFoundError: no such name.
        """
        with self._lock:
            self._check_open()
            self._ctx.delete(name)
            self._mem.forget(name)

    def snapshot(self) -> SnapshotInfo:
        """Ask the daemon to write its snapshot now (needs ``--snapshot-dir``)."""
        with self._lock:
            self._check_open()
            return self._ctx.snapshot()

    def expect_layout(self, name: str, layout: ShardLayout | None) -> None:
        """Send ``layout`` with every request of ``name`` from now on (None: expect a whole tensor, the default).

        The daemon refuses requests whose expectation differs from what it holds
        (:class:`~tensorwire.errors.LayoutMismatchError`). Used by the sharded
        client; a read lease on ``name`` taken under another expectation is dropped.
        """
        with self._lock:
            if self._ctx.set_layout(name, layout):
                p = self._shm_path()
                if p is not None:
                    p.leases.pop(name, None)

    # -- state -------------------------------------------------------------------------------------
    @property
    def shm(self) -> bool:
        """Whether the current session moves tensor bytes through shared memory."""
        p = self._path
        return p is not None and p.shm

    @property
    def data_path(self) -> str | None:
        """How tensor bytes move: ``"shm"``, or the data connection's kind (``"ucx"``, ``"tcp"``)."""
        return "shm" if self.shm else self.transport_kind

    def bytes_moved(self) -> int:
        """Data-plane bytes sent + received on the current session (when the transport counts them), plus the
        bytes this client copied through shared memory."""
        p = self._path
        t = p.transport if p is not None else None
        return int(getattr(t, "bytes_sent", 0) or 0) + int(getattr(t, "bytes_received", 0) or 0) + self.shm_bytes

    def close(self) -> None:
        """Close the session, the data connection and the channel. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._drop_session()
            self._ctx.close()
            self._mem.close()
        self._releaser.close()  # the release thread ends (joined)
        lifecycle.untrack(self)

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

    # -- what tests look at ------------------------------------------------------------------------
    @property
    def _sid(self) -> str | None:
        """The current session's id (None: none open)."""
        p = self._path
        return p.session.sid if p is not None else None

    def _session(self) -> tuple[str, "Transport"]:
        """The current session (opened if needed): its id and data connection."""
        p = self._current()
        return p.session.sid, p.transport

    @property
    def _dp(self) -> bool:
        """Whether the session's hot operations are data-plane requests (False: gRPC calls)."""
        p = self._path
        return p is not None and p.requests
