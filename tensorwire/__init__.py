"""tensorwire: RDMA-aware tensor exchange for PyTorch.

Static shapes, slots preallocated once, shapes agreed over a small gRPC control
plane, bytes moved zero-copy over UCX (or plain TCP) straight into the peer's
slot. ``import tensorwire`` is cheap: torch, grpc and ucxx load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tensorwire.errors import (
    AuthError,
    ClosedError,
    ConfigError,
    ConnectTimeout,
    LayoutMismatchError,
    NotFoundError,
    PeerLostError,
    ProtocolError,
    ResourceExhaustedError,
    ShapeMismatchError,
    ShardLostError,
    ConnectError,
    SnapshotError,
    SpecError,
    TensorWireError,
    TransferTimeout,
    TransportError,
    VersionMismatchError,
)
from tensorwire.spec import TensorSpec

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "TensorSpec",
    "Node",
    "Link",
    "init",
    "discover",
    "Plan",
    "Client",
    "metrics",
    # errors
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

_LAZY = {
    "Node": ("tensorwire.p2p.node", "Node"),
    "Link": ("tensorwire.p2p.link", "Link"),
    "init": ("tensorwire.p2p.bootstrap", "init"),
    "discover": ("tensorwire.discovery", "discover"),
    "Plan": ("tensorwire.discovery", "Plan"),
    "Client": ("tensorwire.serve.client", "Client"),
    "metrics": ("tensorwire.observe", "metrics"),
}

if TYPE_CHECKING:  # pragma: no cover
    from tensorwire.serve.client.client import Client
    from tensorwire.p2p.bootstrap import init
    from tensorwire.discovery import Plan, discover
    from tensorwire.p2p.link import Link
    from tensorwire.p2p.node import Node
    from tensorwire.observe import metrics


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'tensorwire' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


# backend="tensorwire" for torch.distributed: registered once torch.distributed is importable, without
# importing torch here (a one-shot import hook when torch is not imported yet; see tensorwire.distributed).
from .distributed import install as _install_dist_backend  # noqa: E402

_install_dist_backend()
