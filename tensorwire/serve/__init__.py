"""``tensorwire serve``: a tensor store daemon with a gRPC control plane and a UCX/TCP data plane.

Layers (as in uvicorn): :class:`ServeConfig` (frozen, validated) ->
:class:`Server` (start / stop / serve_forever) -> the CLI in
:mod:`tensorwire.serve.cli`. Clients use :class:`tensorwire.serve.client.client.Client`.

Importing this package is cheap: the server and its dependencies (grpc,
torch, prometheus_client) load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tensorwire.serve.daemon.config import ServeConfig, TLSConfig, format_size, parse_size

if TYPE_CHECKING:  # pragma: no cover
    from tensorwire.serve.daemon.server import Server

__all__ = ["ServeConfig", "TLSConfig", "Server", "parse_size", "format_size"]


def __getattr__(name: str) -> Any:
    if name == "Server":
        from tensorwire.serve.daemon.server import Server

        return Server
    raise AttributeError(name)
