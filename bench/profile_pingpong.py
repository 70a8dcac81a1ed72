"""cProfile of one rank's side of a 4 KiB ``dist.send/recv`` ping-pong over ``backend="tensorwire"`` (host tensors).

``torchrun --standalone --nproc-per-node 2 bench/profile_pingpong.py [--bytes N] [--iters N]``: rank 0 prints its
round trip (median, no profiler) and the functions taking the most time of its own under cProfile.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bytes", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    import torch
    import torch.distributed as dist

    import tensorwire.distributed  # noqa: F401 - registers the backend

    dist.init_process_group("tensorwire")
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
    pr = cProfile.Profile()
    pr.enable()
    prof = statistics.median(rounds(args.iters))
    pr.disable()
    dist.barrier()
    if rank == 0:
        print(f"round trip {args.bytes} B: {plain * 1e6:.1f} us (under cProfile {prof * 1e6:.1f} us)")
        pstats.Stats(pr).sort_stats("tottime").print_stats(args.top)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
