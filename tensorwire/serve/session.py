"""Server side of one client session: its data transport, worker and watch.

A session is opened over gRPC (``OpenSession``): the server makes a random
nonce, tells its data listener to ``expect`` it, and returns it. The client
dials the data listener and presents the nonce; anything else is dropped by
the listener. From then on:

- the **worker** thread runs the session's transfers one at a time, in the
  order the control calls scheduled them (tags 1 and 2 each carry one message
  per transfer, in FIFO order, with the step the server announced);
- the **watch** thread keeps one tiny receive posted on tag 3, which the
  client never sends on: it notices at once when the client goes away
  (killed, closed) and closes the session, releasing what it held.

Any failure of a transfer closes the session: a half-done transfer leaves the
stream in an unknown state, and closing also guarantees that a receive posted
into a staging slot can never be completed later. The client opens a new
session on its next call.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from ..errors import ClosedError, PeerLostError, ProtocolError, TensorWireError, TransferTimeout
from .protocol import MAX_ROWS_BYTES, TAG_WATCH

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..transport.base import Listener, Transport
    from .metrics import Metrics

__all__ = ["Session", "Job"]

log = logging.getLogger(__name__)


class Job:
    """One transfer scheduled on a session. ``run`` executes on the worker."""

    def __init__(
        self,
        kind: str,
        run: Callable[["Transport", int], Any],
        *,
        deadline: float,
        cleanup: Callable[[], None] | None = None,
        direction: str = "out",
        nbytes: int = 0,
    ) -> None:
        self.kind = kind
        self._run = run
        self.step = 0  # set by Session.schedule before the worker can see the job
        self.deadline = deadline
        self._cleanup = cleanup
        self.direction = direction
        self.nbytes = nbytes
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self._cleaned = False
        self._lock = threading.Lock()

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
        with self._lock:
            if self._cleaned:
                return
            self._cleaned = True
        if self._cleanup is not None:
            try:
                self._cleanup()
            except Exception:  # noqa: BLE001 - never let cleanup mask the outcome
                log.exception("cleanup of a %s transfer failed", self.kind)

    def wait(self, timeout: float) -> Any:
        if not self.done.wait(timeout):
            raise TransferTimeout(f"{self.kind}: the transfer did not finish in time")
        if self.error is not None:
            raise self.error
        return self.result


class PendingWrite:
    """A put or row update whose bytes are (being) received; committed by CommitPut."""

    def __init__(self, op_id: int, job: Job, commit: Callable[[], Any], abort: Callable[[], None]) -> None:
        self.op_id = op_id
        self.job = job
        self.commit = commit
        self.abort = abort
        self.finished = False


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
        self._op_ids = 0
        self.pending: PendingWrite | None = None
        self.transport: "Transport | None" = None
        self.closed = False
        self.close_reason = ""
        self.last_used = time.monotonic()
        self.active = 0  # scheduled + running jobs
        self._scratch: "torch.Tensor | None" = None
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

    def schedule(self, job: Job, *, up: bool) -> int:
        """Queue ``job``; returns the step its message carries on its tag."""
        with self._lock:
            self.check_open()
            if up:
                self._up_step += 1
                step = self._up_step
            else:
                self._down_step += 1
                step = self._down_step
            self.active += 1
            if self._metrics is not None:
                self._metrics.inflight.inc()
            job.step = step
            self._jobs.put(job)
        return step

    def next_op_id(self) -> int:
        with self._lock:
            self._op_ids += 1
            return self._op_ids

    def scratch(self, nbytes: int) -> "torch.Tensor":
        """A per-session host buffer of at least ``nbytes`` (grown, never shrunk; worker only)."""
        from ..buffers import allocate_host

        if nbytes > MAX_ROWS_BYTES:
            raise ProtocolError(f"{nbytes} bytes of rows exceeds the per-request limit of {MAX_ROWS_BYTES}")
        if self._scratch is None or self._scratch.numel() < nbytes:
            cap = 1 << max(16, (nbytes - 1).bit_length())
            self._scratch = allocate_host(min(cap, MAX_ROWS_BYTES))
        return self._scratch[:nbytes]

    # -- worker --------------------------------------------------------------------
    def _work(self) -> None:
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
        self._watch = threading.Thread(target=self._watch_loop, name=f"tensorwire-watch-{self.id[:8]}", daemon=True)
        self._watch.start()
        while True:
            job = self._jobs.get()
            if job is None:
                break
            if self.closed:
                job.fail(ClosedError(f"session closed: {self.close_reason}"))
                self._job_done()
                continue
            t0 = time.monotonic()
            job.execute(t)
            self._job_done()
            if job.error is not None:
                err = job.error
                log.warning("session %s: %s transfer failed: %s", self.id[:8], job.kind, err)
                if self._metrics is not None:
                    self._metrics.errors.labels(type(err).__name__).inc()
                self.close(f"{job.kind} transfer failed: {err}")
            elif self._metrics is not None:
                m = self._metrics
                m.bytes.labels(self.kind, job.direction).inc(job.nbytes)
                m.transfers.labels(self.kind, job.direction).inc()
                m.transfer_seconds.labels(self.kind, job.direction).observe(time.monotonic() - t0)
        self._drain_queue()

    def _job_done(self) -> None:
        with self._lock:
            self.active -= 1
        if self._metrics is not None:
            self._metrics.inflight.dec()

    def _drain_queue(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.fail(ClosedError(f"session closed: {self.close_reason}"))
                self._job_done()

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
        except Exception as exc:  # noqa: BLE001
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
            except Exception:  # noqa: BLE001
                log.exception("releasing a pending write failed")
        self._jobs.put(None)
        self._on_close(self)

    def join(self, timeout: float) -> None:
        self._worker.join(timeout)
