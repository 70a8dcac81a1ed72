"""The tensorwire exception tree.

Every error tensorwire raises derives from :class:`TensorWireError`. Errors of
the libraries underneath (ucxx, grpc, sockets) are translated where they enter
tensorwire and chained with ``raise ... from exc`` so the original stays
visible in the traceback.

::

    TensorWireError
    ├── ConfigError            bad configuration or arguments (also a ValueError)
    ├── SpecError              an invalid TensorSpec (also a ValueError)
    │   └── ShapeMismatchError a tensor or spec differs from the negotiated one
    │       └── LayoutMismatchError  a shard's layout differs from the one a request expects
    ├── AuthError              missing/wrong token, TLS mismatch, bad session credential
    ├── ResourceExhaustedError over a configured memory or size limit
    ├── NotFoundError          no tensor of that name (serve)
    ├── SnapshotError          a snapshot could not be written, or one on disk is corrupt (serve)
    ├── ProtocolError          the peer broke the wire protocol
    │   └── VersionMismatchError  the peer speaks another protocol version
    ├── TransportError         the data plane or control plane failed
    │   ├── PeerLostError      the peer went away (killed, link cut, reset)
    │   │   ├── ShardLostError a daemon of a sharded client is unreachable (names it)
    │   │   └── ConnectError   nothing accepts connections at the address (never reached)
    │   ├── ConnectTimeout     could not connect or negotiate in time (also TimeoutError)
    │   └── TransferTimeout    a send/recv did not complete in time (also TimeoutError)
    └── ClosedError            you used a Link/Node/Client after closing it

``ClosedError`` (you closed it) and ``PeerLostError`` (the peer broke it) are
deliberately different, as in trio's ``ClosedResourceError`` /
``BrokenResourceError``.
"""

from __future__ import annotations

__all__ = [
    "TensorWireError",
    "ConfigError",
    "SpecError",
    "ShapeMismatchError",
    "LayoutMismatchError",
    "AuthError",
    "ResourceExhaustedError",
    "NotFoundError",
    "SnapshotError",
    "ProtocolError",
    "VersionMismatchError",
    "TransportError",
    "PeerLostError",
    "ShardLostError",
    "ConnectError",
    "ConnectTimeout",
    "TransferTimeout",
    "ClosedError",
]


class TensorWireError(Exception):
    """Root of every error raised by tensorwire."""


class ConfigError(TensorWireError, ValueError):
    """Invalid configuration, argument or environment variable."""


class SpecError(TensorWireError, ValueError):
    """A TensorSpec is invalid (bad name, dtype, rank or size)."""


class ShapeMismatchError(SpecError):
    """A tensor or a declared spec differs from what was negotiated.

    The message always names the tensor and shows both sides.
    """


class LayoutMismatchError(ShapeMismatchError):
    """A tensor is stored with another shard layout than the request expects (``tensorwire serve``).

    Raised by a daemon (and by the sharded client before it asks one) when a
    client over another daemon list -- other members or another order -- or a
    client over no list at all addresses a shard, or a sharded client
    addresses a whole tensor. Nothing was read or written.
    """


class AuthError(TensorWireError):
    """Authentication or authorization failed (token, TLS, data-plane credential)."""


class ResourceExhaustedError(TensorWireError):
    """A configured limit (e.g. ``--max-bytes``) would be exceeded; nothing changed."""


class NotFoundError(TensorWireError, KeyError):
    """No tensor of that name."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want plain text
        return str(self.args[0]) if self.args else ""


class SnapshotError(TensorWireError):
    """A snapshot could not be written (the previous one is kept), or one on disk is unreadable or corrupt."""


class ProtocolError(TensorWireError):
    """The peer sent something that breaks the wire protocol."""


class VersionMismatchError(ProtocolError):
    """The peer speaks a protocol version this build does not."""


class TransportError(TensorWireError):
    """The data plane or the control plane failed."""


class PeerLostError(TransportError, ConnectionError):
    """The peer is gone: killed, connection reset, or the network cut."""


class ShardLostError(PeerLostError):
    """A daemon of a sharded client is unreachable (down, restarting, cut off).

    ``address`` names it. Operations on the other daemons go on; the client
    reconnects by itself on a later call once the daemon is back.
    """

    def __init__(self, message: str, *, address: str = "") -> None:
        super().__init__(message)
        self.address = address


class ConnectError(PeerLostError):
    """Nothing accepts connections at the address (refused, no route, no such host): the peer was never
    reached. A ``PeerLostError`` too, so handlers of a lost peer keep catching it."""


class ConnectTimeout(TransportError, TimeoutError):
    """Connecting to or negotiating with a peer did not finish in time."""


class TransferTimeout(TransportError, TimeoutError):
    """A send or receive did not complete within its timeout."""


class ClosedError(TensorWireError):
    """The object was closed by its owner and cannot be used any more."""
