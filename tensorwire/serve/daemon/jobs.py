"""What a session runs: a :class:`Job` (one transfer, or the answer to one data-plane request), the
:class:`Done` flag its waiters wait on, and a :class:`PendingWrite` awaiting its commit.

A job is made per request (the data-plane requests of :mod:`tensorwire.serve.daemon.datapath`, the gRPC
calls of :mod:`tensorwire.serve.daemon.service`) and run by its session (:mod:`tensorwire.serve.daemon.session`),
on the worker thread or on the request thread, one at a time.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable

from tensorwire.errors import TransferTimeout

if TYPE_CHECKING:  # pragma: no cover
    from tensorwire.transport.base import Transport

__all__ = ["Done", "Job", "PendingWrite"]

log = logging.getLogger(__name__)

#: Guards each job's cleanup-once flag (held for two bytecodes: one lock for all jobs is cheaper than one each).
_CLEANUP_LOCK = threading.Lock()
_allocate_lock = threading.Lock


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
        "request_read",
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
        #: Set by the session for a job that holds its request: the job calls it once it no longer reads the
        #: request's buffer (a get_rows, once gathered), which posts the buffer again then -- its credit rides on
        #: the reply instead of a frame of its own after the job. Idempotent; the session calls it after the job.
        self.request_read: Callable[[], None] | None = None
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
