"""Server side of data-plane requests (the format is in :mod:`tensorwire.serve.protocol.wire`).

A session's request thread (:class:`tensorwire.serve.daemon.session.Session`) hands
every request it receives on tag 4 to :class:`DataRequests`, which checks it
as completely as the gRPC handler of the same operation does -- with the same
helpers (:func:`~tensorwire.serve.daemon.service.plan_rows` and friends), before it
reserves, pins or allocates anything -- and returns a
:class:`~tensorwire.serve.daemon.session.Job`: either the operation (its reply on
tag 5, then its bytes on tag 1 or 2) or an ERROR reply naming the error class.
The session runs the job at once in the request thread when nothing else is
queued (the usual case: a client runs one operation at a time), so an
operation costs no thread hand-off and no gRPC call.

Consistency is the gRPC path's: a read pins the version it reads
(``acquire_read``) from validation until its bytes are out of the slot (get)
or gathered (get_rows); a put receives into the staging slot and commits only
once every byte has arrived; row updates commit under the entry's exclusive
row lock.

get_rows: the request thread sends the OK reply first (the client posts its
receives while the rows are gathered), lets the transport progress once
(:meth:`Session.nudge`: on UCX the client's request, a rendezvous when it
carries thousands of row numbers, may complete only then), gathers the rows
into the session's scratch buffer and sends them. How was chosen by measurement
on the 2-core VM (figures with the constants below; the end-to-end result is in
bench/results/archive/serve_cpu2_2026-11-22.md):

- on UCX, in chunks of ``ROWS_CHUNK_BYTES``, each posted (``start_send``) as
  soon as it is gathered: the client's process copies chunk i out of this
  process's memory (cma) while chunk i + 1 is gathered, so the two processes
  use both cores; the reply's ``chunk`` tells the client how to post;
- from ``PARALLEL_MIN_BYTES``, gathered by two threads (this one and the
  session's helper thread, :class:`Gatherer`, made on first use), one message;
- otherwise (TCP, where the sender is the one copying into the socket) one
  gather, one message.

Shared memory (requests with ``FLAG_SHM`` on a session whose client proved it
maps this daemon's memory, see :mod:`tensorwire.serve.protocol.shm`): no tensor bytes
cross the data connection.

- get: the version is pinned and the SHM reply names its slot's region; the
  client copies it out. The pin is released by the session's next request (or
  a RELEASE the client sends once idle, or close): a RELEASE after every read
  cost ~0.1 ms per operation on the 2-core VM (the client's send, the
  daemon's handling before the next request).
- both carry a read lease (sessions of shm version >= 2): the tensor's cell in
  the store's lease table and its generation for the pinned version, read
  with the pin under the tensor's lock; the client reads that version again
  without a request while the generation holds (:class:`tensorwire.serve.protocol.shm.Leases`).
- get_rows: the same pin and reply (the whole table); the client gathers the
  rows itself, from the mapping straight into its destination: one copy, no
  index sent, no scratch -- a gather by the daemon into a shared scratch
  buffer, then the client's copy out, would move every row twice.
- put: the staging slot is reserved as for the socket path and its region
  named; the client writes into it and sends COMMIT, which swaps the version
  in (a session closed before that aborts: the previous version stays).
  The COMMIT's reply may carry a write-ahead grant (shm version >= 3,
  :meth:`Session.grant_ahead`): the next staging slot, already reserved for
  this session's next put of the tensor, which is then just a COMMIT with
  ``FLAG_AHEAD`` (:meth:`DataRequests._commit_ahead`). Any other request of
  the session ends its grant first (revoking needs the client's page lock: a
  client that holds it while asking something else is broken, and its session
  is closed).
- put_rows / add_rows: validated as usual (the index travels in the request),
  the values go into the session's scratch region (charged against
  ``--max-bytes``), and COMMIT applies them under the row lock.

A slot in ordinary memory (``/dev/shm`` full, say) is answered over the data
connection as without the flag, except a shared-memory get_rows (it carries no
index): FALLBACK tells the client to send it again without the flag.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from tensorwire import errors
from tensorwire.spec import DTYPE_CODES, TensorSpec
from tensorwire.serve.protocol.common import ERROR_CLASSES, TAG_DOWN, TAG_REPLY, TAG_UP, check_index
from tensorwire.serve.daemon.ops import Draining, commit_rows, plan_row_update, plan_rows, status_of
from tensorwire.serve.daemon.ops import check_tensor_name as _name
from tensorwire.serve.daemon.ops import recv_posted as _recv_posted
from tensorwire.serve.daemon.ops import send as _send
from tensorwire.serve.daemon.ops import timeout_of as _timeout
from tensorwire.serve.daemon.ops import typed_view as _typed
from tensorwire.serve.daemon.session import Job
from tensorwire.serve.protocol.shm import LEASE_VERSION
from tensorwire.serve.daemon.store import region_of
from tensorwire.serve.protocol.wire import (
    ERROR,
    FALLBACK,
    GO,
    OK,
    OP_ADD_ROWS,
    OP_COMMIT,
    OP_GET,
    OP_GET_ROWS,
    OP_PUT,
    OP_RELEASE,
    OP_SHM_HELLO,
    OPS,
    SHM,
    MalformedRequest,
    Request,
    dtype_name,
    pack_reply,
    parse_request,
)
from tensorwire.serve.daemon.session import PendingWrite
from tensorwire.serve.daemon.store import normalise_spec
from tensorwire.serve.protocol.shm import ShmError

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.transport.base import Transport
    from tensorwire.serve.daemon.service import StoreService
    from tensorwire.serve.daemon.session import Session

__all__ = ["DataRequests", "Gatherer", "ROWS_CHUNK_BYTES", "PARALLEL_MIN_BYTES", "error_class"]

log = logging.getLogger(__name__)

#: On a transport that posts sends without waiting for them (UCX's ``start_send``), a get_rows of
#: more than 1.5 times this many bytes goes in messages of about this size (whole rows), each posted
#: as soon as it is gathered, so the client copies chunk i out of this process's memory while chunk
#: i + 1 is gathered. Measured on the 2-core VM with daemons of each variant side by side, 12-14
#: alternating rounds of 30 calls (4,096 x 512-byte rows of a 1,000,000-row table): 512 KiB and 1 MiB
#: chunks beat one message (p50 1.81 / 1.83 vs 1.88 ms, p10 1.18 / 1.25 vs 1.46 ms; 256 KiB slower).
#: On TCP, where a send returns once the bytes are in the socket, chunks sent by this thread while a
#: helper thread gathered were slower than one message (p50 2.21 vs 1.99 ms): TCP sends one message.
#: 0 = one message everywhere.
ROWS_CHUNK_BYTES = 512 << 10
#: A get_rows of at least this many bytes is gathered by two threads -- this one and the session's
#: helper thread (:class:`Gatherer`) -- and sent as one message, when torch's own intra-op pool is
#: one thread (``tensorwire serve`` sets it so). Measured the same way: slower than one thread from
#: 0.25 to 2 MiB, even at 4 MiB (waking the helper costs 0.1-0.3 ms on the VM), faster from 8 MiB;
#: at 64 MiB (131,072 rows, 4 rounds of 6 calls) 27.9 ms vs 31.5 ms in 1 MiB chunks (UCX) and 41 ms
#: with one thread.
PARALLEL_MIN_BYTES = 8 << 20


def error_class(exc: BaseException) -> str:
    """The name under which a client re-raises ``exc`` (its nearest class in ERROR_CLASSES; '' if none)."""
    if isinstance(exc, Draining):
        return "PeerLostError"
    for cls in type(exc).__mro__:
        if cls.__name__ in ERROR_CLASSES and ERROR_CLASSES[cls.__name__] is cls:
            return cls.__name__
    return ""


def _payload(s: "Session", slot: Any) -> Any:
    """What a read sends of ``slot``: on TCP a memoryview of its bytes (that transport sends one as it is, with no
    tensor-to-buffer conversion per request: ~5 µs on the 2-core VM), else the slot's flat tensor."""
    if s.kind == "tcp":
        return memoryview(slot.host_array())
    return slot.raw


class _Once:
    """Call ``fn`` at most once (a read pin's release: the gather and the job's cleanup both try)."""

    __slots__ = ("_fn", "_lock")

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn: Callable[[], None] | None = fn
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            fn, self._fn = self._fn, None
        if fn is not None:
            fn()


def _gather_rows(table: "torch.Tensor", index: "torch.Tensor", out: "torch.Tensor", a: int, b: int, rb: int) -> None:
    """Rows ``index[a:b]`` of ``table`` into bytes ``[a * rb, b * rb)`` of ``out``."""
    import torch

    dst = out[a * rb : b * rb].view(table.dtype).view((b - a, *table.shape[1:]))
    torch.index_select(table, 0, index[a:b], out=dst)


class _Gather:
    """Chunks ``first, first + 1, ...`` of rows ``index`` of ``table`` into ``out``, in order; waitable per chunk."""

    def __init__(
        self,
        table: "torch.Tensor",
        index: "torch.Tensor",
        out: "torch.Tensor",
        chunk_rows: int,
        row_bytes: int,
        first: int = 0,
    ) -> None:
        self.table = table
        self.index = index
        self.out = out
        self.chunk_rows = chunk_rows
        self.row_bytes = row_bytes
        self.chunks = math.ceil(index.numel() / chunk_rows)
        self.first = first
        self.cond = threading.Condition(threading.Lock())
        self.done = first  # chunks below this are gathered
        self.finished = False
        self.error: BaseException | None = None

    def run(self) -> None:
        n, cr = self.index.numel(), self.chunk_rows
        try:
            for i in range(self.first, self.chunks):
                _gather_rows(self.table, self.index, self.out, i * cr, min(n, (i + 1) * cr), self.row_bytes)
                with self.cond:
                    self.done = i + 1
                    self.cond.notify_all()
        except BaseException as exc:  # noqa: BLE001 - reported to the sender
            with self.cond:
                self.error = exc
                self.cond.notify_all()
        finally:
            with self.cond:
                self.finished = True
                self.cond.notify_all()

    def wait(self, i: int, deadline: float) -> None:
        """Until chunk ``i`` is gathered."""
        with self.cond:
            while self.done <= i:
                if self.error is not None:
                    raise errors.TransportError(f"gathering rows failed: {self.error}") from self.error
                if self.finished:
                    raise errors.ClosedError("the gather was stopped")
                rem = deadline - time.monotonic()
                if rem <= 0:
                    raise errors.TransferTimeout("gathering rows did not finish in time")
                self.cond.wait(rem)

    def join(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        with self.cond:
            while not self.finished:
                rem = end - time.monotonic()
                if rem <= 0:
                    return
                self.cond.wait(rem)


class Gatherer:
    """A session's helper thread for chunked gathers (one at a time, in order)."""

    def __init__(self, sid: str) -> None:
        self._tasks: "queue.Queue[_Gather | None]" = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=f"tensorwire-gather-{sid[:8]}", daemon=True)
        self._thread.start()

    def start(self, task: _Gather) -> None:
        self._tasks.put(task)

    def stop(self) -> None:
        self._tasks.put(None)

    def _loop(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            task.run()


class DataRequests:
    """Turns a request received on tag 4 into the job that answers it (see the module docstring)."""

    def __init__(self, service: "StoreService") -> None:
        self.service = service
        self.store = service.store
        self.metrics = service.metrics

    # -- entry point (the session's request thread) -------------------------------------------
    def __call__(self, s: "Session", buf: "torch.Tensor", nbytes: int) -> Job | None:
        """Validate the request in ``buf[:nbytes]`` and return its job (which may read ``buf`` until it is done).

        Returns None for a request answered by nothing (RELEASE), done already.

        Raises:
            MalformedRequest: the request does not follow the format (the session is closed).
        """
        t0 = time.monotonic()
        req = parse_request(s.request_view(buf)[:nbytes])
        if req.op == OP_RELEASE:
            if not s.shm or not s.release_pin(req.name):
                raise MalformedRequest(f"RELEASE of {req.name!r}, which this session does not hold")
            return None
        if s.holds_pin:
            s.release_pin()  # a client sends its next request once it is done with the last read
        if s.ahead is not None and not (req.op == OP_COMMIT and req.ahead):
            g = s.take_ahead()  # the client went on to something else: its grant ends
            if not g.revoke():
                raise MalformedRequest(f"{OPS[req.op]} request while writing the slot of a write-ahead grant")
        if s.shm_hello is not None and req.op != OP_SHM_HELLO:
            s.withdraw_hello()  # the client went on without shared memory
        if (req.shm or req.op == OP_COMMIT) and not s.shm:
            raise MalformedRequest(f"shared-memory {OPS[req.op]} on a session without shared memory")
        try:
            if req.op == OP_COMMIT:  # finishes a write already under way: taken while draining
                return self._commit(s, req, t0)
            if self.service.draining:
                raise Draining("the server is shutting down and takes no new work")
            if s.pending is not None:
                raise errors.ProtocolError("a write is pending on this session: commit or abort it first")
            held = None
            if req.op != OP_SHM_HELLO:  # a shard is served only to a request built for its very layout
                held = self.store.check_layout(req.name, req.layout)
            if req.op == OP_GET:
                return self._get(s, req, t0, held)
            if req.op == OP_GET_ROWS:
                if req.shm:
                    return self._get_rows_shm(s, req, t0)
                return self._get_rows(s, req, buf, t0)
            if req.op == OP_PUT:
                return self._put(s, req, t0, held)
            if req.op == OP_SHM_HELLO:
                return self._hello(s, req, t0)
            return self._put_rows(s, req, buf, t0, add=req.op == OP_ADD_ROWS)
        except errors.TensorWireError as exc:
            return self._error_job(s, req, exc, t0)
        except Exception as exc:
            log.exception("%s request: internal error", OPS[req.op])
            return self._error_job(s, req, exc, t0)

    # -- helpers ------------------------------------------------------------------------------------
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
        into, out = s.reply_buffer()
        pack_reply(
            into, status=status, op=req.op, req_id=req.req_id, dtype=DTYPE_CODES[spec.dtype], shape=spec.shape, **fields
        )
        t.send(TAG_REPLY, out, step=reply_step, timeout=max(0.0, deadline - time.monotonic()))

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

        job = Job(f"{op} error", run, deadline=deadline, direction="", messages=(0, 0, 1))
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

    # -- shared memory --------------------------------------------------------------------------------
    def _hello(self, s: "Session", req: Request, t0: float) -> Job:
        """The client's proof that it maps this daemon's memory: the nonce of the session's hello region."""
        import hmac

        nonce = s.shm_nonce
        offered = s.shm_hello is not None and bool(nonce)
        ok = offered and hmac.compare_digest(req.name.encode("ascii", "replace"), nonce.hex().encode())
        s.withdraw_hello(
            keep=ok and s.shm_version >= LEASE_VERSION
        )  # one try; kept: the client counts lease reads there
        if not offered:
            raise errors.ProtocolError("no shared-memory offer is open on this session")
        if not ok:
            raise errors.AuthError("shared-memory proof failed: the client read other bytes than the daemon wrote")
        s.shm = True
        deadline = time.monotonic() + self._timeout(req)
        table = ""
        if s.shm_version >= LEASE_VERSION:
            leases = self.store.lease_table()
            table = leases.name if leases is not None else ""
        log.debug("session %s: shared memory on%s", s.id[:8], ", read leases" if table else "")

        def body(t: "Transport", job: Job) -> BaseException | None:
            self._reply(s, t, job.reply_step, deadline, status=OK, op=req.op, req_id=req.req_id, message=table)
            return None

        return self._job(s, req, t0, "shm hello", body, deadline=deadline, messages=(0, 0, 1), direction="", nbytes=0)

    def _shm_read(
        self,
        s: "Session",
        req: Request,
        t0: float,
        kind: str,
        spec: TensorSpec,
        version: int,
        region: Any,
        nbytes: int,
        accounted: int,
        release: "_Once",
        deadline: float,
        lease: tuple[int, int],
    ) -> Job:
        """The SHM reply of a read: ``nbytes`` at offset 0 of ``region``; the pin goes to the session.

        ``lease``: (cell, generation) of the pinned version, handed to sessions that take leases.
        """
        handed = [False]
        cell, gen = lease if s.shm_version >= LEASE_VERSION else (0, 0)

        def body(t: "Transport", job: Job) -> BaseException | None:
            self._ok(
                s,
                t,
                job.reply_step,
                req,
                spec,
                deadline,
                status=SHM,
                version=version,
                nbytes=nbytes,
                chunk=0,
                message=region.name,
                lease=cell,
                step=gen if cell else 0,
            )
            s.hold_pin(release, req.name)  # until the client's RELEASE
            handed[0] = True
            return None

        def cleanup() -> None:
            if not handed[0]:
                release()

        job = self._job(
            s,
            req,
            t0,
            kind,
            body,
            deadline=deadline,
            messages=(0, 0, 1),
            direction="out",
            nbytes=accounted,
            cleanup=cleanup,
        )
        job.via = "shm"
        job.client_copy = accounted
        return job

    def _get_rows_shm(self, s: "Session", req: Request, t0: float) -> Job:
        """A get_rows the client gathers itself from the pinned version (FALLBACK if it is not in shared memory)."""
        e = self.store.get(_name(req.name))
        spec = e.spec
        if not spec.shape:
            raise errors.SpecError(f"{spec.name}: a 0-d tensor has no rows")
        rows = req.shape[0]
        row_bytes = spec.nbytes // spec.shape[0] if spec.shape[0] else 0
        deadline = time.monotonic() + self._timeout(req)
        idx, version, lease = e.acquire_read_leased(deadline)
        release = _Once(lambda: e.release_read(idx))
        try:
            region = region_of(e.slot(idx))
            if region is None:
                release()

                def fallback(t: "Transport", job: Job) -> BaseException | None:
                    self._ok(s, t, job.reply_step, req, spec, deadline, status=FALLBACK)
                    return None

                return self._job(
                    s,
                    req,
                    t0,
                    "get_rows fallback",
                    fallback,
                    deadline=deadline,
                    messages=(0, 0, 1),
                    direction="",
                    nbytes=0,
                )
            return self._shm_read(
                s,
                req,
                t0,
                "get_rows",
                spec,
                version,
                region,
                e.nbytes,
                min(rows * row_bytes, 1 << 62),
                release,
                deadline,
                lease,
            )
        except BaseException:
            release()
            raise

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

    # -- reads ----------------------------------------------------------------------------------------
    def _get(self, s: "Session", req: Request, t0: float, held: Any = None) -> Job:
        # ``held``: the entry the layout check found (its name was checked when it was declared)
        e = held if held is not None else self.store.get(_name(req.name))
        deadline = time.monotonic() + self._timeout(req)
        idx, version, lease = e.acquire_read_leased(deadline)
        release = _Once(lambda: e.release_read(idx))
        try:
            spec, nbytes, slot = e.spec, e.nbytes, e.slot(idx)
            region = region_of(slot) if req.shm else None
            if region is not None:
                return self._shm_read(
                    s, req, t0, "get", spec, version, region, nbytes, nbytes, release, deadline, lease
                )
            raw = _payload(s, slot)

            def body(t: "Transport", job: Job) -> BaseException | None:
                self._ok(
                    s,
                    t,
                    job.reply_step,
                    req,
                    spec,
                    deadline,
                    version=version,
                    step=job.down_step,
                    nbytes=nbytes,
                    chunk=nbytes,
                )
                if nbytes:
                    _send(t, raw, job.down_step, deadline)
                return None

            return self._job(
                s,
                req,
                t0,
                "get",
                body,
                deadline=deadline,
                messages=(1 if nbytes else 0, 0, 1),
                direction="out",
                nbytes=nbytes,
                cleanup=release,
            )
        except BaseException:
            release()
            raise

    def _get_rows(self, s: "Session", req: Request, buf: "torch.Tensor", t0: float) -> Job:
        import torch

        p = plan_rows(self.store, req.name, self._index_of(req, buf), "request")
        e, spec, nbytes, rb, n = p.entry, p.spec, p.nbytes, p.row_bytes, p.n
        s.reserve_scratch(nbytes)  # charged against --max-bytes before anything is pinned
        t = s.transport
        # Two threads gather big requests (when torch's own intra-op pool is one thread: the daemon's setting);
        # on a transport that posts sends without waiting (UCX), mid-sized ones go in chunks, each sent
        # as soon as it is gathered; else one gather, one message (see the constants for the measurements).
        halves = n >= 2 and nbytes >= PARALLEL_MIN_BYTES and torch.get_num_threads() == 1
        chunk_rows = max(1, n)
        if (
            not halves
            and ROWS_CHUNK_BYTES
            and rb
            and nbytes > ROWS_CHUNK_BYTES * 3 // 2
            and t is not None
            and t.async_send
        ):
            chunk_rows = max(1, ROWS_CHUNK_BYTES // rb)
        chunks = math.ceil(n / chunk_rows) if nbytes else 0
        chunk = chunk_rows * rb if chunks > 1 else nbytes
        deadline = time.monotonic() + self._timeout(req)
        idx, version = e.acquire_read(deadline)
        release = _Once(lambda: e.release_read(idx))

        def left() -> float:
            return max(0.0, deadline - time.monotonic())

        def body(t: "Transport", job: Job) -> BaseException | None:
            out = s.scratch(nbytes)
            table = e.slot(idx).tensor
            helper: _Gather | None = None
            if halves:  # the helper thread gathers the second half while this one replies and gathers the first
                helper = _Gather(table, p.index, out, n // 2, rb, first=1)
                if s.gatherer is None:
                    s.gatherer = Gatherer(s.id)
                s.gatherer.start(helper)
            try:
                self._ok(
                    s,
                    t,
                    job.reply_step,
                    req,
                    spec,
                    deadline,
                    version=version,
                    step=job.down_step,
                    nbytes=nbytes,
                    chunk=chunk,
                )
                if chunks == 0:
                    return None
                s.nudge()  # the request and the reply complete now, not after the gather
                if chunks > 1:
                    ops = []
                    for i in range(chunks):
                        a, b = i * chunk_rows, min(n, (i + 1) * chunk_rows)
                        _gather_rows(table, p.index, out, a, b, rb)
                        # chunk i is copied out (by the client, on UCX) while chunk i + 1 is gathered
                        start_send = t.start_send
                        ops.append(start_send(TAG_DOWN, out[a * rb : b * rb], step=job.down_step + i, timeout=left()))
                    release()
                    for op in ops:
                        t.wait_send(op, timeout=left())
                    return None
                if helper is None:
                    _gather_rows(table, p.index, out, 0, n, rb)
                else:
                    _gather_rows(table, p.index, out, 0, helper.chunk_rows, rb)
                    helper.wait(helper.chunks - 1, deadline)
                release()
                _send(t, out, job.down_step, deadline)
                return None
            finally:
                if helper is not None:  # never leave it writing into the scratch buffer
                    helper.join(left() + 5.0)
                release()

        try:
            job = self._job(
                s,
                req,
                t0,
                "get_rows",
                body,
                deadline=deadline,
                messages=(chunks, 0, 1),
                direction="out",
                nbytes=nbytes,
                cleanup=release,
            )
            job.holds_request = True  # p.index is a view of the request's buffer
            return job
        except BaseException:
            release()
            raise

    # -- writes ---------------------------------------------------------------------------------------
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
