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
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from tensorwire.errors import ClosedError, PeerLostError, ProtocolError, TensorWireError, TransferTimeout
from tensorwire.serve.protocol.common import MAX_ROWS_BYTES, TAG_REQUEST, TAG_WATCH
from tensorwire.serve.protocol.shm import (
    usable_cpus,
    new_hello,
    page_counts,
    AHEAD_VERSION,
    PageLock,
    page_ahead,
    round_page,
)
from tensorwire.buffers import allocate_host
from tensorwire.serve.daemon.store import AheadGrant, region_of
from tensorwire.errors import ResourceExhaustedError
from tensorwire.serve.protocol.wire import MAX_REQUEST_BYTES, REPLY_BYTES, MalformedRequest
from tensorwire.serve.daemon.metrics import Tally

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from tensorwire.transport.base import Listener, Transport
    from tensorwire.serve.daemon.metrics import Metrics

__all__ = ["Session", "Job", "SHM_SPIN_S"]

log = logging.getLogger(__name__)


def _free(t: "torch.Tensor | None") -> None:
    """Give ``t``'s memory back now, whoever still holds a view of it (they must not touch it again)."""
    if t is None:
        return
    try:
        t.untyped_storage().resize_(0)
    except RuntimeError:  # pragma: no cover - a storage that cannot be resized (pinned): dropped by reference
        pass


#: After answering a request of a shared-memory session, its request thread polls for the next one this
#: long before it blocks: the client is copying meanwhile (no bytes cross the connection), and a thread
#: that has gone to sleep took ~0.2 ms longer to answer on the 2-core VM (measured: a 16 MiB put's two
#: round trips 400 -> 190 us each). At most one session per CPU but one polls at a time, so many busy
#: clients never spin the daemon's cores away; the others block as before. 0 = never poll. Only on a data
#: connection whose zero-timeout receive reads (UCX): TCP's does not look at the socket (see _request_loop).
SHM_SPIN_S = 0.002
#: ... but not after a reply that leaves the client more than this many bytes to copy: that copy outlasts
#: the poll anyway, and a polling daemon keeps the client from splitting its copy over two cores.
SHM_SPIN_MAX_BYTES = 16 << 20


def _spin_slots() -> int:
    return max(0, usable_cpus() - 1)


_SPIN_SLOTS = threading.BoundedSemaphore(max(1, _spin_slots()))
#: Guards each job's cleanup-once flag (held for two bytecodes: one lock for all jobs is cheaper than one each).
_CLEANUP_LOCK = threading.Lock()
_allocate_lock = threading.Lock
_CAN_SPIN = _spin_slots() > 0


class Done:
    """A one-way flag threads can wait on: what :class:`threading.Event` does for a job, for a tenth of its
    cost (a job is made per data-plane request; an Event is a Condition, a lock and a deque)."""

    __slots__ = ("_flag", "_lock")

    def __init__(self) -> None:
        self._flag = False
        self._lock = _allocate_lock()
        self._lock.acquire()  # held until set(): waiters block on it

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        if self._flag:
            return
        self._flag = True
        try:
            self._lock.release()
        except RuntimeError:  # set by another thread at the same moment: released once already
            pass

    def wait(self, timeout: float | None = None) -> bool:
        if self._flag:
            return True
        if self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            self._lock.release()  # the next waiter wakes in turn
        return self._flag


class Job:
    """One transfer scheduled on a session. ``run(transport, step)`` executes on the worker (or the request thread).

    ``messages``: how many messages the job sends or receives on (tag 1, tag 2,
    tag 5); the session reserves that many consecutive steps of each tag when
    it queues or starts the job (``down_step``, ``up_step``, ``reply_step``: the
    first of each). ``None``: one message on tag 1 or tag 2, as ``schedule``'s
    ``up`` says (the gRPC calls' transfers). ``step`` is the first step of the
    job's tag-1 messages, or of its tag-2 messages when it has none.
    """

    __slots__ = (
        "kind",
        "_run",
        "messages",
        "step",
        "down_step",
        "up_step",
        "reply_step",
        "deadline",
        "_cleanup",
        "direction",
        "nbytes",
        "via",
        "client_copy",
        "done",
        "holds_request",
        "result",
        "error",
        "_cleaned",
    )

    def __init__(
        self,
        kind: str,
        run: Callable[["Transport", int], Any],
        *,
        deadline: float,
        cleanup: Callable[[], None] | None = None,
        direction: str = "out",
        nbytes: int = 0,
        messages: tuple[int, int, int] | None = None,
    ) -> None:
        self.kind = kind
        self._run = run
        self.messages = messages
        self.step = 0  # set by Session.schedule before the worker can see the job
        self.down_step = 0
        self.up_step = 0
        self.reply_step = 0
        self.deadline = deadline
        self._cleanup = cleanup
        self.direction = direction
        self.nbytes = nbytes
        #: The transport the metrics name (None: the session's; "shm": shared memory).
        self.via: str | None = None
        #: Bytes the client copies through shared memory after this reply (a read, or a write it fills before
        #: its COMMIT): a request thread that polls for the next request would only slow a long copy down.
        self.client_copy = 0
        self.done = Done()
        #: The job reads the request's receive buffer (row numbers in place): it is posted again only after.
        self.holds_request = False
        self.result: Any = None
        self.error: BaseException | None = None
        self._cleaned = False

    def execute(self, transport: "Transport") -> None:
        try:
            self.result = self._run(transport, self.step)
        except BaseException as exc:  # noqa: BLE001 - reported to the waiter
            self.error = exc
        finally:
            self.cleanup()
            self.done.set()

    def fail(self, exc: BaseException) -> None:
        if not self.done.is_set():
            self.error = exc
            self.cleanup()
            self.done.set()

    def cleanup(self) -> None:
        with _CLEANUP_LOCK:  # fail() (a closing session) and execute() may race here
            if self._cleaned:
                return
            self._cleaned = True
        if self._cleanup is not None:
            try:
                self._cleanup()
            except Exception:
                log.exception("cleanup of a %s transfer failed", self.kind)

    def wait(self, timeout: float) -> Any:
        if not self.done.wait(timeout):
            raise TransferTimeout(f"{self.kind}: the transfer did not finish in time")
        if self.error is not None:
            raise self.error
        return self.result


class PendingWrite:
    """A put or row update whose bytes are (being) received; committed by CommitPut."""

    def __init__(
        self,
        op_id: int,
        job: Job,
        commit: Callable[[], Any],
        abort: Callable[[], None],
        *,
        shm_op: str = "",
        deadline: float | None = None,
        nbytes: int = 0,
        t0: float = 0.0,
    ) -> None:
        self.op_id = op_id
        self.job = job
        self.commit = commit
        self.abort = abort
        self.finished = False
        #: A shared-memory write (committed by a COMMIT request): the op it is (metrics), else "".
        self.shm_op = shm_op
        #: When an uncommitted shared-memory write closes its session (the reaper checks).
        self.deadline = deadline
        self.nbytes = nbytes
        self.t0 = t0


class Session:
    """One client's data-plane session (see the module docstring)."""

    def __init__(
        self,
        sid: str,
        nonce: bytes,
        listener: "Listener",
        *,
        connect_timeout: float,
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
        self._scratch: "torch.Tensor | None" = None
        # --max-bytes accounting of this session's own buffers (see _release_buffers): the store they are
        # charged to, what was charged at open (the request buffers), and the row buffer's charged capacity
        self._store = store
        self._fixed_charge = charged
        self._scratch_charge_cap = 0
        self._released = False
        self._req_bufs: "list[torch.Tensor]" = []
        self._holders = 1  # threads that use the charged buffers: the worker, and the request thread once started
        self._handler = handler
        #: This session's data-plane counts (folded into the metrics at each scrape and at close).
        self.tally: "Tally | None" = Tally() if metrics is not None else None
        self._exec = threading.Lock()  # held while a job runs (worker or request thread): one at a time
        self.gatherer: Any = (
            None  # the request path's helper thread (tensorwire.serve.daemon.datapath), made on first use
        )
        self.reply_buf: "torch.Tensor | None" = None  # the request path's reply buffer (jobs run one at a time)
        self._reply: "tuple[memoryview, Any] | None" = None  # (view to pack into, what to send): reply_buffer()
        self._req_views: "dict[int, tuple[torch.Tensor, memoryview]]" = {}  # request buffer -> its bytes
        self._probe_buf: Any = None
        # shared memory (see the module docstring)
        self.shm = False
        self.shm_hello: Any = None  # the hello region, until proven or withdrawn
        self.shm_nonce = b""
        self.shm_version = 0  # negotiated at OpenSession (2: read leases)
        self.shm_page: Any = None  # the hello region once proven (shm version >= 2): the client's lease-read counts
        self._page_seen = (0, 0, 0, 0)
        self.ahead: Any = None  # the write-ahead grant its client holds (tensorwire.serve.daemon.store.AheadGrant)
        self._page_lock: Any = None  # (shm.PageLock, ticket cell) of the page, made with the first grant
        self._tickets = 0
        self._pin: "tuple[Callable[[], None], str] | None" = None
        self._shm_scratch: Any = None  # Region
        self._scratch_charge: "tuple[Any, int] | None" = None  # (store, bytes charged)
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

    def next_op_id(self) -> int:
        with self._lock:
            self._op_ids += 1
            return self._op_ids

    @staticmethod
    def _scratch_cap(nbytes: int) -> int:
        return min(1 << max(16, (nbytes - 1).bit_length()), MAX_ROWS_BYTES)

    def reserve_scratch(self, nbytes: int) -> None:
        """Charge the row buffer's growth to ``nbytes`` against ``--max-bytes`` now (a handler, before it
        schedules the job that uses it): a request that does not fit is refused before anything is done.

        Raises:
            ResourceExhaustedError: it does not fit (what is charged already stays).
            ClosedError: the session is closed.
        """
        if nbytes > MAX_ROWS_BYTES:
            raise ProtocolError(f"{nbytes} bytes of rows exceeds the per-request limit of {MAX_ROWS_BYTES}")
        store = self._store
        if store is None or nbytes == 0:
            return
        with self._lock:
            cap = self._scratch_cap(nbytes)
            if self._released:
                raise ClosedError(f"session closed: {self.close_reason}")
            grow = cap - self._scratch_charge_cap
            if grow <= 0:
                return
            store.charge(grow, f"a {nbytes}-byte row buffer for this session", buffers=True)
            self._scratch_charge_cap = cap

    def scratch(self, nbytes: int) -> "torch.Tensor":
        """A per-session host buffer of at least ``nbytes`` (grown, never shrunk; the thread running a job only).

        Its capacity is charged against ``--max-bytes`` (by :meth:`reserve_scratch`, or here) and the
        memory is freed when the session ends (:meth:`_release_buffers`).
        """
        if self._scratch is None or self._scratch.numel() < nbytes:
            self.reserve_scratch(nbytes)
            old, self._scratch = self._scratch, None
            _free(old)  # before the bigger one: the two never coexist
            self._scratch = allocate_host(self._scratch_cap(nbytes))
        return self._scratch[:nbytes]

    def request_buffer(self, nbytes: int) -> "torch.Tensor":
        """A request buffer of the request thread (charged at open; freed when the session ends)."""
        import torch

        b = torch.empty(nbytes, dtype=torch.uint8)
        self._req_bufs.append(b)
        self._req_views[id(b)] = (b, memoryview(b.numpy()))
        return b

    def request_view(self, buf: "torch.Tensor") -> memoryview:
        """The bytes of request buffer ``buf`` (made once per buffer, not per request)."""
        v = self._req_views.get(id(buf))
        return v[1] if v is not None and v[0] is buf else memoryview(buf.numpy())

    def reply_buffer(self) -> "tuple[memoryview, Any]":
        """The request path's reply buffer (made on first use; the thread running a job only): a view to pack
        into and what to send -- on TCP that same view (its send takes one as it is), else the tensor."""
        r = self._reply
        if r is None:
            import torch

            self.reply_buf = buf = torch.zeros(REPLY_BYTES, dtype=torch.uint8)
            mv = memoryview(buf.numpy())
            r = self._reply = (mv, mv if self.kind == "tcp" else buf)
        return r

    def _release_buffers(self) -> None:
        """The worker, once the session is closed: free the jobs' buffers now (not at the next garbage
        collection: views of them may sit in reference cycles) and give their charge back."""
        with self._exec:  # the job running now, if any, finishes first; no other starts on a closed session
            with self._lock:
                if self._released:
                    return
                self._released = True
                charge, self._scratch_charge_cap = self._scratch_charge_cap, 0
                bufs = [self._scratch, self.reply_buf]
                self._scratch = self.reply_buf = None
                self._reply = None
            for b in bufs:
                _free(b)
            # the last of this session's counts: no job runs on it any more (and none after)
            self.fold_tally()
        if charge and self._store is not None:
            self._store.uncharge(charge, buffers=True)
        self._drop_holder()

    def _drop_holder(self) -> None:
        """A thread that used the request buffers' charge is done; the last one gives it back."""
        with self._lock:
            self._holders -= 1
            charge = self._fixed_charge if self._holders == 0 else 0
            if charge:
                self._fixed_charge = 0
        if charge and self._store is not None:
            self._store.uncharge(charge, buffers=True)

    # -- shared memory ------------------------------------------------------------------
    def offer_shm(self, registry: Any) -> str:
        """Create the hello region (the client proves it maps it); returns its name."""
        region, nonce = new_hello(registry)
        with self._lock:
            closed = self.closed
            if not closed:
                self.shm_hello, self.shm_nonce = region, nonce
        if closed:
            region.close()
        return region.name

    def withdraw_hello(self, *, keep: bool = False) -> None:
        """Take the hello region off the offer (proof given, refused, or the client went on without it): unlinked,
        or with ``keep`` (a good proof on shm version >= 2) kept as the session's page (see :meth:`fold_page`)."""
        with self._lock:
            region, self.shm_hello = self.shm_hello, None
            self.shm_nonce = b""
            if keep and region is not None and not self.closed:
                self.shm_page, region = region, None
        if region is not None:
            region.close()

    def fold_tally(self) -> None:
        """Add this session's data-plane counts since the last fold to the metrics (a scrape, or close)."""
        if self._metrics is not None and self.tally is not None:
            self._metrics.fold(self.tally)

    def fold_page(self) -> None:
        """Add the reads this session's client served from leases since the last fold to the metrics.

        The client counts them in its page (get ops, get bytes, get_rows ops, get_rows bytes); only
        growth is counted, so a client writing nonsense can at worst inflate its own counters.
        """
        with self._lock:
            page, m, seen = self.shm_page, self._metrics, self._page_seen
            if page is None or m is None or page.closed:
                return
            now = page_counts(page)
            self._page_seen = tuple(max(a, b) for a, b in zip(now, seen))  # type: ignore[assignment]
        d = [max(0, a - b) for a, b in zip(now, seen)]
        for op, ops, nbytes in (("Get", d[0], d[1]), ("GetRows", d[2], d[3])):
            if ops:
                m.operations.labels(op, "ok").inc(ops)
                m.transfers.labels("shm", "out").inc(ops)
            if nbytes:
                m.bytes.labels("shm", "out").inc(nbytes)

    def grant_ahead(self, entry: Any) -> Any:
        """After this session committed a put of ``entry``: reserve its staging slot for the next one
        (shm version >= 3). Returns the grant (its slot's region and ticket go in the COMMIT's reply) or None."""
        with self._lock:
            page = self.shm_page
            if self.closed or page is None or page.closed or self.shm_version < AHEAD_VERSION or self.ahead is not None:
                return None
            if self._page_lock is None:
                self._page_lock = (PageLock(page.path), page_ahead(page._mm))
            lock, word = self._page_lock
            self._tickets += 1
            ticket = self._tickets

        def make(idx: int) -> AheadGrant:
            word[0] = ticket  # the client reads it only after the reply, or under the page lock
            return AheadGrant(entry, idx, ticket, region_of(entry.slot(idx)), word, lock)

        g = entry.grant_ahead(make)
        if g is None:
            return None
        with self._lock:
            if not self.closed:
                self.ahead = g
                return g
        g.revoke(force=True)
        return None

    def give_back_ahead(self, g: Any) -> None:
        """Undo :meth:`take_ahead` (the grant stays the session's; ended at close if not before)."""
        with self._lock:
            if not self.closed and self.ahead is None:
                self.ahead = g
                return
        g.revoke(force=True)

    def take_ahead(self) -> Any:
        """The session's grant, no longer the session's (claim or revoke it)."""
        with self._lock:
            g, self.ahead = self.ahead, None
        return g

    def hold_pin(self, release: Callable[[], None], name: str) -> None:
        """Keep a read pin until the client's RELEASE (or its next request, or close)."""
        with self._lock:
            old, closed = self._pin, self.closed
            if not closed:
                self._pin = (release, name)
        if old is not None:  # pragma: no cover - callers release first
            old[0]()
        if closed:
            release()

    @property
    def holds_pin(self) -> bool:
        """Whether a read pin is held for the client (set and cleared by the thread running its requests)."""
        return self._pin is not None

    def release_pin(self, name: str | None = None) -> bool:
        """Release the held pin (of ``name``, when given). Returns whether one was held (and matched)."""
        with self._lock:
            pin = self._pin
            if pin is None or (name is not None and pin[1] != name):
                return False
            self._pin = None
        pin[0]()
        return True

    def shm_scratch(self, nbytes: int, store: Any) -> Any:
        """The session's scratch region, of at least ``nbytes`` (grown, never shrunk; charged to the store).

        Raises:
            ResourceExhaustedError: over ``--max-bytes`` or the per-request limit.
            ShmError: no region could be made.
        """
        r = self._shm_scratch
        if r is not None and not r.closed and r.size >= nbytes:
            return r
        if nbytes > MAX_ROWS_BYTES:
            raise ResourceExhaustedError(f"{nbytes} bytes of rows exceeds the per-request limit of {MAX_ROWS_BYTES}")
        size = round_page(min(max(1 << 20, 1 << max(0, (nbytes - 1).bit_length())), MAX_ROWS_BYTES))
        self._drop_scratch()
        store.charge(size, "a session's shared-memory scratch")
        try:
            region = store.shm.create(size)
        except BaseException:
            store.uncharge(size)
            raise
        with self._lock:
            closed = self.closed
            if not closed:
                self._shm_scratch, self._scratch_charge = region, (store, size)
        if closed:
            region.close()
            store.uncharge(size)
            raise ClosedError(f"session closed: {self.close_reason}")
        return region

    def _drop_scratch(self) -> None:
        with self._lock:
            region, self._shm_scratch = self._shm_scratch, None
            charge, self._scratch_charge = self._scratch_charge, None
        if region is not None:
            region.close()
        if charge is not None:
            charge[0].uncharge(charge[1])

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
            err = job.error
            log.warning("session %s: %s transfer failed: %s", self.id[:8], job.kind, err)
            if self._metrics is not None:
                self._metrics.errors.labels(type(err).__name__).inc()
            self.close(f"{job.kind} transfer failed: {err}")
        elif job.direction and self.tally is not None:
            self.tally.transfer(job.via or self.kind, job.direction, job.nbytes, time.monotonic() - t0)

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
            # this thread's own buffers: nothing else reads them, and it is done with them now
            bufs, self._req_bufs = self._req_bufs, []
            self._req_views = {}
            for b in bufs:
                _free(b)
            self._drop_holder()

    def _request_loop(self) -> None:
        """Receive data-plane requests on tag 4; each becomes a job (see the module docstring)."""
        import torch

        t = self.transport
        handler = self._handler
        assert t is not None and handler is not None
        self._probe_buf = torch.zeros(8, dtype=torch.uint8)
        # Two request buffers: the client always has a credit for its next request, and a job may
        # use its request's bytes (the row numbers) in place; its buffer is posted again once the
        # job is done. Virtual memory only until requests use it (pages are touched by what arrives).
        # A shared-memory session gets a third: a client's RELEASE may be followed at once by its next
        # request, and with two the second would wait for the credit of the buffer still in use
        # (measured with a RELEASE after every read: a tiny get 210 -> 120 us).
        posted: "collections.deque[torch.Tensor]" = collections.deque()
        expected = 0
        # Poll only where a zero-timeout receive looks for a message (UCX progresses its worker): TCP's
        # returns at once without reading the socket, so polling there would burn up to SHM_SPIN_S of CPU per
        # request and leave the request unread until it ends (measured on the 2-core VM: a 4 KiB shared-memory
        # get 2.7 ms and ~2 ms of the daemon's CPU with the poll, 0.37 ms and 0.18 ms without).
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
                job = handler(self, buf, r.nbytes)  # validated; may read ``buf`` until it is done
                early = job is None or not job.holds_request
                if early:
                    # Its bytes are parsed and copied: post it again now, so its credit rides on the reply
                    # (posted after the reply, the credit went out in a frame of its own, a send per request).
                    t.post_recv(TAG_REQUEST, buf, header=True)
                    posted.append(buf)
                if job is not None:  # None: answered by nothing (a RELEASE), done already
                    self.submit(job)
                    while not job.done.wait(1.0):  # queued behind the worker's jobs: wait for it
                        self.check_open()
                if not early:
                    t.post_recv(TAG_REQUEST, buf, header=True)
                    posted.append(buf)
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
            self.release_pin()
            g = self.take_ahead()
            if g is not None:
                g.revoke(force=True)  # the client is gone or going (as a pending write's abort)
            self._drop_scratch()
            self.withdraw_hello()
            self.fold_page()
            with self._lock:
                page, self.shm_page = self.shm_page, None
                lock, self._page_lock = self._page_lock, None
            if lock is not None:
                lock[0].close()
            if page is not None:
                page.close()
        except Exception:
            log.exception("releasing the session's shared memory failed")
        self._jobs.put(None)
        g = self.gatherer
        if g is not None:
            g.stop()
        self._on_close(self)

    def join(self, timeout: float) -> None:
        self._worker.join(timeout)
