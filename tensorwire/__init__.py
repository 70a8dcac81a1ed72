"""tensorwire: RDMA-aware tensor exchange for PyTorch.

Static shapes, slots preallocated once, shapes agreed over a small gRPC control
plane, bytes moved zero-copy over UCX (or plain TCP) straight into the peer's
slot. ``import tensorwire`` is cheap: torch, grpc and ucxx load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    AuthError,
    ClosedError,
    ConfigError,
    ConnectTimeout,
    NotFoundError,
    PeerLostError,
    ProtocolError,
    ResourceExhaustedError,
    ShapeMismatchError,
    SpecError,
    TensorWireError,
    TransferTimeout,
    TransportError,
    VersionMismatchError,
)
from .spec import TensorSpec

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
    # errors
    "TensorWireError",
    "ConfigError",
    "SpecError",
    "ShapeMismatchError",
    "AuthError",
    "ResourceExhaustedError",
    "NotFoundError",
    "ProtocolError",
    "VersionMismatchError",
    "TransportError",
    "PeerLostError",
    "ConnectTimeout",
    "TransferTimeout",
    "ClosedError",
]

_LAZY = {
    "Node": ("tensorwire.node", "Node"),
    "Link": ("tensorwire.node", "Link"),
    "init": ("tensorwire.bootstrap", "init"),
    "discover": ("tensorwire.discovery", "discover"),
    "Plan": ("tensorwire.discovery", "Plan"),
    "Client": ("tensorwire.client", "Client"),
}

if TYPE_CHECKING:  # pragma: no cover
    from .client import Client
    from .bootstrap import init
    from .discovery import Plan, discover
    from .node import Link, Node


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
