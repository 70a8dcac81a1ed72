"""What :meth:`Link.isend <tensorwire.p2p.link.Link.isend>` hands out and where queued isends run.

:class:`SendHandle`: the completion handle of one isend (a transport send op posted in the
caller's thread, or a future of the link's sender thread). :class:`IsendQueue`: that thread,
which runs, in order, the isends that cannot be posted where they are called.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from tensorwire.errors import TransferTimeout
from tensorwire.transport.base import Transport

__all__ = ["IsendQueue", "SendHandle"]

log = logging.getLogger(__name__)


class SendHandle:
    """Completion handle of :meth:`Link.isend`."""

    __slots__ = ("_future", "_name", "_op", "_t", "_flow", "_t0")

    def __init__(
        self,
        future: concurrent.futures.Future[Any] | None,
        name: str,
        *,
        op: Any = None,
        transport: Transport | None = None,
    ) -> None:
        self._future = future
        self._name = name
        self._op = op  # a transport send op (async_send transports): the message is already posted
        self._t = transport
        self._flow: Any = None  # where the completion is counted (tensorwire.observe), once seen
        self._t0 = 0

    def watch(self, flow: Any, t0: int) -> None:
        """Count the completion this handle first reports (``done()`` true or ``wait()`` returning) in ``flow``
        (a :class:`tensorwire.observe.registry.Flow`), timed from ``t0`` (``perf_counter_ns``; 0: not timed)."""
        self._flow, self._t0 = flow, t0

    def _seen_done(self) -> None:
        flow, self._flow = self._flow, None
        if flow is not None:
            flow.completed(self._t0)

    def done(self) -> bool:
        if self._op is not None:
            out = bool(self._op.done())
        else:
            assert self._future is not None
            if not self._future.done():
                return False
            if self._t is not None and self._future.exception() is None:
                out = bool(self._future.result().done())  # posted by the link's thread: is it out?
            else:
                out = True
        if out and self._flow is not None:
            self._seen_done()
        return out

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the bytes are out of the tensor given to ``isend``.

        Raises:
            TransferTimeout: not done within ``timeout`` (the send goes on).
            the send's own error (PeerLostError, ...).
        """
        if self._op is not None:
            assert self._t is not None
            self._t.wait_send(self._op, timeout=timeout)
            if self._flow is not None:
                self._seen_done()
            return
        assert self._future is not None
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            op = self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            if self._future.done():
                raise  # the send's own error (TransferTimeout is a TimeoutError too), not this wait's timeout
            raise TransferTimeout(f"isend of {self._name!r} not complete within {timeout}s") from None
        if self._t is not None:  # the link's thread posted it (CUDA isend): now wait for the bytes to leave
            self._op = op
            self._t.wait_send(op, timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
        if self._flow is not None:
            self._seen_done()


class IsendQueue:
    """The link's sender thread: isends that cannot be posted in the caller's thread run here, in order.

    ``pending`` counts the submitted calls not finished yet; while it is non-zero,
    later sends and isends of any name queue behind them.
    """

    def __init__(self, peer: int, check_open: Callable[[], None]) -> None:
        self.pending = 0
        self.check_open = check_open  # raises ClosedError once the link is closed
        self._peer = peer
        self._lock = threading.Lock()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._last: concurrent.futures.Future[Any] | None = None  # the latest isend submitted

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future[Any]:
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"tw-isend-{self._peer}")
            self.pending += 1
            fut = self._last = self._executor.submit(fn, *args)
        fut.add_done_callback(self._done)
        return fut

    def _done(self, _: Any) -> None:
        with self._lock:
            self.pending -= 1

    def shutdown(self) -> None:
        """Cancel the isends not started; the one under way ends with the link's transport."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def join(self, timeout: float = 5.0) -> None:
        """After :meth:`shutdown` and the transport's close: wait (``timeout`` at most) for the sender
        thread to end. The isend under way fails with the closed transport; the others were cancelled."""
        with self._lock:
            ex, self._executor = self._executor, None
            last, self._last = self._last, None
        if ex is None:
            return
        if last is None or not concurrent.futures.wait([last], timeout).not_done:
            ex.shutdown(wait=True)  # idle now (in order: the last one done, all are): its thread ends at once
        else:
            log.warning("the isend thread of the link to rank %d did not end within %.1fs", self._peer, timeout)
