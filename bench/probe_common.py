"""What the two-process probes of ``bench/`` share: two spawned ranks with one result each, sizes from the command line.

:func:`run_pair`: each rank runs ``fn(rank, *args)`` in a process of its own (spawned: nothing of the parent's state comes along);
its return value, or the error it raised, comes back over a queue. :func:`run_pair` returns ``{rank: value}``
once both are in, and ends the program (``SystemExit`` naming the reason) if a rank raised, died, or the pair
ran past ``limit_s``; the processes are joined, and killed if they linger, either way.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import time
from typing import Any, Callable


def _child(fn: Callable[..., Any], rank: int, q: Any, args: tuple[Any, ...]) -> None:
    try:
        value = fn(rank, *args)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which ends the run with it
        q.put((rank, False, f"{type(exc).__name__}: {exc}"))
    else:
        q.put((rank, True, value))


def run_pair(fn: Callable[..., Any], *args: Any, limit_s: float = 1800.0, what: str = "the probe") -> dict[int, Any]:
    """Run ``fn(0, *args)`` and ``fn(1, *args)`` in two spawned processes; ``{rank: what fn returned}``.

    ``fn`` must be a module-level function (it is pickled by name); ``args`` may hold queues of
    ``multiprocessing.get_context("spawn")``.
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(fn, r, q, args), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + limit_s
        while len(got) < 2:
            try:
                rank, ok, value = q.get(timeout=1.0)
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise SystemExit(f"{what}: a worker died (exit codes {dead})") from None
                if time.monotonic() > deadline:
                    raise SystemExit(f"{what} ran past {limit_s:.0f} s") from None
                continue
            if not ok:
                raise SystemExit(f"{what}: rank {rank} failed: {value}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    return got


def size_list(ap: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    """The sizes of a comma-separated option (``4K,1M``); a bad one ends the program naming it, before any rank starts."""
    from tensorwire.settings import parse_size

    out = []
    for item in text.split(","):
        try:
            out.append(parse_size(item))
        except ValueError as exc:
            ap.error(f"{flag}: {item!r} {exc}")
        if out[-1] <= 0:
            ap.error(f"{flag}: {item!r} must be more than 0 bytes")
    return out
