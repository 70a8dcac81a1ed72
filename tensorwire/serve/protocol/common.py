"""Constants and helpers shared by the serve daemon and :class:`tensorwire.serve.client.client.Client`.

Stdlib only (torch is imported lazily), so the CLI stays fast.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

from tensorwire import errors

if TYPE_CHECKING:  # pragma: no cover
    import grpc
    import torch

PROTOCOL_VERSION = 1
SERVICE = "tensorwire.v1.Store"
#: The daemon's gRPC port when an address names none.
DEFAULT_PORT = 7100

#: Data-plane tags of a session (see proto/tensorwire/v1/store.proto).
TAG_DOWN = 1  # server -> client: tensor bytes
TAG_UP = 2  # client -> server: tensor bytes
TAG_WATCH = 3  # never sent on: the server waits on it to notice a lost client (sessions without data requests)
TAG_REQUEST = 4  # client -> server: data-plane requests (tensorwire.serve.protocol.wire)
TAG_REPLY = 5  # server -> client: their fixed-size replies

#: Version of the data-plane request format (tensorwire.serve.protocol.wire) this code speaks: the version byte
#: of every request and reply.
DATA_REQUESTS_VERSION = 1
#: What this code offers in OpenSession's ``data_requests`` (the session uses the lower of the client's and the
#: server's; 0: none, use the gRPC calls): 1, the data-plane requests; 2 (:data:`POSTED_READS`), also reads whose
#: payload receive the client posted before the request (``FLAG_POSTED``). Same format version either way.
DATA_REQUESTS_LEVEL = 2
POSTED_READS = 2

#: gRPC messages are control messages only.
MAX_MESSAGE_BYTES = 4 << 20
#: Rows per *Rows request (indices ride inline as int64: 2 MiB). Clients split bigger requests.
MAX_INDEX_ROWS = 1 << 18
#: Bytes of rows per *Rows request (the server's per-session scratch is at most this).
MAX_ROWS_BYTES = 256 << 20
#: Tensors one store holds.
MAX_TENSORS = 1 << 16
#: Specs per List page.
LIST_PAGE = 1000
#: Server-side upper bound on one transfer's timeout.
MAX_TIMEOUT_S = 3600.0
#: Length of session ids (hex).
SESSION_ID_LEN = 32

#: Trailing-metadata key naming the tensorwire error class of a failed call.
ERROR_KEY = "tw-error"
AUTH_KEY = "authorization"

#: Error classes a server may name in ERROR_KEY (anything else is ignored).
ERROR_CLASSES: dict[str, type[errors.TensorWireError]] = {
    cls.__name__: cls
    for cls in (
        errors.ConfigError,
        errors.SpecError,
        errors.ShapeMismatchError,
        errors.LayoutMismatchError,
        errors.AuthError,
        errors.ResourceExhaustedError,
        errors.NotFoundError,
        errors.SnapshotError,
        errors.ProtocolError,
        errors.VersionMismatchError,
        errors.TransportError,
        errors.PeerLostError,
        errors.TransferTimeout,
        errors.ClosedError,
    )
}
#: Marker for "your session is gone; open a new one" (not an exception class).
SESSION_LOST = "SessionLost"


class SessionLost(errors.PeerLostError):
    """The server no longer knows this session (closed, expired, or the server restarted)."""


ERROR_CLASSES[SESSION_LOST] = SessionLost
#: Marker for "the server would have to wait for other clients; nothing was done: call again".
BUSY = "Busy"


class Busy(errors.ResourceExhaustedError):
    """The server did not wait for other clients' transfers in a control-plane thread; nothing was done: retry.

    Clients of this package retry such calls with backoff until their own timeout.
    """


ERROR_CLASSES[BUSY] = Busy

_I64 = struct.Struct("<q")


def encode_index(index: "torch.Tensor") -> bytes:
    """A 1-D int64 CPU tensor as packed little-endian bytes."""
    import sys

    arr = index.numpy()
    if sys.byteorder != "little":  # pragma: no cover
        arr = arr.byteswap()
    return arr.tobytes()


def decode_index(data: bytes, rows: int) -> "torch.Tensor":
    """Validate and decode packed int64 row indices against a tensor of ``rows`` rows.

    Raises:
        SpecError: wrong length, too many, or out of range (the message says which).
    """
    import torch

    if len(data) % 8:
        raise errors.SpecError(f"index: {len(data)} bytes is not a whole number of int64")
    n = len(data) // 8
    if n > MAX_INDEX_ROWS:
        raise errors.SpecError(f"index: {n} rows exceeds the per-request limit of {MAX_INDEX_ROWS}")
    if n == 0:
        return torch.empty(0, dtype=torch.int64)
    return check_index(torch.frombuffer(bytearray(data), dtype=torch.int64), rows)


def check_index(idx: "torch.Tensor", rows: int) -> "torch.Tensor":
    """Check a 1-D int64 index against a tensor of ``rows`` rows; returns it.

    Raises:
        SpecError: a row out of range (the message names it).
    """
    if idx.numel() > MAX_INDEX_ROWS:
        raise errors.SpecError(f"index: {idx.numel()} rows exceeds the per-request limit of {MAX_INDEX_ROWS}")
    if idx.numel() == 0:
        return idx
    if idx.numel() <= 16:  # (a few rows: one call into torch, not three)
        vals = idx.tolist()
        lo, hi = min(vals), max(vals)
    else:
        import torch

        lo_t, hi_t = torch.aminmax(idx)
        lo, hi = int(lo_t), int(hi_t)
    if lo < 0 or hi >= rows:
        bad = lo if lo < 0 else hi
        raise errors.SpecError(f"index: row {bad} out of range for a tensor of {rows} rows")
    return idx


def as_index(index: Any) -> "torch.Tensor":
    """Anything index-like (list, ndarray, tensor) -> a 1-D contiguous int64 CPU tensor.

    Raises:
        SpecError: not integral or not 1-D.
    """
    import torch

    if isinstance(index, torch.Tensor):
        if index.dtype == torch.int64 and index.dim() == 1 and index.is_cpu and index.is_contiguous():
            return index  # the usual case, in a few hundred nanoseconds (an integer tensor has no grad to detach)
        t = index.detach()
    else:
        try:
            t = torch.as_tensor(index)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise errors.SpecError(f"index must be a sequence of ints: {exc}") from exc
    if t.numel() == 0 and t.dim() == 1:
        return torch.empty(0, dtype=torch.int64)  # [] is a float tensor to torch
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise errors.SpecError(f"index must hold integers, got {t.dtype}")
    if t.dim() != 1:
        raise errors.SpecError(f"index must be 1-D, got shape {tuple(t.shape)}")
    return t.to(device="cpu", dtype=torch.int64).contiguous()


def raise_rpc_error(exc: "grpc.RpcError", what: str, *, tls: bool = False) -> None:
    """Translate a gRPC error into the tensorwire error tree (``raise ... from exc``)."""
    raise rpc_error(exc, what, tls=tls) from exc


def error_name(exc: Any) -> str | None:
    """The tensorwire error class a server named in a failed call's trailing metadata.

    A call that carries one was refused by the server before it scheduled
    anything; one without it (deadline, connection lost, ...) is of unknown outcome.
    """
    try:
        for key, value in exc.trailing_metadata() or ():
            if key == ERROR_KEY and value in ERROR_CLASSES:
                return value
    except Exception:  # noqa: BLE001 - a broken call has no metadata
        pass
    return None


#: What gRPC says (lower case) when no connection to any address of the target could be made.
_NOT_REACHED = ("failed to connect to all addresses", "connection refused", "dns resolution failed", "no route to host")


def rpc_error(
    exc: Any, what: str, *, tls: bool = False, connecting: bool = False, address: str = ""
) -> errors.TensorWireError:
    """The tensorwire error for a failed gRPC call ``what``.

    ``connecting``: the call opens a session (the first contact): a server never reached is then a
    :class:`~tensorwire.errors.ConnectError` naming ``address``, a connection closed during the
    handshake an ``AuthError``.
    """
    import grpc

    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    name = error_name(exc)
    cls = ERROR_CLASSES.get(name or "")
    if cls is not None:
        return cls(details)
    msg = f"{what}: {details}"
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return errors.AuthError(msg)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return errors.ResourceExhaustedError(msg)
    if code == grpc.StatusCode.NOT_FOUND:
        return errors.NotFoundError(msg)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return errors.TransferTimeout(msg)
    if code == grpc.StatusCode.UNAVAILABLE:
        low = details.lower()
        if any(w in low for w in ("ssl", "tls handshake", "handshake failed", "certificate")):
            return errors.AuthError(f"{what}: TLS handshake with the server failed: {details}")
        if connecting and "socket closed" in low:
            # A server that closes a fresh connection at once refused our handshake:
            # it speaks TLS and we do not, or it wants a client certificate we lack.
            hint = "a client certificate (tls={'cert': ..., 'key': ...})" if tls else "TLS (tls={'ca': ...})"
            return errors.AuthError(
                f"{what}: the server closed the connection during the handshake; it may require {hint}: {details}"
            )
        if connecting and any(w in low for w in _NOT_REACHED):
            where = f" at {address}" if address else ""
            return errors.ConnectError(
                f"no tensorwire daemon reachable{where}: nothing accepted the connection (is `tensorwire serve` "
                f"running there, on that port?): {details}"
            )
        return errors.PeerLostError(msg)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return errors.ProtocolError(msg)
    return errors.TransportError(f"{msg} ({code.name if code else 'no status'})")
