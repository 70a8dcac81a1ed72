"""``Work`` objects of ``backend="tensorwire"``: what ``isend``/``irecv`` return.

They behave as torch documents for ``torch.distributed.Work``:

- ``wait(timeout)`` blocks until the operation completed (CPU tensors) and
  raises its error; ``timeout`` 0 (torch's default) means the group's timeout.
  A wait that times out raises :class:`~tensorwire.distributed.errors.WorkTimeout`
  and leaves the operation going (wait again).
- ``wait()`` of a CUDA operation, without a timeout, makes the caller's current
  stream wait for it and returns at once, as NCCL's does (:mod:`.streams`); an
  error found later is reported by ``exception()`` and by the group's next call.
  ``wait(timeout)`` blocks the host, as NCCL's does with a timeout.
- ``is_completed()`` never blocks (it makes what progress it can without waiting).
- ``get_future()`` returns a ``torch.futures.Future`` completed with the
  tensors (or the error) when the operation completes, whether or not anyone
  calls ``wait`` (a completer thread of the group drives it then).
- ``exception()``, ``is_success()``, ``source_rank()``, ``result()``.

Nothing here blocks when the Work is made: ``isend``/``irecv`` return at once.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..observe import profiler_flag, traced_wait
from .errors import WorkTimeout

__all__ = ["Work", "DoneWork", "Completer"]

#: Guards the completion state of every work (held for a few instructions: one lock for all of them
#: costs nothing in contention and saves making one per message).
_STATE = threading.Lock()
_NO_TIMEOUT = timedelta(0)
#: Whether a torch.profiler session records (then wait() opens a range: tensorwire.observe).
_profiling = profiler_flag()


class Work(dist._Work):
    """Base of the backend's works: completion state, torch's Work API, an optional future.

    Subclasses implement :meth:`_drive` (make progress until done or the
    deadline) and :meth:`_describe` (what the work is, for errors), and may
    override :meth:`_poll` (non-blocking progress).
    """

    # Completion is a flag; an Event is made only for a thread that has to sleep on it (most
    # works complete in the thread that waits on them: no Event, no wake-up). A work per message
    # makes no lock. Its fields are slots: torch's Work is a pybind11 class, and a field in an
    # instance dict of its subclass costs 60-80 ns to read or write against ~20 ns in a slot (a
    # message reads and writes its work's fields dozens of times). Every slot is set here, so no
    # read misses; subclasses declare theirs the same way.
    __slots__ = (
        "_is_done",
        "_timeout",
        "_wait_seconds",
        "_tensors",
        "_event",
        "_exc",
        "_fut",
        "_source",
        "_completer",
        "_streamed",
        "_deadline",
        "_flow",
        "_t0",
        "_on_error",
    )

    def __init__(self, timeout: float, tensors: list[torch.Tensor]) -> None:
        super().__init__()
        self._is_done = False
        self._timeout = timeout
        self._wait_seconds = timeout
        self._tensors = tensors
        self._event: threading.Event | None = None
        self._exc: BaseException | None = None
        self._fut: torch.futures.Future | None = None
        self._source = -1
        self._completer: Completer | None = None
        self._streamed = False  # a stream waits for it (wait() returned before it completed)
        self._deadline = 0.0  # streamed: when it must be complete
        self._flow: Any = None  # where its completion is counted (tensorwire.observe: watch())
        self._t0 = 0
        self._on_error: Callable[[BaseException], None] | None = None

    def _describe(self) -> str:
        return "operation"

    # -- completion (called by the layers below) ------------------------------------
    def _finish(self, exc: BaseException | None = None) -> None:
        with _STATE:
            if self._is_done:
                return
            self._exc = exc
            self._is_done = True
            ev = self._event
            fut = self._fut
            streamed = self._streamed
            flow = self._flow
            if flow is not None:
                self._flow = None  # taken: counted here (see watch())
        self._finished(exc, streamed)
        if flow is not None:
            t0 = self._t0
            if t0:
                flow.completed(t0)
            else:  # (not timed: Flow.completed inline, one subtraction)
                flow.open -= 1
            if exc is not None:
                (self._on_error or flow.failed)(exc)
        if ev is not None:
            ev.set()
        if fut is not None:
            self._settle(fut)

    def _finished(self, exc: BaseException | None, streamed: bool) -> None:
        """Hook: called once, right after the work completed (``streamed``: a stream waits for it)."""

    def watch(self, flow: Any, t0: int, on_error: Callable[[BaseException], None] | None = None) -> None:
        """Count this work's completion in ``flow`` (a :class:`tensorwire.observe.registry.Flow`; ``t0``: the
        ``perf_counter_ns`` of its post, timed, or 0) and a failure with ``on_error`` (None: the flow's
        ``failed``, by the flow's peer and path), when it completes.

        For a work that was not done when the caller looked (a done one the caller counts itself); the backend's
        hooks do the same inline for a message they do not time. No lock: the stores, ``_flow`` last, then a
        look at ``_is_done``. :meth:`_finish` takes ``_flow`` under ``_STATE`` after marking the work done, so
        if it ran before the stores it marked the work done first and the look sees that; then
        :meth:`_watched_late` and :meth:`_finish` each take ``_flow`` under the lock, and whichever finds it
        still set counts the completion -- once. (Most works complete in their caller's thread, never between
        the caller's look and the stores.)
        """
        if t0:  # (0 is the class's: one store less)
            self._t0 = t0
        if on_error is not None:
            self._on_error = on_error
        self._flow = flow
        if self._is_done:  # completed by another thread meanwhile
            self._watched_late(flow)

    def _watched_late(self, flow: Any) -> None:
        """(see :meth:`watch`) The work completed while it was being watched: count it, unless :meth:`_finish`
        took ``flow`` (and counted it)."""
        with _STATE:
            mine = self._flow is flow
            if mine:
                self._flow = None
        if mine:
            flow.completed(self._t0)
            if self._exc is not None:
                (self._on_error or flow.failed)(self._exc)

    def _settle(self, fut: torch.futures.Future) -> None:
        if fut.done():
            return
        if self._exc is not None:
            fut.set_exception(self._exc)
        else:
            fut.set_result(self._tensors)

    @property
    def done(self) -> bool:
        return self._is_done

    @property
    def _what(self) -> str:
        """What the work is (built only when an error or a timeout names it)."""
        return self._describe()

    def _sleep_until_done(self, timeout: float) -> bool:
        """Sleep until another thread finishes this work (True) or ``timeout`` passes (False)."""
        with _STATE:
            if self._is_done:
                return True
            ev = self._event
            if ev is None:
                ev = self._event = threading.Event()
        return ev.wait(timeout)

    # -- progress (subclasses) ---------------------------------------------------------
    def _drive(self, deadline: float) -> None:
        """Make progress until done; raise WorkTimeout at ``deadline`` (the operation goes on)."""
        if not self._sleep_until_done(max(0.0, deadline - time.monotonic())):
            raise WorkTimeout(f"{self._what} not complete within {self._wait_seconds:.3g} s")

    def _poll(self) -> None:
        """Non-blocking progress (default: none)."""

    def _stream_wait(self) -> bool:
        """Make the caller's current stream wait for this work instead of the host (True: done so).

        Default: never (host tensors). CUDA works queue the wait, then call :meth:`_mark_streamed`.
        """
        return False

    def _mark_streamed(self) -> bool:
        """After a stream wait was queued: record it (True), unless the work completed meanwhile (False)."""
        with _STATE:
            if self._is_done:
                return False
            self._streamed = True
            self._deadline = time.monotonic() + self._timeout
            return True

    # -- torch's Work API ---------------------------------------------------------------------
    def wait(self, timeout: timedelta = _NO_TIMEOUT) -> bool:
        if _profiling():
            return traced_wait(self._wait, self._describe, timeout)
        return self._wait(timeout)

    def _wait(self, timeout: timedelta = _NO_TIMEOUT) -> bool:
        if self._is_done:  # (most host works: completed in the calling thread already)
            if self._exc is not None:
                raise self._exc
            return True
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout or 0)
        if seconds <= 0:
            if not self._is_done and self._stream_wait():
                exc = self._exc
                if exc is not None and not self._streamed:
                    raise exc  # it failed before the stream wait was recorded: report it now
                return True
            seconds = self._timeout
        return self._block(seconds)

    def _block(self, seconds: float) -> bool:
        """Wait (this thread) until done or ``seconds`` passed; raise the work's error."""
        if not self._is_done:
            self._wait_seconds = seconds
            self._drive(time.monotonic() + seconds)
        if self._exc is not None:
            raise self._exc
        return True

    def synchronize(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        if not self._is_done:
            try:
                self._poll()
            except Exception:  # noqa: BLE001 - an error is reported by wait()/exception(), not here
                pass
        return self._is_done

    def is_success(self) -> bool:
        return self._is_done and self._exc is None

    def exception(self) -> BaseException | None:
        return self._exc

    def source_rank(self) -> int:
        return self._source

    def _source_rank(self) -> int:
        return self._source

    def result(self) -> list[torch.Tensor]:
        return self._tensors

    def get_future(self) -> torch.futures.Future:
        with _STATE:
            fut = self._fut
            if fut is None:
                fut = self._fut = torch.futures.Future()
            done = self._is_done
        if done:
            self._settle(fut)
        elif self._completer is not None:
            self._completer.watch(self)
        return fut


class DoneWork(Work):
    """A work that completed when it was made (or failed then)."""

    __slots__ = ("_description",)

    def __init__(self, *, what: str, tensors: list[torch.Tensor], exc: BaseException | None = None) -> None:
        super().__init__(0.0, tensors)
        self._description = what
        self._finish(exc)

    def _describe(self) -> str:
        return self._description


class Completer:
    """One thread per group that drives works whose future was asked for, until they complete.

    Started on the first ``get_future()`` of an incomplete work; stopped by :meth:`close`.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._queue: list[Work] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, work: Work) -> None:
        with self._cond:
            if self._closed:
                return
            self._queue.append(work)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"tw-dist-completer-{self._name}", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                work = self._queue.pop(0)
            try:
                work._block(work._timeout)
            except Exception:  # noqa: BLE001 - the error goes to the future through _finish
                if not work.done:  # timed out: it goes on; look again later
                    with self._cond:
                        self._queue.append(work)

    def close(self, *, fail: Callable[[Work], Any] | None = None) -> None:
        with self._cond:
            self._closed = True
            pending, self._queue = self._queue, []
            self._cond.notify_all()
            thread = self._thread
        for w in pending:
            if fail is not None:
                fail(w)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)
