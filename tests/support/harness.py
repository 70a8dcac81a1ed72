"""Run real multi-process tensorwire jobs from tests: spawn context, port 0, bounded, no leaks.

The test process hosts the bootstrap TCPStore on port 0 and passes the real
port to the workers. Each worker's return value (or its exception, as type
name + message + traceback text) comes back on a queue; a worker that does
not finish in time is killed and the test fails with what is known.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import traceback
from datetime import timedelta
from typing import Any, Callable

CTX = mp.get_context("spawn")


def gpu_count() -> int:
    """CUDA devices this process sees (0 without torch's CUDA, or where asking fails): for skip conditions."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken CUDA install is "no GPU" for a skip condition
        return 0


class WorkerError(AssertionError):
    def __init__(self, rank: int, etype: str, message: str, tb: str) -> None:
        super().__init__(f"rank {rank} raised {etype}: {message}\n{tb}")
        self.rank, self.etype, self.message = rank, etype, message


def make_store():
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=60), wait_for_workers=False)


def _entry(target: Callable[..., Any], rank: int, world: int, port: int, q: Any, kwargs: dict) -> None:
    os.environ.setdefault("TENSORWIRE_LOG_LEVEL", "WARNING")
    try:
        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=60))
        result = target(rank=rank, world=world, store=store, **kwargs)
        q.put((rank, "ok", result, ""))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        q.put((rank, type(exc).__name__, str(exc), traceback.format_exc()))


def run_ranks(
    target: Callable[..., Any],
    world: int = 2,
    *,
    timeout: float = 120,
    expect_fail: bool = False,
    per_rank: dict[int, dict] | None = None,
    **kwargs: Any,
) -> dict[int, Any]:
    """Run ``target(rank=, world=, store=, **kwargs)`` in ``world`` processes; return {rank: result}.

    With ``expect_fail`` exceptions are returned as ``("error", etype, message)`` instead of raised.
    """
    store = make_store()
    q = CTX.Queue()
    procs = []
    try:
        for r in range(world):
            kw = dict(kwargs, **(per_rank or {}).get(r, {}))
            p = CTX.Process(target=_entry, args=(target, r, world, store.port, q, kw), daemon=True)
            p.start()
            procs.append(p)
        results: dict[int, Any] = {}
        import time

        deadline = time.monotonic() + timeout
        dead_since: dict[int, float] = {}
        while len(results) < world:
            try:
                rank, status, value, tb = q.get(timeout=0.5)
            except queue.Empty:
                now = time.monotonic()
                for r, p in enumerate(procs):
                    if r not in results and p.exitcode is not None:
                        # give its last queue message a moment to arrive before calling it dead
                        if now - dead_since.setdefault(r, now) > 2.0:
                            if not expect_fail:
                                raise AssertionError(f"rank {r} died with exit code {p.exitcode}") from None
                            results[r] = ("died", p.exitcode, "")
                if now > deadline:
                    raise AssertionError(
                        f"ranks {sorted(set(range(world)) - set(results))} did not finish in {timeout}s"
                    ) from None
                continue
            if status == "ok":
                results[rank] = value
            elif expect_fail:
                results[rank] = ("error", status, value)
            else:
                raise WorkerError(rank, status, value, tb)
        return results
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
                p.join(5)
