"""Whether the calling thread has lately waited for a CPU: when it has, a wait should sleep, not poll.

A reader that polls its socket before it sleeps sees a fast peer's answer without a wake-up, which is what makes
a small round trip beat a plain blocking socket on an idle machine. On a machine whose CPUs are all taken -- a
build or another job beside a two-process exchange on two cores -- the poll takes the CPU the peer needs to
answer, and a task that keeps polling loses the scheduler's preference for tasks that wake from sleep: measured
on a 2-core VM with a compile running beside the demo, a 4 KiB round trip took 6.4x a blocking socket's time,
433 us of CPU against 69.

The signal is the thread's own run delay -- the time it spent runnable but not running, from
``/proc/thread-self/schedstat`` (Linux, ``CONFIG_SCHEDSTATS``/``schedstat`` on by default) -- read at most every
:data:`CHECK_EVERY` seconds: a thread that waited for a CPU more than :data:`BUSY_SHARE` of the time since the
last look is on contended CPUs, and polls nowhere until a later look finds them free again. Where the file cannot
be read, or with ``TENSORWIRE_SPIN_CONTENDED=1``, the answer is always "not contended" (polling as configured).
"""

from __future__ import annotations

import logging
import os
import threading
import time

from tensorwire.errors import ConfigError
from tensorwire.settings import setting

__all__ = ["contended", "CHECK_EVERY", "BUSY_SHARE"]

#: Seconds between two looks at the thread's run delay (a look is one small read of a /proc file, a few us).
CHECK_EVERY = 0.02
#: The share of wall time spent waiting for a CPU above which this thread's CPUs count as contended.
BUSY_SHARE = 0.1

log = logging.getLogger(__name__)

_PATH = "/proc/thread-self/schedstat"
_state = threading.local()


def _wanted() -> bool:
    """Whether to stand down on contended CPUs: not with ``TENSORWIRE_SPIN_CONTENDED=1``. Read once, at import (a
    wait must not raise over a setting): a bad value is logged, naming it, and the default kept."""
    try:
        return not setting("spin_contended")
    except ConfigError as exc:
        log.warning("%s; polling waits stand down on busy CPUs, as by default", exc)
        return True


_usable: list[bool] = [os.path.exists(_PATH) and _wanted()]


def _run_delay_s() -> float:
    """The calling thread's run delay so far in seconds; -1.0 where it cannot be read."""
    try:
        fd = os.open(_PATH, os.O_RDONLY)
        try:
            text = os.read(fd, 128)
        finally:
            os.close(fd)
        return int(text.split()[1]) * 1e-9
    except (OSError, ValueError, IndexError):
        _usable[0] = False
        return -1.0


def contended(now: float | None = None) -> bool:
    """Whether the calling thread waited for a CPU more than :data:`BUSY_SHARE` of the time between its last two
    looks (one look per :data:`CHECK_EVERY`; in between, the last answer). ``now``: ``time.perf_counter()``,
    where the caller has it."""
    if not _usable[0]:
        return False
    if now is None:
        now = time.perf_counter()
    st = _state
    last = getattr(st, "at", 0.0)
    if now - last < CHECK_EVERY:
        return bool(st.busy)
    delay = _run_delay_s()
    if delay < 0:
        return False
    busy = bool(last) and (delay - st.delay) > BUSY_SHARE * (now - last)
    st.at, st.delay, st.busy = now, delay, busy
    return busy
