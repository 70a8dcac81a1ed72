"""The watchdog's look at a copy-engine pair, its pending and failed messages (:class:`Watched`, of ``CePair``).

A pair's watchdog thread (:class:`~.setup.Watchdog`) calls :meth:`Watched.check` a few times a second: it beats
this side's heartbeat, reads the peer's state (closed, dead, silent), completes the messages whose flags came,
and fails the pair -- every stream waiting on one of its flags released, every pending message failed -- when
the peer is lost or a message outlived the timeout.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable

from ...errors import PeerLostError, ProtocolError, TransferTimeout
from .closing import Closing
from .region import (
    DST_READY,
    ERR_LOST,
    ERR_MISMATCH,
    FAILED,
    LANDED,
    RECV_DONE,
    SRC_READY,
    pid_namespace,
    process_alive,
)

if TYPE_CHECKING:  # pragma: no cover
    from .pair import CeOp

__all__ = ["Watched", "PRUNE_AT"]

#: a side completes and drops the completed ones among its pending messages when it has this many (or twice
#: as many as were left at the last look)
PRUNE_AT = 32


class Watched(Closing):
    """The watchdog's half of :class:`~.pair.CePair` (see the module docstring)."""

    peer: int
    timeout: float
    peer_timeout: float
    clock: float
    _pending: "list[CeOp]"
    _pending_lock: threading.Lock
    _last_beat: tuple[int, float]
    _releasers: list[Callable[[], None]]

    _mismatch: Callable[[tuple[int, ...], tuple[int, ...], bool], str | None]
    _prune_at: int
    _pruning: bool

    # -- a failed message -------------------------------------------------------------------------------------
    def _release(self, entry: int, seq: int) -> None:
        """Let every stream waiting on this entry go on (host writes of its flags): failure paths only."""
        for which in (SRC_READY, DST_READY, LANDED, RECV_DONE):
            self.region.release(entry, which, seq)

    def failure(self, entry: int, sending: bool, what: Callable[[], str]) -> BaseException:
        """The error of a message whose entry says FAILED (the peer refused it, or the pair was lost)."""
        _seq, _state, code = self.region.head(entry)
        if code == ERR_MISMATCH:
            mine = self.region.read_block(entry, sending)
            theirs = self.region.read_block(entry, not sending)
            return ProtocolError(self._mismatch(mine.words, theirs.words, sending) or f"{what()}: refused by the peer")
        if self.error is not None:
            return self.error
        return PeerLostError(f"{what()}: failed on the copy-engine path (code {code})")

    # -- completed messages leave at once -----------------------------------------------------------------------
    def _prune(self) -> None:
        """Complete the pending messages whose flags came and drop them (the caller's thread, at the start of
        a message, with no lock of the pair held: completing runs the Works' callbacks).

        Left to the watchdog, which looks every ``WATCH_S``, thousands of completed messages sat in the list
        between two looks: each look then held the GIL for milliseconds while the caller waited for it, and
        every message's objects lived long enough to reach Python's oldest generation, whose collections
        (tens of milliseconds with torch loaded) they then set off. Here the list is looked at each time it
        has doubled since the last look (at least ``PRUNE_AT``): a constant cost per message.
        """
        if self._pruning:  # (a Work's callback that sends again: the outer call finishes the look)
            return
        self._pruning = True
        try:
            self._prune_at = max(PRUNE_AT, 2 * len(self._drop_completed()))
        finally:
            self._pruning = False

    def _drop_completed(self) -> "list[CeOp]":
        """Complete the pending messages whose flags came, drop them, and return the rest. The looks run with
        the list's lock released: completing a message runs its Work's callbacks, which may send again."""
        with self._pending_lock:
            ops = self._pending
        for op in ops:
            op.poll()
        with self._pending_lock:
            self._pending = left = [op for op in self._pending if not op._done]
        return left

    # -- the watchdog's look ----------------------------------------------------------------------------------
    def pending(self) -> int:
        with self._pending_lock:
            return len(self._pending)

    def check(self, now: float) -> BaseException | None:
        """Beat, look at the peer and at pending messages; returns the error that failed the pair now, if any."""
        self.clock = now
        self.region.beat()
        # the peer's state first, then the messages: a peer closes only once its copies ran (drain), so a message
        # still pending after a "closed" was read can no longer complete
        lost = self._peer_lost(now)
        late = [op for op in self._drop_completed() if now > op.deadline]
        if lost is None and late:
            lost = TransferTimeout(
                f"{late[0].what()}: the peer (rank {self.peer}) did not take part within {self.timeout:.3g} s "
                f"({len(late)} message(s) pending on the copy-engine path)"
            )
        if lost is not None:
            self.fail(lost)
            return lost
        return None

    def _peer_lost(self, now: float) -> BaseException | None:
        pid, pidns, beat, closed = self.region.peer_state()
        if closed:
            return PeerLostError(f"rank {self.peer} closed its side of the copy-engine path")
        if pidns == pid_namespace() and pid > 0 and not process_alive(pid):
            return PeerLostError(f"rank {self.peer} (pid {pid}) died")
        last, since = self._last_beat
        if beat != last:
            self._last_beat = (beat, now)
        elif now - since > self.peer_timeout:
            return PeerLostError(f"rank {self.peer} did not show a sign of life for {self.peer_timeout:.3g} s")
        return None

    def fail(self, exc: BaseException) -> None:
        """Fail the pair: release every stream waiting on a pending message, fail them all; later calls raise."""
        with self._lock:
            if self.error is not None:
                return
            self.error = exc
        with self._pending_lock:
            ops, self._pending = self._pending, []
        r = self.region
        with r.mutex:
            for op in ops:
                if op._done:
                    continue
                seq, state, _err = r.head(op.entry)
                if seq == op.seq & 0xFFFFFFFF and not state & FAILED:
                    r.set_head(op.entry, op.seq, state | FAILED, ERR_LOST)
                self._release(op.entry, op.seq)
            for entry in self._graph_entries:  # a replay waiting on the lost peer goes on
                for which in (SRC_READY, DST_READY, LANDED):
                    r.set(entry, which, 1)
        for release in self._releasers:
            release()
        for op in ops:
            op.fail(exc)
