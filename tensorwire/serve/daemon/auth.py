"""The token check of ``tensorwire serve`` (``--token``): a gRPC server interceptor."""

from __future__ import annotations

import hmac
import logging
from typing import TYPE_CHECKING, Any

import grpc

from tensorwire import errors
from tensorwire.serve.protocol.common import AUTH_KEY, ERROR_KEY

if TYPE_CHECKING:  # pragma: no cover
    from tensorwire.serve.daemon.metrics import Metrics

__all__ = ["TokenAuthInterceptor"]

log = logging.getLogger(__name__)


class TokenAuthInterceptor(grpc.ServerInterceptor):
    """Rejects every call that does not carry ``authorization: Bearer <token>``.

    The comparison is constant-time (:func:`hmac.compare_digest`). The
    standard health service stays open (probes carry no credentials; it
    reveals nothing but SERVING/NOT_SERVING).
    """

    OPEN_PREFIXES = ("/grpc.health.v1.Health/",)

    def __init__(self, token: str, metrics: "Metrics | None" = None) -> None:
        if not token:
            raise errors.ConfigError("empty token")
        self._expected = b"Bearer " + token.encode("utf-8")
        self._metrics = metrics

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.set_trailing_metadata(((ERROR_KEY, "AuthError"),))
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        method = handler_call_details.method or ""
        if method.startswith(self.OPEN_PREFIXES):
            return continuation(handler_call_details)
        presented = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTH_KEY:
                presented = value.encode("utf-8", "replace") if isinstance(value, str) else bytes(value)
                break
        if hmac.compare_digest(presented, self._expected):
            return continuation(handler_call_details)
        if self._metrics is not None:
            self._metrics.errors.labels("AuthError").inc()
            self._metrics.operations.labels(method.rsplit("/", 1)[-1][:32], "UNAUTHENTICATED").inc()
        log.warning("rejected %s: missing or wrong token", method[:80])
        return self._deny
