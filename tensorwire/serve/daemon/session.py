"""Server side of one client session: its data transport, worker, request thread and watch.

A session is opened over gRPC (``OpenSession``): the server makes a random
nonce, tells its data listener to ``expect`` it, and returns it. The client
dials the data listener and presents the nonce; anything else is dropped by
the listener. From then on:

- the **worker** thread runs the transfers the gRPC calls scheduled, one at a
  time, in the order they were scheduled (tags 1 and 2 each carry one message
  per transfer, in FIFO order, with the step the server announced);
- for a client that sends data-plane requests (``data_requests``, see
  :mod:`tensorwire.serve.protocol.wire`), the **request** thread keeps a receive posted
  on tag 4, hands each request to the service's handler (which validates it
  completely and returns a :class:`Job`) and runs that job itself when nothing
  else is queued or running on the session, else queues it behind the
  worker's jobs (:meth:`Session.submit`). Steps of every tag are assigned under
  one lock when a job is queued or started, and one job runs at a time
  (``_exec``), so the two paths can be mixed and each tag stays in order. A
  malformed request closes the session (only this one);
- otherwise the **watch** thread keeps one tiny receive posted on tag 3, which
  the client never sends on: it notices at once when the client goes away
  (killed, closed) and closes the session, releasing what it held. (The
  request thread's posted receive does the same for sessions that have one.)

Any failure of a transfer closes the session: a half-done transfer leaves the
stream in an unknown state, and closing also guarantees that a receive posted
into a staging slot can never be completed later. The client opens a new
session on its next call.

Shared memory (:mod:`tensorwire.serve.protocol.shm`): a session offered it holds a
*hello* region until its client proves it maps it (``SHM_HELLO``) or sends
anything else; once proven (``shm``), the session may hold one read pin handed
to the client (released by ``RELEASE``, the next request, or close), one
uncommitted shared-memory write (``pending``, aborted by close), and a scratch
region for row updates (charged against ``--max-bytes``, unlinked by close).

:class:`Session` is written in three parts: this module (scheduling, the worker,
request and watch threads, close), :class:`~tensorwire.serve.daemon.session_buffers.SessionBuffers`
(its row, request and reply buffers and their charge) and
:class:`~tensorwire.serve.daemon.session_shm.SessionShm` (its shared memory). What it
runs is a :class:`~tensorwire.serve.daemon.jobs.Job`.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from tensorwire.cpus import usable_cpus
from tensorwire.errors import ClosedError, PeerLostError, ProtocolError, TensorWireError, TransferTimeout
from tensorwire.serve.protocol.common import TAG_REQUEST, TAG_WATCH
from tensorwire.serve.protocol.wire import MAX_REQUEST_BYTES, MalformedRequest
from tensorwire.serve.daemon.jobs import Job, PendingWrite
from tensorwire.serve.daemon.metrics import Tally
from tensorwire.serve.daemon.session_buffers import SessionBuffers
from tensorwire.serve.daemon.session_shm import SessionShm

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.transport.base import Listener, Transport
    from tensorwire.serve.daemon.metrics import Metrics

__all__ = ["Session", "Job", "SHM_SPIN_S"]

log = logging.getLogger(__name__)


#: After answering a request of a shared-memory session, its request thread polls for the next one this
#: long before it blocks: the client is copying meanwhile (no bytes cross the connection), and a thread
#: that has gone to sleep took ~0.2 ms longer to answer on the 2-core VM (measured: a 16 MiB put's two
#: round trips 400 -> 190 us each). At most one session per CPU but one polls at a time, so many busy
#: clients never spin the daemon's cores away; the others block as before. 0 = never poll. Not on TCP data
#: connections (see _request_loop): there the connection's own reader polls (TENSORWIRE_SERVE_SPIN_US).
SHM_SPIN_S = 0.002
#: ... but not after a reply that leaves the client more than this many bytes to copy: that copy outlasts
#: the poll anyway, and a polling daemon keeps the client from splitting its copy over two cores.
SHM_SPIN_MAX_BYTES = 16 << 20


def _spin_slots() -> int:
    return max(0, usable_cpus() - 1)


_SPIN_SLOTS = threading.BoundedSemaphore(max(1, _spin_slots()))
_CAN_SPIN = _spin_slots() > 0


class _Repost:
    """Post a request buffer again on the session's transport, once (``Job.request_read``)."""

    __slots__ = ("_t", "_buf", "_posted")

    def __init__(self, t: "Transport", buf: "torch.Tensor", posted: "collections.deque[torch.Tensor]") -> None:
        self._t: "Transport | None" = t
        self._buf = buf
        self._posted = posted

    def __call__(self) -> None:
        t, self._t = self._t, None
        if t is not None:
            t.post_recv(TAG_REQUEST, self._buf, header=True)
            self._posted.append(self._buf)


class Session(SessionBuffers, SessionShm):
    """One client's data-plane session (see the module docstring)."""

    def __init__(
        self,
        sid: str,
        nonce: bytes,
        listener: "Listener",
        *,
        connect_timeout: float,
        spin_us: float = 0.0,
        metrics: "Metrics | None",
        on_close: Callable[["Session"], None],
        client: str = "",
        handler: "Callable[[Session, torch.Tensor, int], Job | None] | None" = None,
        store: Any = None,
        charged: int = 0,
    ) -> None:
        self.id = sid
        self.nonce = nonce
        self.client = client
        self.kind = listener.kind
        self._listener = listener
        self._connect_timeout = connect_timeout
        self._spin_us = spin_us  # how long the data connection polls before it sleeps (TENSORWIRE_SERVE_SPIN_US)
        self._metrics = metrics
        self._on_close = on_close
        self._jobs: "queue.Queue[Job | None]" = queue.Queue()
        self._lock = threading.Lock()
        self._down_step = 0
        self._up_step = 0
        self._reply_step = 0
        self._op_ids = 0
        self.pending: PendingWrite | None = None
        self.transport: "Transport | None" = None
        self.closed = False
        self.close_reason = ""
        self.last_used = time.monotonic()
        self.active = 0  # scheduled + running jobs
        self._init_buffers(store, charged)  # the row and request buffers, charged against --max-bytes
        self._handler = handler
        #: This session's data-plane counts (folded into the metrics at each scrape and at close).
        self.tally: "Tally | None" = Tally() if metrics is not None else None
        self._exec = threading.Lock()  # held while a job runs (worker or request thread): one at a time
        self.gatherer: Any = (
            None  # the request path's helper thread (tensorwire.serve.daemon.datapath), made on first use
        )
        self._probe_buf: Any = None
        self._init_shm()  # shared memory (see the module docstring)
        self._worker = threading.Thread(target=self._work, name=f"tensorwire-session-{sid[:8]}", daemon=True)
        self._watch: threading.Thread | None = None
        listener.expect(nonce)
        self._worker.start()

    # -- scheduling (called from gRPC handlers) -----------------------------------
    def touch(self) -> None:
        self.last_used = time.monotonic()

    def check_open(self) -> None:
        if self.closed:
            raise ClosedError(f"session closed: {self.close_reason}")

    def _assign(self, job: Job) -> None:
        """Under the lock: reserve the job's steps on every tag it uses and count it as active."""
        down, up, replies = job.messages or (0, 0, 0)
        job.down_step = self._down_step + 1
        job.up_step = self._up_step + 1
        job.reply_step = self._reply_step + 1
        self._down_step += down
        self._up_step += up
        self._reply_step += replies
        job.step = job.down_step if down or not up else job.up_step
        self.active += 1  # the tensorwire_inflight_transfers gauge sums it over the sessions at a scrape

    def schedule(self, job: Job, *, up: bool | None = None) -> int:
        """Queue ``job`` for the worker; returns its ``step`` (the step its message carries on its tag)."""
        if job.messages is None:
            job.messages = (0, 1, 0) if up else (1, 0, 0)
        with self._lock:
            self.check_open()
            self._assign(job)
            self._jobs.put(job)
        return job.step

    def submit(self, job: Job) -> None:
        """From the request thread: run ``job`` now, in this thread, if nothing is queued or running; else queue it.

        Either way its steps follow those of every job queued before it, and it
        runs after them (the worker takes ``_exec`` for each job, too).
        """
        t = self.transport
        with self._lock:
            self.check_open()
            inline = self.active == 0
            self._assign(job)
            if not inline:
                self._jobs.put(job)
                return
        assert t is not None
        with self._exec:
            self._run_job(job, t)
        self._job_done()

    def begin_inline(self) -> tuple[int, int] | None:
        """From the request thread, for a read it answers itself (:mod:`.datapath_fast`): the next step on tag 1
        and on tag 5, the session counted active, if no job is queued or running; None: one is (or the session
        closed), nothing taken. :meth:`end_inline` ends it; :meth:`running` is held meanwhile."""
        with self._lock:
            if self.closed or self.active:
                return None
            self._down_step += 1
            self._reply_step += 1
            self.active += 1
            return self._down_step, self._reply_step

    def end_inline(self) -> None:
        self._job_done()

    def running(self) -> threading.Lock:
        """The lock held while a job (or a read answered inline) runs: one at a time."""
        return self._exec

    def next_op_id(self) -> int:
        with self._lock:
            self._op_ids += 1
            return self._op_ids

    def fold_tally(self) -> None:
        """Add this session's data-plane counts since the last fold to the metrics (a scrape, or close)."""
        if self._metrics is not None and self.tally is not None:
            self._metrics.fold(self.tally)

    # -- worker --------------------------------------------------------------------
    def _work(self) -> None:
        try:
            self._work_loop()
        finally:
            self._release_buffers()

    def _work_loop(self) -> None:
        try:
            t = self._listener.accept(self.nonce, timeout=self._connect_timeout)
        except TensorWireError as exc:
            self._listener.forget(self.nonce)
            self.close(f"no data connection: {exc}")
            self._drain_queue()
            return
        with self._lock:
            if self.closed:
                t.abort()
                self._drain_queue()
                return
            self.transport = t
        if t.kind == "tcp" and self._spin_us:
            t.set_spin(self._spin_us)
        log.info("session %s: data connection up (%s)", self.id[:8], t.describe())
        if self._handler is not None:
            with self._lock:
                self._holders += 1
            self._watch = threading.Thread(
                target=self._request_thread, name=f"tensorwire-requests-{self.id[:8]}", daemon=True
            )
        else:
            self._watch = threading.Thread(target=self._watch_loop, name=f"tensorwire-watch-{self.id[:8]}", daemon=True)
        self._watch.start()
        while True:
            job = self._jobs.get()
            if job is None:
                break
            with self._exec:
                self._run_job(job, t)
            self._job_done()
        self._drain_queue()

    def _run_job(self, job: Job, t: "Transport") -> None:
        """Under ``_exec``: run one job; account it; a failed transfer closes the session."""
        if self.closed:
            job.fail(ClosedError(f"session closed: {self.close_reason}"))
            return
        t0 = time.monotonic()
        job.execute(t)
        if job.error is not None:
            self.transfer_failed(job.kind, job.error)
        elif job.direction and self.tally is not None:
            self.tally.transfer(job.via or self.kind, job.direction, job.nbytes, time.monotonic() - t0)

    def transfer_failed(self, kind: str, err: BaseException) -> None:
        """A transfer of this session failed once begun (a job's, or a read answered inline): logged, counted,
        the session closed (its stream may be mid-message)."""
        log.warning("session %s: %s transfer failed: %s", self.id[:8], kind, err)
        if self._metrics is not None:
            self._metrics.errors.labels(type(err).__name__).inc()
        self.close(f"{kind} transfer failed: {err}")

    def _job_done(self) -> None:
        with self._lock:
            self.active -= 1

    def _drain_queue(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.fail(ClosedError(f"session closed: {self.close_reason}"))
                self._job_done()

    def _request_thread(self) -> None:
        try:
            self._request_loop()
        finally:
            self._free_request_buffers()  # nothing else reads them, and this thread is done with them now

    def _request_loop(self) -> None:
        """Receive data-plane requests on tag 4; each becomes a job (see the module docstring)."""
        import torch

        t = self.transport
        handler = self._handler
        assert t is not None and handler is not None
        fast = getattr(handler, "fast_read", None)
        self._probe_buf = torch.zeros(8, dtype=torch.uint8)
        # Two request buffers: the client always has a credit for its next request, and a job may
        # use its request's bytes (the row numbers) in place; its buffer is posted again once the
        # job is done. Virtual memory only until requests use it (pages are touched by what arrives).
        # A shared-memory session gets a third: a client's RELEASE may be followed at once by its next
        # request, and with two the second would wait for the credit of the buffer still in use
        # (measured with a RELEASE after every read: a tiny get 210 -> 120 us).
        posted: "collections.deque[torch.Tensor]" = collections.deque()
        expected = 0
        # Not on TCP. When this was decided, TCP's zero-timeout receive did not read the socket: a poll burnt up
        # to SHM_SPIN_S of CPU per request and left the request unread until it ended (2-core VM: a 4 KiB
        # shared-memory get 2.7 ms and ~2 ms of the daemon's CPU with the poll, 0.37 ms and 0.18 ms without).
        # It reads the socket once now (FrameReader._wait_for), and polling TCP sessions too was measured again
        # for get_rows of 4,096 x 512-byte rows of a 100 MB table over TCP (not shared memory), daemons of both
        # kinds in turns: 2.195 -> 2.052 and 2.185 -> 2.095 ms (-4 to -7%, within the VM's drift between
        # runs), for up to SHM_SPIN_S of a core per request: left off. Shared-memory sessions on a TCP
        # connection were not measured again.
        can_spin = SHM_SPIN_S > 0 and _CAN_SPIN and t.kind != "tcp"
        try:
            t.post_recv(TAG_WATCH, self._probe_buf)  # for nudge(); the client never sends on it
            for _ in range(2):
                b = self.request_buffer(MAX_REQUEST_BYTES)
                t.post_recv(TAG_REQUEST, b, header=True)
                posted.append(b)
            spin_until = 0.0
            while not self.closed:
                r = self._poll_request(t, spin_until) if spin_until else None
                if r is None:
                    try:
                        r = t.wait_recv(TAG_REQUEST, timeout=1.0)
                    except TransferTimeout:
                        continue
                buf = posted.popleft()
                expected += 1
                if r.step is not None and r.step != expected:
                    raise MalformedRequest(f"request step {r.step}, expected {expected}")
                self.touch()
                if fast is not None and fast(self, buf, r.nbytes, posted):
                    continue  # answered in this thread, ``buf`` posted again (tensorwire.serve.daemon.datapath_fast)
                job = handler(self, buf, r.nbytes)  # validated; may read ``buf`` until it is done
                early = job is None or not job.holds_request
                if early:
                    # Its bytes are parsed and copied: post it again now, so its credit rides on the reply
                    # (posted after the reply, the credit went out in a frame of its own, a send per request).
                    t.post_recv(TAG_REQUEST, buf, header=True)
                    posted.append(buf)
                else:  # the job posts it again as soon as it is done reading it (before its reply, as above)
                    assert job is not None
                    job.request_read = _Repost(t, buf, posted)
                if job is not None:  # None: answered by nothing (a RELEASE), done already
                    self.submit(job)
                    while not job.done.wait(1.0):  # queued behind the worker's jobs: wait for it
                        self.check_open()
                if not early:
                    assert job is not None and job.request_read is not None
                    job.request_read()
                if self.shm and len(posted) < 3:
                    b = self.request_buffer(MAX_REQUEST_BYTES)
                    t.post_recv(TAG_REQUEST, b, header=True)
                    posted.append(b)
                spin = can_spin and self.shm and (job is None or job.client_copy <= SHM_SPIN_MAX_BYTES)
                spin_until = time.monotonic() + SHM_SPIN_S if spin else 0.0
        except ClosedError:
            pass
        except MalformedRequest as exc:
            if self._metrics is not None:
                self._metrics.errors.labels("ProtocolError").inc()
            self.close(f"malformed data-plane request: {exc}")
        except (PeerLostError, ProtocolError, TensorWireError) as exc:
            self.close(f"data connection lost: {exc}")
        except Exception as exc:
            log.exception("session %s: request thread failed", self.id[:8])
            self.close(f"request thread failed: {exc}")

    def _poll_request(self, t: "Transport", until: float) -> Any:
        """Poll for the next request until ``until`` (see :data:`SHM_SPIN_S`); None: nothing (or no slot to poll)."""
        if not _SPIN_SLOTS.acquire(blocking=False):
            return None
        try:
            while not self.closed and time.monotonic() < until:
                try:
                    return t.wait_recv(TAG_REQUEST, timeout=0.0)
                except TransferTimeout:
                    os.sched_yield()
            return None
        finally:
            _SPIN_SLOTS.release()

    def nudge(self) -> None:
        """Let the data transport progress once, without waiting (the request path, before a long gather).

        On UCX a message of more than a few KiB (a request carrying thousands
        of row numbers) is a rendezvous, and the sender's send may return only
        once this side's worker progresses again after the receive (measured
        here: a client's 8-64 KiB send waited out the server's next millisecond
        of work, a 4 KiB one did not). A zero-timeout receive on the watch tag
        (a buffer the client never fills) is one such progress, as the watch
        loop's probe is.

        Raises:
            ProtocolError: the client sent on the watch tag.
        """
        t = self.transport
        if t is None or t.kind == "tcp":  # TCP's zero-timeout receive reads nothing: no progress to make
            return
        try:
            t.wait_recv(TAG_WATCH, timeout=0.0)
        except TransferTimeout:
            return
        raise ProtocolError("client sent on the watch tag")

    def _watch_loop(self) -> None:
        import torch

        t = self.transport
        assert t is not None
        buf = torch.zeros(8, dtype=torch.uint8)
        # TCP learns of a lost peer only by reading: block in a receive (the
        # reader role moves frames for the worker meanwhile). UCX notices on its
        # own (endpoint error callbacks): a non-blocking probe each second is
        # enough there, and a thread blocked in the engine would add a hand-off
        # to every transfer of the process.
        blocking = t.kind == "tcp"
        try:
            t.post_recv(TAG_WATCH, buf)
            while not self.closed:
                try:
                    t.wait_recv(TAG_WATCH, timeout=1.0 if blocking else 0.0)
                except TransferTimeout:
                    if not blocking:
                        time.sleep(1.0)
                    continue
                raise ProtocolError("client sent on the watch tag")
        except ClosedError:
            pass
        except (PeerLostError, ProtocolError, TensorWireError) as exc:
            self.close(f"data connection lost: {exc}")
        except Exception as exc:
            log.exception("session %s: watch failed", self.id[:8])
            self.close(f"watch failed: {exc}")

    # -- closing ---------------------------------------------------------------------
    def close(self, reason: str = "closed by client") -> None:
        """Close the session: abort its transport, fail queued jobs, release reservations. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self.close_reason = reason
            pending, self.pending = self.pending, None
            t = self.transport
        level = logging.INFO if reason.startswith("closed by client") else logging.WARNING
        log.log(level, "session %s closed: %s", self.id[:8], reason)
        if t is not None:
            t.abort()
        else:
            self._listener.forget(self.nonce)
        if pending is not None and not pending.finished:
            pending.finished = True
            pending.job.fail(ClosedError(f"session closed: {reason}"))
            try:
                pending.abort()
            except Exception:
                log.exception("releasing a pending write failed")
        try:
            self._close_shm()
        except Exception:
            log.exception("releasing the session's shared memory failed")
        self._jobs.put(None)
        g = self.gatherer
        if g is not None:
            g.stop()
        self._on_close(self)

    def join(self, timeout: float) -> None:
        self._worker.join(timeout)
