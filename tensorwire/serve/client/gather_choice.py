"""Which gather a lease read runs, measured rather than guessed from the machine's load.

A read from a lease gathers rows out of the daemon's mapped slot in the client,
either with torch's ``index_select`` (the kernel and the intra-op threads of a
local gather) or with numpy's ``take`` in the calling thread. On a quiet machine
torch's team wins (4,096 rows of 512 bytes on the 2-core VM: 216 against 365 us);
on cores busy with other work an OpenMP team spins at its barriers and loses by
far (the same rows at a load average of 15-23: 21.6 ms against 1.06 ms). The
choice used to follow ``/proc/loadavg``'s count of runnable tasks -- a snapshot
that also counted the client's own team and processes that would yield their
core at once, and sent the reads of a loaded benchmark to numpy while a local
``index_select`` beside them ran torch's gather faster (``serve_cpu2``: 0.50x and
0.71x a local gather in two runs).

:class:`GatherChoice` times the gathers instead: the one in use at every call,
the other in a try of three calls once per interval (0.5 s at first, doubled each
time it loses, at most 8 s, back to 0.5 s after a change), and takes whichever
moved a byte faster in its latest times (the median of a try's calls, or of the
last five calls of the one in use: a call slowed by something else, a page
fault storm or a preemption, decides nothing). A loaded machine thus costs one
try of torch's gather per interval at most; gathers of less than
:data:`GatherChoice.MIN_BYTES` are torch's and not timed (its kernel runs them in
the calling thread).
"""

from __future__ import annotations

import collections
import time
from typing import Callable

__all__ = ["GatherChoice"]


class GatherChoice:
    """The measured choice between torch's and numpy's gather (see the module docstring).

    ``clock``: seconds, monotonic (tests pass their own).
    """

    #: Gathers of fewer bytes go to torch, untimed.
    MIN_BYTES = 64 << 10
    #: Seconds between two tries of the gather not in use: at first, and at most.
    EXPLORE_FIRST = 0.5
    EXPLORE_MAX = 8.0
    #: Calls a try makes (its cost: their median, so one call slowed by something else decides nothing), and
    #: calls the gather in use makes before its own cost counts.
    TRY_CALLS = 3
    #: The gather in use costs the median of its last this many calls.
    RECENT = 5

    __slots__ = ("cost", "torch", "_clock", "_every", "_next", "_trying", "_tries", "_recent")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        #: Seconds per byte, ``[numpy, torch]``; 0.0: not timed yet.
        self.cost = [0.0, 0.0]
        #: The gather in use: torch's (True) or numpy's.
        self.torch = True
        self._clock = clock
        self._every = self.EXPLORE_FIRST
        self._next = 0.0  # the first timed gathers try numpy, the next ones are torch's: both timed at once
        self._trying: bool | None = None  # the gather being tried now, if any
        self._tries: list[float] = []  # the times of this try so far
        self._recent: collections.deque[float] = collections.deque(maxlen=self.RECENT)  # of the one in use

    def pick(self, nbytes: int) -> bool:
        """Whether a gather of ``nbytes`` is torch's (else numpy's); time it and tell :meth:`took`."""
        if nbytes < self.MIN_BYTES:
            return True
        if self._trying is not None:
            return self._trying
        now = self._clock()
        if now >= self._next:
            self._next = now + self._every
            self._trying = not self.torch
            self._tries = []
            return self._trying
        return self.torch

    def took(self, torch: bool, nbytes: int, seconds: float) -> None:
        """A gather of ``nbytes`` by torch (``torch``) or numpy took ``seconds``."""
        if nbytes < self.MIN_BYTES:
            return
        i, per = int(torch), seconds / nbytes
        if self._trying is not None and self._trying == torch:
            self._tries.append(per)
            if len(self._tries) < self.TRY_CALLS:
                return
            self.cost[i] = sorted(self._tries)[len(self._tries) // 2]  # a try stands for now
            self._trying = None
            other = self.cost[1 - i]
            if other > 0.0 and self.cost[i] >= other:  # lost: the next try comes later
                self._every = min(self.EXPLORE_MAX, 2 * self._every)
                self._next = self._clock() + self._every
        elif torch == self.torch:
            recent = self._recent
            recent.append(per)
            if len(recent) < self.TRY_CALLS:
                return
            self.cost[i] = sorted(recent)[len(recent) // 2]
        else:
            return  # (neither the one in use nor a try: the caller did not follow pick)
        if self.cost[0] > 0.0 and self.cost[1] > 0.0:
            best = self.cost[1] <= self.cost[0]
            if best != self.torch:  # a change (a try won, or the one in use slowed): look back soon
                self.torch = best
                self._recent.clear()
                self._every = self.EXPLORE_FIRST
                self._next = min(self._next, self._clock() + self._every)
