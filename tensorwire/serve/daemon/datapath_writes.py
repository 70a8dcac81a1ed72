"""Data-plane writes: put, put_rows and add_rows, and the COMMIT of a shared-memory write.

A put receives into the staging slot and commits only once every byte has
arrived; row updates commit under the entry's exclusive row lock. Through shared
memory the client fills the slot (or the session's scratch region) and sends
COMMIT; a put's COMMIT may grant the next put ahead (see
:mod:`tensorwire.serve.daemon.datapath` for the whole protocol).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from tensorwire import errors
from tensorwire.spec import TensorSpec
from tensorwire.serve.protocol.common import TAG_UP
from tensorwire.serve.daemon.ops import commit_rows, plan_row_update, status_of
from tensorwire.serve.daemon.ops import recv_posted as _recv_posted
from tensorwire.serve.daemon.ops import typed_view as _typed
from tensorwire.serve.daemon.jobs import Job, PendingWrite
from tensorwire.serve.daemon.entry import region_of
from tensorwire.serve.protocol.wire import FALLBACK, GO, OPS, SHM, Request, dtype_name
from tensorwire.serve.daemon.store import normalise_spec
from tensorwire.serve.protocol.shm import ShmError
from tensorwire.serve.daemon.datapath_base import RequestHandlers

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.transport.base import Transport
    from tensorwire.serve.daemon.session import Session

__all__ = ["WriteRequests"]

log = logging.getLogger(__name__)


class WriteRequests(RequestHandlers):
    """The handlers of put, put_rows, add_rows and COMMIT (see the module docstring)."""

    def _receive(
        self,
        s: "Session",
        t: "Transport",
        job: Job,
        req: Request,
        spec: TensorSpec,
        into: "torch.Tensor",
        nbytes: int,
        deadline: float,
        what: str,
    ) -> None:
        """Post ``into`` on tag 2, say GO, wait for the client's bytes; a failure closes the session first."""
        posted = False
        try:
            if nbytes:
                t.post_recv(TAG_UP, into)
                posted = True
            self._ok(s, t, job.reply_step, req, spec, deadline, status=GO, step=job.up_step, nbytes=nbytes)
            if nbytes:
                _recv_posted(t, into, nbytes, job.up_step, deadline)
        except BaseException as exc:
            if posted:
                # Close (abort the transport) before the slot is released: nothing can land in it later.
                s.close(f"{what} transfer failed: {exc}")
            raise

    def _put(self, s: "Session", req: Request, t0: float, held: Any = None) -> Job:
        dtype = dtype_name(req.dtype)
        timeout = self._timeout(req)
        deadline = time.monotonic() + timeout
        slot = -1
        if held is not None and held.spec.shape == req.shape and held.spec.dtype == dtype:
            # the tensor as stored (its layout checked): nothing to declare, no spec to build and validate
            e, spec = held, held.spec
            try:
                slot = e.begin_put(deadline)
            except errors.NotFoundError:  # deleted meanwhile: this put declares it again, as any other would
                slot = -1
        if slot < 0:
            spec = normalise_spec(TensorSpec(req.name, req.shape, dtype))
            e, _ = self.store.declare(spec, layout=req.layout)
            slot = e.begin_put(deadline)
        reserved = [True]

        def end() -> None:
            if reserved[0]:
                reserved[0] = False
                e.end_put()

        try:
            raw, nbytes = e.slot(slot).raw, e.nbytes
            region = region_of(e.slot(slot)) if req.shm else None
            if region is not None:
                reserved[0] = False  # the shared-memory write owns the reservation now (abort = end_put)
                return self._shm_write(
                    s,
                    req,
                    t0,
                    "put",
                    spec,
                    region,
                    nbytes,
                    deadline,
                    lambda: e.commit_put(slot, time.monotonic() + timeout),
                    e.end_put,
                    entry=e,
                )

            def body(t: "Transport", job: Job) -> BaseException | None:
                self._receive(s, t, job, req, spec, raw, nbytes, deadline, "put")
                reserved[0] = False  # commit_put releases the reservation, whatever happens
                try:
                    info = e.commit_put(slot, time.monotonic() + timeout)
                except errors.TensorWireError as exc:
                    return self._fail_reply(s, t, job.reply_step + 1, req, exc, deadline)
                self._ok(s, t, job.reply_step + 1, req, spec, deadline, version=info.version)
                return None

            return self._job(
                s,
                req,
                t0,
                "put",
                body,
                deadline=deadline,
                messages=(0, 1 if nbytes else 0, 2),
                direction="in",
                nbytes=nbytes,
                cleanup=end,
            )
        except BaseException:
            end()
            raise

    def _put_rows(self, s: "Session", req: Request, buf: "torch.Tensor", t0: float, *, add: bool) -> Job:
        values = TensorSpec(req.name, req.shape, dtype_name(req.dtype))
        p = plan_row_update(self.store, req.name, self._index_of(req, buf, copy=req.shm), values, add)
        timeout = self._timeout(req)
        deadline = time.monotonic() + timeout
        nbytes, spec = p.nbytes, p.spec
        kind = "add_rows" if add else "put_rows"
        if req.shm and nbytes and self.store.shm is not None:
            try:
                region = s.shm_scratch(nbytes, self.store)
            except (errors.ResourceExhaustedError, ShmError) as exc:
                log.debug("%s through shared memory refused (%s); over the data connection", kind, exc)
            else:
                vals = _typed(region.tensor[:nbytes], spec.torch_dtype, p.shape)
                return self._shm_write(
                    s,
                    req,
                    t0,
                    kind,
                    spec,
                    region,
                    nbytes,
                    deadline,
                    lambda: commit_rows(p, vals, add, timeout),
                    lambda: None,
                )
        s.reserve_scratch(nbytes)  # charged against --max-bytes before the client is told to send

        def body(t: "Transport", job: Job) -> BaseException | None:
            into = s.scratch(nbytes)
            self._receive(s, t, job, req, spec, into, nbytes, deadline, kind)
            try:
                info = commit_rows(p, _typed(into, spec.torch_dtype, p.shape), add, timeout)
            except errors.TensorWireError as exc:
                return self._fail_reply(s, t, job.reply_step + 1, req, exc, deadline)
            self._ok(s, t, job.reply_step + 1, req, spec, deadline, version=info.version)
            return None

        job = self._job(
            s,
            req,
            t0,
            kind,
            body,
            deadline=deadline,
            messages=(0, 1 if nbytes else 0, 2),
            direction="in",
            nbytes=nbytes,
        )
        job.holds_request = not req.shm  # p.index is a view of the request's buffer (a shared-memory one a copy)
        return job

    def _shm_write(
        self,
        s: "Session",
        req: Request,
        t0: float,
        kind: str,
        spec: TensorSpec,
        region: Any,
        nbytes: int,
        deadline: float,
        commit: Callable[[], Any],
        abort: Callable[[], None],
        entry: Any = None,
    ) -> Job:
        """The SHM reply of a write: the client fills ``region[:nbytes]``, then COMMIT runs ``commit``.

        Until the reply is out the job owns the reservation (``abort`` on failure); from then on the
        session's pending write does (COMMIT, or ``abort`` when the session closes).
        """
        op = OPS[req.op]
        handed = [False]

        def run(t: "Transport", step: int) -> None:
            try:
                done = Job(kind, lambda t_, s_: None, deadline=deadline)
                done.done.set()
                p = PendingWrite(
                    s.next_op_id(), done, commit, abort, shm_op=op, deadline=deadline, nbytes=nbytes, t0=t0
                )
                p.name = req.name  # type: ignore[attr-defined]
                p.entry = entry  # type: ignore[attr-defined]  # a put: its commit may grant the next one
                with s._lock:
                    if s.closed:
                        raise errors.ClosedError(f"session closed: {s.close_reason}")
                    if s.pending is not None:
                        raise errors.ProtocolError("a write is pending on this session: commit or abort it first")
                    s.pending = p
                    handed[0] = True
                self._ok(
                    s,
                    t,
                    job.reply_step,
                    req,
                    spec,
                    deadline,
                    status=SHM,
                    nbytes=nbytes,
                    chunk=0,
                    message=region.name,
                )
            except BaseException as exc:
                self._record(s, op, status_of(exc).name, t0)
                raise

        def cleanup() -> None:
            if not handed[0]:
                abort()

        # no direction: the bytes are counted by the COMMIT; nbytes says what the client copies meanwhile
        job = Job(kind, run, deadline=deadline, cleanup=cleanup, direction="", nbytes=nbytes, messages=(0, 0, 1))
        job.client_copy = nbytes
        return job

    def _commit(self, s: "Session", req: Request, t0: float) -> Job:
        """COMMIT: apply the session's shared-memory write and answer with the version (or the error)."""
        if req.ahead:
            return self._commit_ahead(s, req, t0)
        with s._lock:
            p = s.pending
            if p is None or not p.shm_op or p.finished:
                raise errors.ProtocolError("no shared-memory write is waiting for a commit on this session")
            if getattr(p, "name", req.name) != req.name:
                raise errors.ProtocolError(f"COMMIT of {req.name!r}, the write under way is {p.name!r}")  # type: ignore[attr-defined]
            p.finished = True
            s.pending = None
        return self._commit_job(s, req, p.shm_op, p.t0, p.nbytes, p.commit, p.abort, getattr(p, "entry", None))

    def _commit_job(
        self,
        s: "Session",
        req: Request,
        op: str,
        t0: float,
        nbytes: int,
        commit: Callable[[], Any],
        abort: Callable[[], None],
        entry: Any,
    ) -> Job:
        """The job answering a COMMIT: ``commit()`` (its error is the reply), else OK with the version and, for a
        put (``entry``), maybe the next write-ahead grant; ``abort()`` if the session closes before it runs."""
        deadline = time.monotonic() + self._timeout(req)
        tried = [False]

        def run(t: "Transport", step: int) -> None:
            tried[0] = True
            try:
                try:
                    info = commit()
                except errors.TensorWireError as exc:
                    job.direction = ""  # refused: no bytes went in
                    self._fail_reply(s, t, job.reply_step, req, exc, deadline)
                    self._record(s, op, status_of(exc).name, t0)
                    return
                self._ok(
                    s,
                    t,
                    job.reply_step,
                    req,
                    info.spec,
                    deadline,
                    version=info.version,
                    **self._grant(s, job, entry),
                )
            except BaseException as exc:
                self._record(s, op, status_of(exc).name, t0)
                raise
            self._record(s, op, "ok", t0)

        def cleanup() -> None:
            if not tried[0]:  # never ran (the session closed first): the reservation must go
                abort()

        job = Job("commit", run, deadline=deadline, cleanup=cleanup, direction="in", nbytes=nbytes, messages=(0, 0, 1))
        job.via = "shm"
        return job

    def _grant(self, s: "Session", job: Job, entry: Any) -> dict[str, Any]:
        """The reply fields of a write-ahead grant for the session's next put of ``entry`` ({}: none)."""
        if entry is None or self.service.draining:
            return {}
        g = s.grant_ahead(entry)
        if g is None:
            return {}
        job.client_copy = entry.nbytes  # what the client's next put copies before it asks again
        return {"message": g.region.name, "step": g.ticket, "nbytes": entry.nbytes, "chunk": 0}

    def _commit_ahead(self, s: "Session", req: Request, t0: float) -> Job:
        """A COMMIT with FLAG_AHEAD: the put the client wrote into its grant's slot (FALLBACK if the grant ended)."""
        g = s.take_ahead()
        named = g is not None and g.ticket == req.ahead and g.entry.spec.name == req.name
        if g is not None and not named:
            s.give_back_ahead(g)  # not the grant this COMMIT names: the session's next request ends it
        if not named or not g.claim():
            deadline = time.monotonic() + self._timeout(req)

            def fallback(t: "Transport", job: Job) -> BaseException | None:
                self._reply(s, t, job.reply_step, deadline, status=FALLBACK, op=req.op, req_id=req.req_id)
                return None

            return self._job(
                s, req, t0, "commit fallback", fallback, deadline=deadline, messages=(0, 0, 1), direction="", nbytes=0
            )
        e, timeout = g.entry, self._timeout(req)
        return self._commit_job(
            s, req, "Put", t0, e.nbytes, lambda: e.commit_put(g.idx, time.monotonic() + timeout), e.end_put, e
        )
