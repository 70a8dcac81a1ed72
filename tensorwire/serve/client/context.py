"""What every data path of one serve client shares: its settings, the control channel, and its buffers.

A :class:`~tensorwire.serve.client.client.Client` opens sessions; each
session gets one path object (:mod:`~tensorwire.serve.client.grpc_path`,
:mod:`~tensorwire.serve.client.request_path`,
:mod:`~tensorwire.serve.client.shm_path`) that moves the bytes of its hot
operations. What outlives a session lives here, in the client's
:class:`ClientContext`: the gRPC stub and its retry of calls the daemon
answered Busy, the specs learnt per name, the reusable receive and send
buffers, and the shard layouts this client expects of names.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from tensorwire._proto import spec_from_proto, spec_to_proto
from tensorwire.buffers import allocate_host, as_bytes
from tensorwire.errors import ShapeMismatchError, SpecError
from tensorwire.serve.client.arrays import as_tensor
from tensorwire.serve.client.common import SnapshotInfo, TensorStat, parse_address
from tensorwire.serve.protocol import wire
from tensorwire.serve.protocol.common import (
    AUTH_KEY,
    MAX_INDEX_ROWS,
    MAX_MESSAGE_BYTES,
    MAX_ROWS_BYTES,
    Busy,
    as_index,
    error_name,
    rpc_error,
)
from tensorwire.serve.protocol.layout import ShardLayout
from tensorwire.serve.protocol.tls import TLSConfig
from tensorwire.spec import TensorSpec, check_name

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["ClientContext", "Pool", "Progress", "RowUpdate", "RowsFetch", "typed", "stat_of", "warn_once"]

log = logging.getLogger(__name__)

_warned: set[str] = set()
_warn_lock = threading.Lock()

#: ``fetch(part)`` of a get_rows in parts: ``(spec, nbytes, receive(rows, row_bytes, dest), drain())``.
RowsFetch = Callable[["torch.Tensor"], tuple[TensorSpec, int, Callable[..., None], Callable[[], None]]]


def _ignore(fut: Any) -> None:
    fut.exception()  # retrieved: no "exception was never retrieved" noise


def warn_once(key: str, msg: str, *args: Any) -> None:
    """``log.warning`` once per process for ``key``."""
    with _warn_lock:
        if key in _warned:
            return
        _warned.add(key)
    log.warning(msg, *args)


def stat_of(info: Any) -> TensorStat:
    """A :class:`TensorStat` from the daemon's ``TensorInfo``."""
    return TensorStat(spec_from_proto(info.spec), int(info.version), int(info.nbytes), ShardLayout.from_field(info))


def use_count(t: "torch.Tensor") -> int | None:
    """References to ``t``'s storage (None: this torch cannot tell; such buffers are never reused)."""
    import torch

    fn = getattr(torch._C, "_storage_Use_Count", None)
    if fn is None:  # pragma: no cover - a torch without it: never reuse
        return None
    return int(fn(t.untyped_storage()._cdata))


def typed(raw: "torch.Tensor", dtype: "torch.dtype", shape: tuple[int, ...]) -> "torch.Tensor":
    """Flat bytes ``raw`` as a tensor of ``dtype`` and ``shape`` (no copy)."""
    import torch

    if raw.numel() == 0:
        return torch.empty(shape, dtype=dtype)
    return raw.view(dtype).view(shape)


class Pool:
    """Reusable host buffers for one name; a buffer is reused only when nobody else references it."""

    KEEP = 2

    def __init__(self, *, round_up: bool = False) -> None:
        self._bufs: list[tuple["torch.Tensor", int | None]] = []
        self._round_up = round_up
        self.allocations = 0

    def acquire(self, nbytes: int) -> "torch.Tensor":
        for raw, base in self._bufs:
            if raw.numel() >= nbytes and base is not None and use_count(raw) == base:
                return raw[:nbytes]
        cap = nbytes
        if self._round_up and nbytes > 4096:
            cap = 1 << (nbytes - 1).bit_length()
        new = allocate_host(cap)
        self.allocations += 1
        entry = (new, use_count(new))
        if len(self._bufs) < self.KEEP:
            self._bufs.append(entry)
        else:
            # replace a free buffer that was too small, if any; else this one is not pooled
            for i, (raw, base) in enumerate(self._bufs):
                if base is not None and use_count(raw) == base:
                    self._bufs[i] = entry
                    break
        return new[:nbytes]


class Progress:
    """How far an operation got: ``lost`` (the connection failed), ``sent`` (a write may commit), and its
    ``deadline`` (``time.monotonic()``; None: each wait gets the client's timeout)."""

    __slots__ = ("lost", "sent", "deadline")

    def __init__(self, deadline: float | None = None) -> None:
        self.lost: BaseException | None = None
        self.sent = False
        self.deadline = deadline

    def left(self, default: float) -> float:
        """Seconds left to the deadline (``default`` without one), at least 1 ms."""
        if self.deadline is None:
            return default
        return max(0.001, self.deadline - time.monotonic())


class ClientContext:
    """The settings, control channel, caches and buffers of one client (see the module docstring).

    ``drop_session`` is the client's: a path calls it when the session can no longer be trusted.
    Not thread-safe on its own: the client runs one operation at a time.
    """

    def __init__(
        self,
        address: str,
        *,
        token: str | None,
        tls: "TLSConfig | Mapping[str, Any] | bool | None",
        timeout: float,
        connect_timeout: float,
        name: str,
    ) -> None:
        import grpc

        from tensorwire.v1 import store_pb2_grpc

        self.host, self.port = parse_address(address)
        self.address = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        self.tls = TLSConfig.coerce(tls)
        self.timeout = float(timeout)
        self.connect_timeout = float(connect_timeout)
        self.name = name[:128]
        self.md = ((AUTH_KEY, f"Bearer {token.strip()}"),) if token else ()
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            # a daemon that restarts is reached again within ~2 s of being back (gRPC's default backoff
            # grows to 120 s, during which every call fails at once)
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        if self.tls is not None:
            ca, key, cert = self.tls.read()
            creds = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
            if self.tls.server_name:
                options.append(("grpc.ssl_target_name_override", self.tls.server_name))
            self.channel = grpc.secure_channel(self.address, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(self.address, options=options)
        self.stub = store_pb2_grpc.StoreStub(self.channel)
        self.drop_session: Callable[[], None] = lambda: None
        #: The stored spec of each name this client has seen (get_rows splits requests by it).
        self.specs: dict[str, TensorSpec] = {}
        self.pools: dict[tuple[str, str], Pool] = {}
        #: Shard layouts this client expects of names (sent with their requests; absent: a whole tensor).
        self.expect: dict[str, ShardLayout] = {}
        self.expect_pb: dict[str, Any] = {}
        self.expect_packed: dict[str, bytes] = {}
        self._names: dict[str, bytes] = {}

    # -- the control channel -----------------------------------------------------------------------
    def rpc(self, method: str, request: Any, *, timeout: float | None = None, data_op: bool = False) -> Any:
        """Call ``method``; Busy answers are retried with backoff until the timeout; errors translated.

        ``data_op``: an outcome this client cannot know (deadline, lost connection) drops the session,
        whose data connection may hold a transfer the server scheduled.
        """
        import grpc

        timeout = timeout or self.timeout
        deadline = time.monotonic() + timeout
        delay = 0.005
        while True:
            try:
                return getattr(self.stub, method)(
                    request, timeout=max(0.01, deadline - time.monotonic()), metadata=self.md
                )
            except grpc.RpcError as exc:
                err = rpc_error(
                    exc, method, tls=self.tls is not None, connecting=method == "OpenSession", address=self.address
                )
                if isinstance(err, Busy) and deadline - time.monotonic() > delay:
                    # The server did nothing rather than wait for other clients in a control-plane thread.
                    time.sleep(delay)
                    delay = min(delay * 2, 0.2)
                    continue
                if data_op and error_name(exc) is None:
                    self.drop_session()
                raise err from exc

    def close_remote(self, sid: str) -> None:
        """CloseSession, best effort, without waiting for the answer (a daemon cut off would hold the caller
        for the call's 2 s; one that is there also sees the data connection go)."""
        from tensorwire.v1 import store_pb2

        try:
            self.stub.CloseSession.future(
                store_pb2.CloseSessionRequest(session_id=sid), timeout=2.0, metadata=self.md
            ).add_done_callback(_ignore)
        except Exception:  # noqa: BLE001 - best effort
            pass

    def stat(self, name: str) -> TensorStat:
        """The Stat call (the spec is remembered)."""
        from tensorwire.v1 import store_pb2

        st = stat_of(self.rpc("Stat", store_pb2.StatRequest(name=name)).info)
        self.specs[name] = st.spec
        return st

    def declare(self, spec: TensorSpec) -> TensorStat:
        """The Declare call (the spec is remembered)."""
        from tensorwire.v1 import store_pb2

        req = store_pb2.DeclareRequest(spec=spec_to_proto(spec), layout=self.expect_pb.get(spec.name))
        st = stat_of(self.rpc("Declare", req).info)
        self.specs[st.name] = st.spec
        return st

    def stats(self) -> dict[str, TensorStat]:
        """The List call, every page."""
        from tensorwire.v1 import store_pb2

        out: dict[str, TensorStat] = {}
        token = ""
        while True:
            resp = self.rpc("List", store_pb2.ListRequest(page_token=token))
            for info in resp.tensors:
                st = stat_of(info)
                out[st.name] = st
            token = resp.next_page_token
            if not token:
                return out

    def delete(self, name: str) -> None:
        """The Delete call; ``name``'s spec and buffers go."""
        from tensorwire.v1 import store_pb2

        self.rpc("Delete", store_pb2.DeleteRequest(name=name, layout=self.expect_pb.get(name)))
        self.specs.pop(name, None)
        for key in [k for k in self.pools if k[0] == name]:
            del self.pools[key]

    def snapshot(self) -> SnapshotInfo:
        """The Snapshot call (it may take minutes: at least 600 s)."""
        from tensorwire.v1 import store_pb2

        resp = self.rpc("Snapshot", store_pb2.SnapshotRequest(), timeout=max(self.timeout, 600.0))
        return SnapshotInfo(resp.path, int(resp.tensors), int(resp.nbytes), float(resp.seconds))

    def timeout_ms(self, pr: Progress) -> int:
        """The daemon's deadline for an operation's request: what is left of the operation's, less a margin
        (a quarter, at most 2 s) for the daemon's answer to come back before this client gives up."""
        left = pr.left(self.timeout)
        return max(1, int((left - min(2.0, 0.25 * left)) * 1000))

    # -- names and specs ---------------------------------------------------------------------------
    def name_bytes(self, name: Any) -> bytes:
        """``name`` as a request carries it (checked as the daemon would: SpecError)."""
        nb = self._names.get(name) if isinstance(name, str) else None
        if nb is not None:
            return nb
        name = check_name(name)
        try:
            nb = name.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise SpecError(f"tensor name {name!r} is not encodable as UTF-8: {exc}") from None
        if len(self._names) >= 4096:
            self._names.clear()
        self._names[name] = nb
        return nb

    def reply_spec(self, name: str, rep: "wire.Reply") -> TensorSpec:
        """The stored spec a reply describes (the cached one when it has not changed)."""
        spec = self.specs.get(name)
        if spec is not None and spec.shape == rep.shape and spec.dtype == wire.dtype_name(rep.dtype):
            return spec
        spec = TensorSpec(name, rep.shape, wire.dtype_name(rep.dtype))
        self.specs[name] = spec
        return spec

    def row_spec(self, name: str) -> TensorSpec:
        spec = self.specs.get(name)
        return spec if spec is not None else self.stat(name).spec

    def chunk_rows(self, name: str) -> int:
        """Rows of ``name`` per request (262,144 at most, 256 MiB of rows at most)."""
        spec = self.row_spec(name)
        if not spec.shape:
            raise SpecError(f"{spec.name}: a 0-d tensor has no rows")
        row_bytes = (
            max(1, spec.nbytes // spec.shape[0]) if spec.shape[0] else max(1, spec.itemsize * math.prod(spec.shape[1:]))
        )
        return max(1, min(MAX_INDEX_ROWS, MAX_ROWS_BYTES // row_bytes))

    def set_layout(self, name: str, layout: ShardLayout | None) -> bool:
        """Expect ``layout`` of ``name`` from now on; whether that changed anything."""
        if self.expect.get(name) == layout:
            return False
        if layout is None:
            self.expect.pop(name, None)
            self.expect_pb.pop(name, None)
            self.expect_packed.pop(name, None)
        else:
            self.expect[name] = layout
            self.expect_pb[name] = layout.to_proto()
            self.expect_packed[name] = layout.pack()
        return True

    # -- buffers -----------------------------------------------------------------------------------
    def pool(self, name: str, kind: str) -> Pool:
        p = self.pools.get((name, kind))
        if p is None:
            p = self.pools[(name, kind)] = Pool(round_up=kind == "rows")
        return p

    def source(self, key: str, tensor: "torch.Tensor") -> "torch.Tensor":
        """Flat uint8 host bytes of ``tensor``: zero-copy when contiguous on CPU, else staged."""
        t = tensor.detach()
        if t.device.type == "cpu" and t.is_contiguous():
            return as_bytes(t)
        nbytes = t.numel() * t.element_size()
        raw = self.pool(key, "send").acquire(nbytes)
        typed(raw, t.dtype, tuple(t.shape)).copy_(t)
        return raw

    @staticmethod
    def check_tensor(what: str, tensor: Any, *, writable: bool = False) -> "torch.Tensor":
        """``tensor``, or a torch view of an array with ``__dlpack__`` (see :func:`arrays.as_tensor`)."""
        return as_tensor(what, tensor, writable=writable)

    @staticmethod
    def check_out(spec: TensorSpec, out: "torch.Tensor", shape: tuple[int, ...]) -> None:
        if tuple(out.shape) != shape or out.dtype != spec.torch_dtype:
            raise ShapeMismatchError(
                f"{spec.name}: out= is {str(out.dtype).removeprefix('torch.')}{list(out.shape)}, "
                f"the stored tensor gives {spec.dtype}{list(shape)}"
            )

    @staticmethod
    def result(result: "torch.Tensor", out: "torch.Tensor | None") -> "torch.Tensor":
        """``result``, copied into ``out`` first when there is one and it is not ``result`` itself."""
        if out is not None and result is not out:
            out.copy_(result)
            return out
        return result

    def rows_dest(
        self, name: str, got: TensorSpec, n: int, out: "torch.Tensor | None"
    ) -> tuple["torch.Tensor", "torch.Tensor", int]:
        """Where get_rows puts ``n`` rows of ``got``: ``(typed tensor, its bytes, bytes per row)``.

        ``out`` itself when it is a contiguous host tensor, else a pooled buffer (copied into ``out`` by
        :meth:`result`). Raises ShapeMismatchError when ``out`` does not fit (nothing written).
        """
        shape = (n, *got.shape[1:])
        row_bytes = (got.nbytes // got.shape[0]) if got.shape and got.shape[0] else 0
        if out is not None:
            self.check_out(got, out, shape)
            if out.device.type == "cpu" and out.is_contiguous():
                return out, as_bytes(out), row_bytes
        raw = self.pool(name, "rows").acquire(n * row_bytes)
        return typed(raw, got.torch_dtype, shape), raw, row_bytes

    def rows_in_parts(
        self, name: str, idx: "torch.Tensor", out: "torch.Tensor | None", fetch: RowsFetch
    ) -> "torch.Tensor":
        """get_rows over a connection: the index in parts (each read whole), the rows received into one result.

        ``fetch(part)`` asks for one part and returns ``(spec, nbytes, receive, drain)``:
        ``receive(rows, row_bytes, dest)`` takes the part's bytes into ``dest``; ``drain()`` discards
        them (the session stays in step) when the part cannot be taken.
        """
        n = idx.numel()
        chunk = self.chunk_rows(name)
        spec: TensorSpec | None = None
        result = dest_raw = None
        row_bytes = 0
        for start in range(0, max(n, 1), chunk):
            part = idx[start : start + chunk]
            got, nbytes, receive, drain = fetch(part)
            if spec is None:
                spec = got
                try:
                    result, dest_raw, row_bytes = self.rows_dest(name, got, n, out)
                except ShapeMismatchError:
                    drain()
                    raise
            elif got != spec:
                drain()
                raise ShapeMismatchError(f"{name} was replaced by {got.describe()} during get_rows")
            assert dest_raw is not None
            receive(part.numel(), row_bytes, dest_raw[start * row_bytes : start * row_bytes + nbytes])
        assert result is not None
        return self.result(result, out)

    def close(self) -> None:
        self.channel.close()


class RowUpdate:
    """The values of one put_rows / add_rows, validated, in requests of at most :meth:`ClientContext.chunk_rows`.

    ``pick``: the value of index entry ``i`` is ``values[pick[i]]`` (None: ``values[i]``); each value row
    is then copied once, from ``values`` straight to where it goes (a shared-memory region, or the
    bytes sent), with no ``values[pick]`` tensor in between.

    Raises (constructor):
        SpecError: ``values`` is not a tensor. ShapeMismatchError: values and index do not match.
    """

    def __init__(
        self, ctx: ClientContext, name: str, idx: "torch.Tensor", values: Any, pick: "torch.Tensor | None"
    ) -> None:
        values = ctx.check_tensor("values", values)
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
        self.ctx, self.name, self.idx, self.values, self.pick = ctx, name, idx, values, pick

    def parts(self) -> "Iterator[tuple[torch.Tensor, TensorSpec, int, Callable[[Any, Any], None], Callable[[], Any]]]":
        """Per request: (indices, spec of their values, their value bytes, ``fill(dst, copier)`` (``dst``: a
        flat uint8 numpy array), ``data()`` (a flat uint8 host tensor of them))."""
        import numpy as np

        ctx, name, idx, values, pick = self.ctx, self.name, self.idx, self.values, self.pick
        n = idx.numel()
        chunk = ctx.chunk_rows(name)
        vshape = tuple(values.shape[1:])
        row_bytes = values.element_size() * math.prod(vshape)
        if pick is None:
            src = ctx.source(name, values)
        else:
            rows_np = as_bytes(values).numpy().reshape(values.shape[0], row_bytes)
            pick_np = pick.numpy()
        for start in range(0, max(n, 1), chunk):
            part = idx[start : start + chunk]
            k = part.numel()
            nbytes = k * row_bytes
            fill: Callable[[Any, Any], None]
            data: Callable[[], Any]
            if pick is None:
                piece = src[start * row_bytes : start * row_bytes + nbytes]

                def fill(dst: Any, copier: Any, piece: "torch.Tensor" = piece) -> None:
                    copier.copy(dst, piece.numpy())

                def data(piece: "torch.Tensor" = piece) -> "torch.Tensor":
                    return piece
            else:
                which = pick_np[start : start + k]

                def fill(dst: Any, copier: Any, which: Any = which, k: int = k) -> None:
                    copier.take(rows_np, which, dst.reshape(k, row_bytes))

                def data(which: Any = which, k: int = k, nbytes: int = nbytes) -> "torch.Tensor":
                    raw = ctx.pool(name, "send").acquire(nbytes)
                    if nbytes:
                        np.take(rows_np, which, axis=0, out=raw.numpy().reshape(k, row_bytes), mode="clip")
                    return raw

            yield part, TensorSpec(name, (k, *vshape), values.dtype), nbytes, fill, data
