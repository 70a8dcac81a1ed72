#!/usr/bin/env python
"""Where the host time of a CUDA ``isend``/``irecv`` on the copy-engine path goes (rank 0 under cProfile).

::

    torchrun --standalone --nproc-per-node 2 bench/profile_ce_host.py [--bytes 65536] [--iters 2000]

A ``dist.send``/``dist.recv`` ping-pong; rank 0 prints its host time per call without the profiler, then
the functions that took the most time under it.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

import torch
import torch.distributed as dist

import tensorwire  # noqa: F401  (registers the backend)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", type=int, default=65536)
    ap.add_argument("--iters", type=int, default=2000)
    args = ap.parse_args()
    if args.bytes < 4 or args.iters < 1:
        ap.error("--bytes >= 4 and --iters >= 1")
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    dist.init_process_group("tensorwire")
    t = torch.ones(args.bytes // 4, device=device)

    def loop(n: int) -> float:
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / (2 * n)

    loop(50)
    plain = loop(args.iters)
    prof = cProfile.Profile()
    prof.enable()
    profiled = loop(args.iters)
    prof.disable()
    if rank == 0:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        print(f"one-way {plain * 1e6:.1f} us per message ({profiled * 1e6:.1f} us under the profiler)")
        print(out.getvalue())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
