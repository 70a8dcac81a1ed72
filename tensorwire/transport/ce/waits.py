"""Host waits of a copy-engine pair for the peer's side of a message (:class:`HostWaits`, a part of
:class:`~.pair.CePair`).

Both are bounded and rare: a large send that came before its receiver waits for it so that its own GPU pushes
the bytes (``TENSORWIRE_CE_PUSH_WAIT_US``); between two processes of one GPU, a large copy whose peer's stream
has not reached its call waits for the peer's flag on the host rather than on the GPU. Each look is a read of
the pair's shared region (no lock, no CUDA call); :meth:`~.pair.CePair._arrive` decides under the lock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .graphs import Capture
from .region import RECEIVED, Spin, reached

if TYPE_CHECKING:  # pragma: no cover
    from .pair import Channel

__all__ = ["HostWaits"]


class HostWaits(Capture):
    """The host-wait part of :class:`~.pair.CePair` (see the module docstring); after :class:`~.graphs.Capture`."""

    push_wait_s: float
    counts: list[int]

    def _await_flag(self, entry: int, which: int, seq: int, budget_s: float) -> bool:
        """Whether flag ``which`` of ``entry`` reached ``seq`` within ``budget_s`` (a host wait, GIL kept)."""
        r = self.region
        spin = Spin(int(budget_s * 1e9))
        while not reached(r.flag(entry, which), seq):
            if spin.over() or self.error is not None:
                return False
        return True

    def _await_receiver(self, chan: "Channel", seq: int) -> None:
        """Wait (host, at most ``push_wait_s``) until the receiver has come to message ``seq`` of ``chan``.

        A look at the entry's head in shared memory per turn, no lock. Stops at once when the peer is (or was,
        during this wait) in such a wait itself: both ranks sending before they receive (an exchange: ``isend``
        then ``irecv`` on each side) would otherwise hold each other for the whole wait, since neither comes to
        its receive before its send returns. Both stop; each receiver then pulls, so each GPU still makes one
        copy.
        """
        r = self.region
        entry = r.entry(chan.offset, seq)
        s32 = seq & 0xFFFFFFFF
        spin = Spin(int(self.push_wait_s * 1e9))
        r.push_waiting(True)
        try:
            waiting, gave_up = r.peer_push()
            if waiting:
                r.push_gave_up()
                self.counts[5] += 1
                return
            while True:
                eseq, state, _err = r.head(entry)
                if eseq == s32 and state & RECEIVED:
                    self.counts[3] += 1
                    return
                waiting, now = r.peer_push()
                if waiting or now != gave_up:
                    r.push_gave_up()
                    self.counts[5] += 1
                    return
                if spin.over() or self.error is not None:
                    self.counts[4] += 1
                    return
        finally:
            r.push_waiting(False)
