"""Closing one side of a copy-engine pair (:class:`Closing`, a part of :class:`~.pair.CePair`).

A script's last ``isend``/``send`` returns long before its copy ran, and the peer's stream waits for it: a
close that failed every pending message at once would release the peer's streams with bytes that never came.
A close therefore first *drains* -- waits, up to a linger, until this side's messages are over on the GPUs --
and only then fails what is left. Where work was still queued, the pair's shared region and the peer's mapped
memory stay mapped for the life of the process (a few MiB) rather than let queued GPU work fault.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # pragma: no cover
    from .exports import Exports
    from .pair import CeOp
    from .region import Region

__all__ = ["Closing"]

#: pairs closed while GPU work could still name their memory (see :meth:`Closing.close`)
_KEPT: list["Closing"] = []


class Closing:
    """The closing half of :class:`~.pair.CePair` (see the module docstring)."""

    region: "Region"
    driver: Any
    exports: "Exports"
    error: BaseException | None
    _lock: threading.Lock
    _drainers: list[Callable[[], bool]]
    _graph_entries: list[int]
    _registered: set[int]
    _own_exports: bool
    _closed: bool

    # (defined by the parts above this one: Watched, CePair)
    def _peer_lost(self, now: float) -> BaseException | None:
        raise NotImplementedError

    def _drop_completed(self) -> "list[CeOp]":
        raise NotImplementedError

    def fail(self, exc: BaseException) -> None:
        raise NotImplementedError

    def on_drain(self, idle: Callable[[], bool]) -> None:
        """``idle()`` says whether the caller's own messages on this pair are over (asked by :meth:`drain`)."""
        self._drainers.append(idle)

    def drain(self, linger: float) -> bool:
        """Wait up to ``linger`` s until every message of this side is over on the GPUs; True if they are.

        A close that did not wait would fail messages whose copies are still queued (the peer's stream would be
        released with bytes that never came): a script's last ``isend``/``send`` returns long before its copy
        ran. Stops early when the pair failed, or the peer closed or died (then nothing more can complete).
        """
        deadline = time.monotonic() + linger
        while True:
            now = time.monotonic()
            gone = self._peer_lost(now) is not None  # (read before the flags: see check)
            busy = any(not op.graph for op in self._drop_completed())
            if not busy and all(idle() for idle in self._drainers):
                return True
            if gone or self.error is not None or now >= deadline:
                return False
            time.sleep(0.001)

    def close(self, reason: BaseException, linger: float = 0.0) -> None:
        """Close this side: after up to ``linger`` s for this side's messages to be over (:meth:`drain`), fail
        whatever is still pending with ``reason`` and tell the peer.

        Where messages were still pending (or CUDA graphs hold this pair's flags), streams may still hold flag
        writes and copies that name the region and the peer's mapped memory: both stay mapped for the life of
        the process (a few MiB) rather than let queued GPU work fault on memory unmapped under it.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        drained = self.drain(linger if self.error is None else 0.0)
        self.fail(reason)
        if not drained or self._graph_entries:
            self.region.mark_closed()
            _KEPT.append(self)
            return
        if self._registered:
            try:
                self.driver.unregister_host(self.region.addr)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        if self._own_exports:
            self.exports.close_all()
        self.region.close()
