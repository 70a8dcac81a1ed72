"""What every data-plane request handler shares (:mod:`tensorwire.serve.daemon.datapath` has the overview).

:class:`RequestHandlers` holds the service, the store and the metrics, and the
helpers every kind of request answers with: a reply on tag 5 (:meth:`~RequestHandlers._ok`,
an ERROR for a refused commit), the :class:`~tensorwire.serve.daemon.jobs.Job` that
runs an operation and counts it in the session's tally, the job of a request refused
at validation, and the row numbers a request carries. The handlers of each kind are
its subclasses (:mod:`~tensorwire.serve.daemon.datapath_reads`,
:mod:`~tensorwire.serve.daemon.datapath_writes`), put together by
:class:`~tensorwire.serve.daemon.datapath.DataRequests`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from tensorwire.spec import DTYPE_CODES, TensorSpec
from tensorwire.serve.protocol.common import ERROR_CLASSES, TAG_DOWN, TAG_REPLY, check_index
from tensorwire.serve.daemon.ops import Draining, status_of
from tensorwire.serve.daemon.ops import timeout_of as _timeout
from tensorwire.serve.daemon.jobs import Job
from tensorwire.serve.protocol.wire import ERROR, OK, OPS, Request, pack_reply

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.transport.base import Transport
    from tensorwire.serve.daemon.service import StoreService
    from tensorwire.serve.daemon.session import Session

__all__ = ["RequestHandlers", "error_class"]

log = logging.getLogger(__name__)


def error_class(exc: BaseException) -> str:
    """The name under which a client re-raises ``exc`` (its nearest class in ERROR_CLASSES; '' if none)."""
    if isinstance(exc, Draining):
        return "PeerLostError"
    for cls in type(exc).__mro__:
        if cls.__name__ in ERROR_CLASSES and ERROR_CLASSES[cls.__name__] is cls:
            return cls.__name__
    return ""


class RequestHandlers:
    """The state and the helpers of the data-plane request handlers (see the module docstring)."""

    def __init__(self, service: "StoreService") -> None:
        self.service = service
        self.store = service.store
        self.metrics = service.metrics

    def _timeout(self, req: Request) -> float:
        return _timeout(req.timeout_ms, self.service.default_timeout)

    @staticmethod
    def _record(s: "Session", op: str, status: str, t0: float) -> None:
        """Count the operation in the session's tally (from the job running it: one writer at a time)."""
        tally = s.tally
        if tally is not None:
            tally.op(op, status, time.monotonic() - t0)

    @staticmethod
    def _reply(s: "Session", t: "Transport", reply_step: int, deadline: float, **fields: Any) -> None:
        into, out = s.reply_buffer()
        pack_reply(into, **fields)
        t.send(TAG_REPLY, out, step=reply_step, timeout=max(0.0, deadline - time.monotonic()))

    @staticmethod
    def _skip(t: "Transport", step: int, deadline: float) -> None:
        """The message of no bytes that completes a posted receive the payload does not go into (``FLAG_POSTED``:
        another spec than the client expected, or an ERROR), as message ``step`` of tag 1."""
        import torch

        t.send(TAG_DOWN, torch.empty(0, dtype=torch.uint8), step=step, timeout=max(0.0, deadline - time.monotonic()))

    def _ok(
        self,
        s: "Session",
        t: "Transport",
        reply_step: int,
        req: Request,
        spec: TensorSpec,
        deadline: float,
        status: int = OK,
        **fields: Any,
    ) -> None:
        """An OK (or GO) reply with the stored tensor's spec, as message ``reply_step`` of tag 5."""
        out = self._ok_reply(s, req, spec, status, **fields)
        t.send(TAG_REPLY, out, step=reply_step, timeout=max(0.0, deadline - time.monotonic()))

    @staticmethod
    def _ok_reply(s: "Session", req: Request, spec: TensorSpec, status: int = OK, **fields: Any) -> Any:
        """:meth:`_ok`'s reply packed into the session's reply buffer, not sent: the bytes to send."""
        into, out = s.reply_buffer()
        pack_reply(
            into, status=status, op=req.op, req_id=req.req_id, dtype=DTYPE_CODES[spec.dtype], shape=spec.shape, **fields
        )
        return out

    def _fail_reply(
        self, s: "Session", t: "Transport", reply_step: int, req: Request, exc: BaseException, deadline: float
    ) -> BaseException:
        """The final reply of a write whose bytes arrived but whose commit was refused (e.g. deleted meanwhile)."""
        name = error_class(exc)
        if self.metrics is not None:
            self.metrics.errors.labels(name or "internal").inc()
        self._reply(
            s, t, reply_step, deadline, status=ERROR, op=req.op, req_id=req.req_id, error=name, message=str(exc)
        )
        return exc

    def _job(
        self,
        s: "Session",
        req: Request,
        t0: float,
        kind: str,
        body: Callable[["Transport", Job], BaseException | None],
        *,
        deadline: float,
        messages: tuple[int, int, int],
        direction: str,
        nbytes: int,
        cleanup: Callable[[], None] | None = None,
    ) -> Job:
        op = OPS[req.op]

        def run(t: "Transport", step: int) -> None:
            try:
                refused = body(t, job)
            except BaseException as exc:
                self._record(s, op, status_of(exc).name, t0)
                raise
            self._record(s, op, "ok" if refused is None else status_of(refused).name, t0)

        job = Job(kind, run, deadline=deadline, cleanup=cleanup, direction=direction, nbytes=nbytes, messages=messages)
        return job

    def _error_job(self, s: "Session", req: Request, exc: BaseException, t0: float) -> Job:
        name = error_class(exc)
        op = OPS[req.op]
        message = str(exc) if name else "internal error (see the daemon's log)"
        if self.metrics is not None:
            self.metrics.errors.labels(name or "internal").inc()
        status = status_of(exc).name if name else "INTERNAL"
        log.debug("%s request failed: %s: %s", op, name, exc)
        deadline = time.monotonic() + self._timeout(req)

        def run(t: "Transport", step: int) -> None:
            self._record(s, op, status, t0)  # here: the session's tally is written by the job running, only
            self._reply(
                s,
                t,
                job.reply_step,
                deadline,
                status=ERROR,
                op=req.op,
                req_id=req.req_id,
                error=name,
                message=message,
            )
            if req.posted:  # the client's posted receive gets no payload: complete it
                self._skip(t, job.down_step, deadline)

        job = Job(f"{op} error", run, deadline=deadline, direction="", messages=(int(req.posted), 0, 1))
        return job

    def _index_of(self, req: Request, buf: "torch.Tensor", *, copy: bool = False) -> Callable[[int], "torch.Tensor"]:
        import torch

        def index_of(rows: int) -> "torch.Tensor":
            a = req.index_offset
            # In place: the session posts ``buf`` again only once the job is done. A shared-memory
            # write outlives its job (it commits on a later request): it keeps a copy.
            idx = buf[a : a + 8 * req.nindex].view(torch.int64)
            return check_index(idx.clone() if copy else idx, rows)

        return index_of
