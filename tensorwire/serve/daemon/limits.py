"""Bounds that keep one client from taking the daemon away from the others.

- :class:`WaitGate`: waits inside gRPC handler threads. A handler that must
  wait for something another client holds (BeginPut for a name another put
  has reserved, a read while a row update runs, a CommitPut whose bytes are
  still arriving) waits at most ``slice_s`` seconds, and only while one of
  ``slots`` waiting places is free; otherwise it answers
  :class:`~tensorwire.serve.protocol.common.Busy` at once -- nothing was
  reserved or scheduled -- and the client calls again with backoff until its
  own timeout. So at most ``slots`` of the ``--workers`` handler threads are
  ever waiting, each for at most ``slice_s``, and the others always answer
  List, OpenSession and health, however many writers wait and for however long.

  Why not the alternatives: a separate pool of waiting threads still needs a
  thread (and its stack) per waiter, so it only moves the bound; grpc's asyncio
  server would need every handler (and the store's locks) rewritten for one
  event loop. A retry costs a waiting writer one round trip per slice (~1 ms
  against a 0.5 s slice on loopback).
- :func:`raise_nofile`: the daemon's descriptor limit, raised to the hard
  limit at start so a flood of connections meets the listeners' own caps
  (which answer) before the kernel's (which make accept fail).
"""

from __future__ import annotations

import logging
import resource
import threading
import time
from typing import Callable, TypeVar

from tensorwire.errors import TransferTimeout
from tensorwire.serve.protocol.common import Busy

__all__ = ["WaitGate", "raise_nofile"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class WaitGate:
    """Bounded waiting in handler threads (see the module docstring).

    Args:
        slots: handler threads that may wait at the same time.
        slice_s: the longest one handler waits before it answers Busy.
    """

    def __init__(self, slots: int, *, slice_s: float = 0.5) -> None:
        if slots < 1 or not slice_s > 0:
            raise ValueError("WaitGate needs slots >= 1 and a positive slice")
        self.slots = slots
        self.slice_s = slice_s
        self._sem = threading.BoundedSemaphore(slots)
        #: Calls answered Busy (the client retries), since start.
        self.busy = 0

    def run(self, wait: Callable[[float], T], deadline: float, what: str) -> T:
        """``wait(until)`` waits until ``until`` at most and raises TransferTimeout past it; run it bounded.

        Raises:
            Busy: it would wait longer than this handler may (a waiting place or the slice ran out
                before ``deadline``); nothing was done.
            TransferTimeout: ``deadline`` itself passed.
        """
        if self._sem.acquire(blocking=False):
            try:
                return self._try(wait, min(deadline, time.monotonic() + self.slice_s), deadline, what)
            finally:
                self._sem.release()
        return self._try(wait, time.monotonic(), deadline, what)  # no place to wait: only what is free now

    def _try(self, wait: Callable[[float], T], until: float, deadline: float, what: str) -> T:
        try:
            return wait(until)
        except TransferTimeout:
            if time.monotonic() >= deadline:
                raise
            self.busy += 1
            raise Busy(f"{what}: waiting for other clients' transfers; call again (nothing was done)") from None


def raise_nofile() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # pragma: no cover - a container may refuse
            log.warning("cannot raise the file descriptor limit from %d to %d: %s", soft, hard, exc)
    return soft
