"""``tensorwire serve``: a tensor store daemon with a gRPC control plane and a UCX/TCP data plane.

Layers (as in uvicorn): :class:`ServeConfig` (frozen, validated) ->
:class:`Server` (start / stop / serve_forever) -> the CLI in
:mod:`tensorwire.serve.cli`. Clients use :class:`tensorwire.serve.client.client.Client`.

Importing this package is cheap: the server and its dependencies (grpc,
torch, prometheus_client) load on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from tensorwire.serve.daemon.config import ServeConfig, TLSConfig, format_size, parse_size
    from tensorwire.serve.daemon.server import Server

__all__ = ["ServeConfig", "TLSConfig", "Server", "parse_size", "format_size"]

# Loaded on first use, so that importing the client (``tensorwire.serve.client``) loads none of the daemon.
_LAZY = {
    "ServeConfig": "tensorwire.serve.daemon.config",
    "TLSConfig": "tensorwire.serve.protocol.tls",
    "parse_size": "tensorwire.serve.daemon.config",
    "format_size": "tensorwire.serve.daemon.config",
    "Server": "tensorwire.serve.daemon.server",
}


def __getattr__(name: str) -> Any:
    try:
        module = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'tensorwire.serve' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
