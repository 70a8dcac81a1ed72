"""Data-plane reads: get and get_rows, over the data connection or through shared memory.

A read pins the version it reads (``acquire_read``) from validation until its
bytes are out of the slot (get) or gathered (get_rows); through shared memory the
pin goes to the session until the client is done copying (see
:mod:`tensorwire.serve.daemon.datapath` for the whole protocol). A get_rows over the
connection is gathered into the session's row buffer in chunks, by two threads, or
at once: :data:`ROWS_CHUNK_BYTES` and :data:`PARALLEL_MIN_BYTES` say when.
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
from tensorwire.serve.protocol.common import TAG_DOWN, TAG_REPLY
from tensorwire.serve.daemon.ops import plan_rows
from tensorwire.serve.daemon.ops import check_tensor_name as _name
from tensorwire.serve.daemon.ops import send as _send
from tensorwire.serve.daemon.jobs import Job
from tensorwire.serve.protocol.shm import LEASE_VERSION
from tensorwire.serve.daemon.entry import region_of
from tensorwire.serve.protocol.wire import FALLBACK, SHM, Request
from tensorwire.serve.daemon.datapath_base import RequestHandlers

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.transport.base import Transport
    from tensorwire.serve.daemon.session import Session

__all__ = ["ReadRequests", "Gatherer", "ROWS_CHUNK_BYTES", "PARALLEL_MIN_BYTES", "gather_rows"]

log = logging.getLogger(__name__)

#: On a transport that posts sends without waiting for them (UCX's ``start_send``), a get_rows of
#: more than 1.5 times this many bytes goes in messages of about this size (whole rows), each posted
#: as soon as it is gathered, so the client copies chunk i out of this process's memory while chunk
#: i + 1 is gathered. Measured on the 2-core VM with daemons of each variant side by side, 12-14
#: alternating rounds of 30 calls (4,096 x 512-byte rows of a 1,000,000-row table): 512 KiB and 1 MiB
#: chunks beat one message (p50 1.81 / 1.83 vs 1.88 ms, p10 1.18 / 1.25 vs 1.46 ms; 256 KiB slower).
#: On TCP, where a send returns once the bytes are in the socket, chunks sent by this thread while a
#: helper thread gathered were slower than one message (p50 2.21 vs 1.99 ms): TCP sends one message.
#: Measured again on the VM with two plain processes (the same 2 MiB of rows of a 100 MB table, one socket,
#: 15 turns of 20 calls of each, medians, load 0.8-1.7): gather then send 1.51 ms against the gather in 128 /
#: 256 / 512 KiB pieces, each written without waiting as soon as it is gathered (one thread, no hand-off) 3.09 /
#: 2.39 / 2.07; gather then send 1.59 against a helper thread gathering pieces ahead of the sending thread
#: 2.05 / 1.83 / 1.90 (256 KiB / 512 KiB / 1 MiB); gather then send 2.85 and 2.82 against the kernel gathering
#: the rows itself (``sendmsg`` of one iovec per row, 1,024 per call: no gather copy) 3.41 and 3.20. A raw
#: 2 MiB send took 0.84-1.9 ms over those runs: the host's load drifts, only figures of one run compare.
#: 0 = one message everywhere.
ROWS_CHUNK_BYTES = 512 << 10
#: A get_rows of at least this many bytes is gathered by two threads -- this one and the session's
#: helper thread (:class:`Gatherer`) -- and sent as one message, when torch's own intra-op pool is
#: one thread (``tensorwire serve`` sets it so below 8 CPUs). Measured the same way: slower than one thread from
#: 0.25 to 2 MiB, even at 4 MiB (waking the helper costs 0.1-0.3 ms on the VM), faster from 8 MiB;
#: at 64 MiB (131,072 rows, 4 rounds of 6 calls) 27.9 ms vs 31.5 ms in 1 MiB chunks (UCX) and 41 ms
#: with one thread.
PARALLEL_MIN_BYTES = 8 << 20


def _payload(s: "Session", slot: Any) -> Any:
    """What a read sends of ``slot``: on TCP a memoryview of its bytes (that transport sends one as it is, with no
    tensor-to-buffer conversion per request: ~5 µs on the 2-core VM), else the slot's flat tensor."""
    if s.kind == "tcp":
        return memoryview(slot.host_array())
    return slot.raw


def _until(deadline: float) -> float:
    """Seconds to ``deadline``, at least 0."""
    return max(0.0, deadline - time.monotonic())


def _expected(req: Request, spec: TensorSpec, shape: tuple[int, ...], nbytes: int) -> bool:
    """Whether a posted read's receive is for this payload: ``shape`` of ``spec``'s dtype, at least one byte."""
    return nbytes > 0 and req.dtype == DTYPE_CODES[spec.dtype] and req.shape == shape


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


def gather_rows(table: "torch.Tensor", index: "torch.Tensor", out: "torch.Tensor", a: int, b: int, rb: int) -> None:
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
                gather_rows(self.table, self.index, self.out, i * cr, min(n, (i + 1) * cr), self.row_bytes)
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


class ReadRequests(RequestHandlers):
    """The handlers of get and get_rows (see the module docstring)."""

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
            # a receive posted for another payload than this one is completed empty first (see wire: FLAG_POSTED)
            skip = req.posted and not _expected(req, spec, spec.shape, nbytes)

            def body(t: "Transport", job: Job) -> BaseException | None:
                step = job.down_step
                if skip:
                    self._skip(t, step, deadline)
                    step += 1
                ok = self._ok_reply(s, req, spec, version=version, step=step, nbytes=nbytes, chunk=nbytes)
                if nbytes:  # one write where the client's receive is posted already (TCP: one sendmsg)
                    t.send_two((TAG_REPLY, ok, job.reply_step), (TAG_DOWN, raw, step), timeout=_until(deadline))
                else:
                    t.send(TAG_REPLY, ok, step=job.reply_step, timeout=_until(deadline))
                return None

            return self._job(
                s,
                req,
                t0,
                "get",
                body,
                deadline=deadline,
                messages=((1 if nbytes else 0) + int(skip), 0, 1),
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
        # Two threads gather big requests (when torch's own intra-op pool is one thread: the daemon's below 8 CPUs);
        # on a transport that posts sends without waiting (UCX), mid-sized ones go in chunks, each sent
        # as soon as it is gathered; else one gather, one message (see the constants for the measurements).
        halves = n >= 2 and nbytes >= PARALLEL_MIN_BYTES and torch.get_num_threads() == 1
        chunk_rows = max(1, n)
        # Posted (wire: FLAG_POSTED): the rows go as one message into the client's receive, the reply just before
        # them (the client waits for the rows, not for the reply); a receive posted for other rows is completed empty.
        posted = req.posted and _expected(req, spec, p.shape, nbytes)
        skip = req.posted and not posted
        if (
            not posted
            and not halves
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
            step = job.down_step
            if skip:
                self._skip(t, step, deadline)
                step += 1
            out = s.scratch(nbytes)
            table = e.slot(idx).tensor
            helper: _Gather | None = None
            if halves:  # the helper thread gathers the second half while this one replies and gathers the first
                helper = _Gather(table, p.index, out, n // 2, rb, first=1)
                if s.gatherer is None:
                    s.gatherer = Gatherer(s.id)
                s.gatherer.start(helper)

            def reply() -> None:
                self._ok(
                    s,
                    t,
                    job.reply_step,
                    req,
                    spec,
                    deadline,
                    version=version,
                    step=step,
                    nbytes=nbytes,
                    chunk=chunk,
                )

            try:
                if not posted:
                    reply()
                    if chunks == 0:
                        return None
                    s.nudge()  # the request and the reply complete now, not after the gather
                if chunks > 1:
                    ops = []
                    for i in range(chunks):
                        a, b = i * chunk_rows, min(n, (i + 1) * chunk_rows)
                        gather_rows(table, p.index, out, a, b, rb)
                        # chunk i is copied out (by the client, on UCX) while chunk i + 1 is gathered
                        start_send = t.start_send
                        ops.append(start_send(TAG_DOWN, out[a * rb : b * rb], step=step + i, timeout=left()))
                    release()
                    if job.request_read is not None:  # the row numbers are read: the request's buffer may go
                        job.request_read()
                    for op in ops:
                        t.wait_send(op, timeout=left())
                    return None
                if helper is None:
                    gather_rows(table, p.index, out, 0, n, rb)
                else:
                    gather_rows(table, p.index, out, 0, helper.chunk_rows, rb)
                    helper.wait(helper.chunks - 1, deadline)
                release()
                if job.request_read is not None:  # the row numbers are read: post the request's buffer again, its
                    job.request_read()  # credit riding on the reply and the rows
                if posted:  # the reply and the rows in one write where the transport can (TCP: one sendmsg)
                    ok = self._ok_reply(s, req, spec, version=version, step=step, nbytes=nbytes, chunk=chunk)
                    t.send_two((TAG_REPLY, ok, job.reply_step), (TAG_DOWN, out, step), timeout=left())
                    return None
                _send(t, out, step, deadline)
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
                messages=(chunks + int(skip), 0, 1),
                direction="out",
                nbytes=nbytes,
                cleanup=release,
            )
            job.holds_request = True  # p.index is a view of the request's buffer
            return job
        except BaseException:
            release()
            raise

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
