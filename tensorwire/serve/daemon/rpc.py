"""How each handler of the ``tensorwire.v1.Store`` servicer is wrapped (:func:`rpc`), and the one
conversion the handlers share (:func:`info_proto`).

:func:`rpc` refuses new work while the server drains, turns a
:class:`~tensorwire.errors.TensorWireError` into the gRPC status and the ``tw-error``
trailing metadata that name its class (the client raises the same class again),
logs anything else as an internal error, and counts every call in the metrics.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

import grpc

from tensorwire import errors
from tensorwire._proto import spec_to_proto
from tensorwire.v1 import store_pb2
from tensorwire.serve.protocol.common import ERROR_KEY
from tensorwire.serve.daemon.ops import Draining, status_of
from tensorwire.serve.daemon.entry import Info

if TYPE_CHECKING:  # pragma: no cover
    from tensorwire.serve.daemon.service import StoreService

__all__ = ["rpc", "info_proto"]

log = logging.getLogger(__name__)


def rpc(op: str, *, new_work: bool = False) -> Callable:
    """Wrap a handler: draining check, error translation, metrics."""

    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def handler(self: "StoreService", request: Any, context: grpc.ServicerContext) -> Any:
            t0 = time.monotonic()
            status = "ok"
            try:
                if new_work and self.draining:
                    raise Draining("the server is shutting down and takes no new work")
                return fn(self, request, context)
            except errors.TensorWireError as exc:
                code = status_of(exc)
                status = code.name
                name = type(exc).__name__
                if isinstance(exc, Draining):
                    name = "PeerLostError"
                elif isinstance(exc, errors.ClosedError) and "session" in str(exc):
                    name = "SessionLost"
                if self.metrics is not None:
                    self.metrics.errors.labels(name).inc()
                log.debug("%s failed: %s: %s", op, name, exc)
                context.set_trailing_metadata(((ERROR_KEY, name),))
                context.abort(code, str(exc))
            except Exception:
                status = "INTERNAL"
                if self.metrics is not None:
                    self.metrics.errors.labels("internal").inc()
                log.exception("%s: internal error", op)
                context.abort(grpc.StatusCode.INTERNAL, "internal error (see the daemon's log)")
            finally:
                if self.metrics is not None:
                    self.metrics.operations.labels(op, status).inc()
                    self.metrics.operation_seconds.labels(op).observe(time.monotonic() - t0)

        return handler

    return deco


def info_proto(info: Info) -> store_pb2.TensorInfo:
    return store_pb2.TensorInfo(
        spec=spec_to_proto(info.spec),
        version=info.version,
        nbytes=info.nbytes,
        layout=info.layout.to_proto() if info.layout is not None else None,
    )
