"""cProfile of one rank's side of a 4 KiB ``dist.send/recv`` ping-pong over ``backend="tensorwire"`` (host tensors).

``torchrun --standalone --nproc-per-node 2 bench/profile_pingpong.py [--bytes N] [--iters N]``: rank 0 prints its
round trip (median, no profiler) and the functions taking the most time of its own under cProfile.

``--plain`` leaves the profiler out (only the timed round trips), and ``--backend`` runs the same ping-pong over
gloo or the Python floor (``bench/floor_pg.py``): under ``perf stat``, two runs of one backend with different
``--iters`` give its counters per round trip by difference (start-up and imports cancel out).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

if not os.environ.get("PYTHONPATH"):  # (a tree put first on PYTHONPATH, e.g. a compiled build, is the one run)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))  # floor_pg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--cpu", action="store_true", help="profile by the thread's CPU clock (waits left out)")
    ap.add_argument("--plain", action="store_true", help="no profiler: only the timed round trips")
    ap.add_argument("--backend", default="tensorwire", choices=("tensorwire", "gloo", "python-floor"))
    args = ap.parse_args()
    import torch
    import torch.distributed as dist

    import tensorwire.distributed  # noqa: F401 - registers the backend
    import floor_pg

    floor_pg.register()
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    t = torch.zeros(args.bytes // 4)

    def rounds(n: int) -> list[float]:
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)
            ts.append(time.perf_counter() - t0)
        return ts

    rounds(500)
    plain = statistics.median(rounds(args.iters))
    if args.plain:  # (no barrier: the floor's group has none; both ranks ran the same round trips)
        if rank == 0:
            print(f"{args.backend} round trip {args.bytes} B: {plain * 1e6:.1f} us (median of {args.iters})")
        dist.destroy_process_group()
        return
    pr = cProfile.Profile(time.thread_time) if args.cpu else cProfile.Profile()
    pr.enable()
    prof = statistics.median(rounds(args.iters))
    pr.disable()
    dist.barrier()
    if rank == 0:
        print(f"round trip {args.bytes} B: {plain * 1e6:.1f} us (under cProfile {prof * 1e6:.1f} us)")
        st = pstats.Stats(pr)
        spin = ("poll", "sched_yield", "perf_counter", "_recv")
        total = sum(v[2] for v in st.stats.values())  # type: ignore[attr-defined]
        waiting = sum(v[2] for k, v in st.stats.items() if k[2].endswith(spin) or any(w in k[2] for w in spin))  # type: ignore[attr-defined]
        clock = "CPU" if args.cpu else "wall"
        print(
            f"{clock} time per round trip under the profiler: {total / args.iters * 1e6:.1f} us, of it the receive's "
            f"polling {waiting / args.iters * 1e6:.1f} us, the rest {(total - waiting) / args.iters * 1e6:.1f} us"
        )
        st.sort_stats("tottime").print_stats(args.top)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
