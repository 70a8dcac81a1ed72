"""What tensorwire closes when the interpreter exits, in which order, and how its threads end.

Why: CPython finalizes with daemon threads still running. A daemon thread that
asks for the GIL back once finalization has begun is ended on the spot by
``pthread_exit``, whose forced unwind goes through the C++ frames on that
thread's stack; a frame that may not throw -- torch freeing a tensor with the
GIL released, a pybind11 ``gil_scoped_release`` -- turns it into
``std::terminate``: "terminate called without an active exception", SIGABRT,
exit status 134, after a script that did everything right. So a thread of
tensorwire's must have ended before the interpreter finalizes:

- every ``close()`` that ends a thread joins it (:func:`join`);
- every object a user opens and may forget to close -- a client, a node, a
  link, a process group -- and the UCX engines register here (:func:`track`,
  held until closed);
  at exit the ones still open are closed, users first, then the transports
  they hold, then the engines (their progress thread joined, their UCX worker
  and context released), from an ``atexit`` handler: it runs after the
  script's last line (or ``sys.exit``, an escaping exception, a SIGTERM
  handled by Python) and before the interpreter tears modules down, while
  every thread can still run.

This module imports nothing else of tensorwire (a leaf).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Any

__all__ = ["ENGINES", "TRANSPORTS", "USERS", "close_all", "exiting", "join", "track", "tracked", "untrack"]

log = logging.getLogger(__name__)

#: Stages, closed in this order at exit: what a user opens (clients, nodes, links, process groups), the
#: transports and listeners they hold, the UCX engines.
USERS, TRANSPORTS, ENGINES = 0, 1, 2
_STAGES = (USERS, TRANSPORTS, ENGINES)

#: Seconds one close may take at exit (its own timeouts bound it; this bounds the join of its threads).
JOIN_TIMEOUT = 5.0

_lock = threading.Lock()
#: stage -> {id(obj): (obj, name of the method that closes it)}, in the order opened. Held strongly: an
#: object dropped without a close still has threads and sockets (held by its threads, not by it), and
#: only it knows how to end them.
_open: dict[int, dict[int, tuple[Any, str]]] = {s: {} for s in _STAGES}
_registered_pid = -1
_exiting = False


def track(obj: Any, stage: int = USERS, *, close: str = "close") -> None:
    """Call ``obj.<close>()`` at interpreter exit unless :func:`untrack` was called first.

    ``obj`` stays referenced until then: whatever opens it calls :func:`untrack` when it is closed. The
    exit handler is registered on the first call in a process, so it runs before the handlers of the
    libraries imported before (atexit runs the last registered first).

    Raises:
        ValueError: an unknown stage, or ``obj`` has no such method.
    """
    global _registered_pid
    if stage not in _STAGES:
        raise ValueError(f"unknown stage {stage!r}")
    if not callable(getattr(obj, close, None)):
        raise ValueError(f"{type(obj).__name__} has no method {close!r}")
    with _lock:
        _open[stage][id(obj)] = (obj, close)
        if _registered_pid != os.getpid():  # (a forked child inherits the parent's handler list)
            _registered_pid = os.getpid()
            atexit.register(close_all)


def untrack(obj: Any) -> None:
    """``obj`` was closed: nothing to do for it at exit (and it is no longer referenced here)."""
    key = id(obj)
    with _lock:
        for objs in _open.values():
            entry = objs.get(key)
            if entry is not None and entry[0] is obj:
                del objs[key]


def tracked(stage: int = USERS) -> list[Any]:
    """The objects of ``stage`` still open (what the exit handler would close now, in the order opened)."""
    with _lock:
        return [obj for obj, _ in _open[stage].values()]


def exiting() -> bool:
    """Whether the exit handler is running (or has run)."""
    return _exiting


def join(thread: "threading.Thread | None", timeout: float = JOIN_TIMEOUT) -> bool:
    """Join ``thread`` unless it is the calling thread or was never started; True if it has ended.

    A thread still alive after ``timeout`` is logged: it may take the process down at exit (see the
    module docstring).
    """
    if thread is None or thread is threading.current_thread() or thread.ident is None:
        return thread is None or thread.ident is None
    thread.join(timeout)
    if thread.is_alive():
        log.warning("thread %s did not end within %.1fs of its close", thread.name, timeout)
        return False
    return True


def close_all() -> None:
    """Close everything still open, stage by stage (the exit handler; also callable directly)."""
    global _exiting
    _exiting = True
    for stage in _STAGES:
        with _lock:
            entries = list(_open[stage].values())
            _open[stage].clear()
        for obj, close in reversed(entries):  # the last opened first (a link before the node that made it)
            try:
                getattr(obj, close)()
            except Exception as exc:  # noqa: BLE001 - at exit, everything else still gets closed
                log.debug("closing %r at exit: %s", obj, exc)
        del entries
