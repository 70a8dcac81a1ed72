#!/usr/bin/env python
"""Which GPU's copy engines move the bytes, and what a CUDA graph's launch costs per node: bare mechanisms.

::

    python bench/ce_engines_gpu.py            (one process, two GPUs joined by NVLink or PCIe with peer access)
    torchrun --standalone --nproc-per-node 2 bench/ce_engines_gpu.py      (two processes: 1. through CUDA IPC)

1. Both directions at once between GPU 0 and GPU 1, ``--mib`` MiB per copy, ``--copies`` copies per direction,
   ``cuMemcpyAsync`` on streams of the driver: (a) each GPU pushes its own bytes (two GPUs' copy engines),
   (b) GPU 1 makes both copies -- a pull and a push -- on two streams (one GPU's copy engines), (c) as (b) with
   each copy split over two streams per direction. Reported: GB/s per direction.
   Under torchrun, two processes, one GPU each, each side's buffers opened by the other through CUDA IPC in its
   own context (as the copy-engine path does): (a) and (b), and (b) with a flag wait before each copy.
2. Host time of ``cuGraphLaunch`` for graphs of N stream-memory-operation nodes (flag waits and writes, as the
   copy-engine path records) against graphs of N tiny copies.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import time
from typing import Any

import torch

from tensorwire.transport.ce import CeDriver
from tensorwire.transport.ce.driver import _fn, _lib


@functools.cache
def _stream_synchronize() -> Any:
    """``cuStreamSynchronize``, declared with the driver module's helpers."""
    return _fn(_lib(), ("cuStreamSynchronize",), [ctypes.c_void_p])


def _sync(stream: int) -> int:
    return int(_stream_synchronize()(stream))


def both_ways(d: CeDriver, mib: int, copies: int) -> None:
    n = mib << 20
    bufs = {dev: [torch.empty(n, dtype=torch.uint8, device=f"cuda:{dev}") for _ in range(2)] for dev in (0, 1)}
    for dev in (0, 1):  # peer access both ways (torch enables it on a first copy between the devices)
        bufs[dev][0][:16].copy_(bufs[1 - dev][1][:16])
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    streams = {}
    for dev in (0, 1):
        d.context(dev)
        streams[dev] = [d.new_stream() for _ in range(4)]

    def run(plan: list[tuple[int, int, int, int, int]]) -> float:
        # plan: (device whose stream copies, stream index, dst, src, nbytes)
        for dev in (0, 1):
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(copies):
            for dev, si, dst, src, nb in plan:
                d.context(dev)
                d.copy(streams[dev][si], dst, src, nb)
        for dev in (0, 1):
            d.context(dev)
            for s in streams[dev]:
                d._check(_sync(s), "cuStreamSynchronize")
        return time.perf_counter() - t0

    a0, b0 = (t.data_ptr() for t in bufs[0])
    a1, b1 = (t.data_ptr() for t in bufs[1])
    h = n // 2
    plans = {
        "each GPU pushes its own (two GPUs' engines)": [(0, 0, b1, a0, n), (1, 0, b0, a1, n)],
        "GPU 1 pulls and pushes, two streams (one GPU's engines)": [(1, 0, b1, a0, n), (1, 1, b0, a1, n)],
        "GPU 1 pulls and pushes, four streams": [
            (1, 0, b1, a0, h),
            (1, 2, b1 + h, a0 + h, h),
            (1, 1, b0, a1, h),
            (1, 3, b0 + h, a1 + h, h),
        ],
        "GPU 0 pushes, GPU 0 pulls (the other one's engines)": [(0, 0, b1, a0, n), (0, 1, b0, a1, n)],
    }
    run(plans["each GPU pushes its own (two GPUs' engines)"])
    for turn in range(2):
        for name, plan in plans.items():
            dt = run(plan)
            print(f"turn {turn}: {name:<58s} {copies * n / dt / 1e9:7.1f} GB/s per direction")


def both_ways_ipc(d: CeDriver, mib: int, copies: int) -> None:
    """(a) and (b) of the module docstring between two processes (ranks 0 and 1 of a torchrun job)."""
    import mmap

    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("gloo")
    peer, n = 1 - rank, mib << 20
    out = torch.full((n // 4,), float(rank + 1), device=f"cuda:{rank}")
    inn = torch.zeros(n // 4, device=f"cuda:{rank}")
    d.context(rank)

    def export(t: torch.Tensor) -> tuple[bytes, int]:
        base, _size, _id = d.allocation(t.data_ptr())
        return d.export(base), t.data_ptr() - base

    handles: list = [None, None]
    dist.all_gather_object(handles, [export(out), export(inn)])
    (h_out, o_out), (h_in, o_in) = handles[peer]
    p_out, p_in = d.open(h_out) + o_out, d.open(h_in) + o_in
    s1, s2 = d.new_stream(), d.new_stream()
    host = mmap.mmap(-1, 4096)
    haddr = ctypes.addressof(ctypes.c_char.from_buffer(host))
    flag = d.register_host(haddr, 4096)  # (a flag already at 0: each wait goes on at once)

    def run(mode: str) -> float:
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(copies):
            if mode == "each pushes its own":
                d.copy(s1, p_in, out.data_ptr(), n)
            elif rank == 1:
                if mode.endswith("flag wait first"):
                    d.wait(s1, flag, 0)
                    d.wait(s2, flag, 0)
                d.copy(s1, inn.data_ptr(), p_out, n)  # pull
                d.copy(s2, p_in, out.data_ptr(), n)  # push
        for s in (s1, s2):
            d._check(_sync(s), "cuStreamSynchronize")
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        return copies * n / dt.item() / 1e9

    modes = ("each pushes its own", "rank 1 pulls and pushes", "rank 1 pulls and pushes, flag wait first")
    run(modes[0])
    for turn in range(2):
        for mode in modes:
            gbps = run(mode)
            if rank == 0:
                print(f"turn {turn}, two processes: {mode:<44s} {gbps:7.1f} GB/s per direction", flush=True)
    torch.cuda.synchronize()
    dist.barrier()
    d.unregister_host(haddr)
    dist.destroy_process_group()


def graph_launch(d: CeDriver, nodes: int) -> None:
    d.context(0)
    s = torch.cuda.Stream(0)
    flags = torch.zeros(4096, dtype=torch.int32, device="cuda:0")
    x = torch.zeros(1024, device="cuda:0")
    for kind in ("memops", "copies"):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            # (torch's capture: the driver calls below are recorded into g)
            with torch.cuda.graph(g, stream=s):
                raw = s.cuda_stream
                for i in range(nodes):
                    if kind == "memops":
                        d.write(raw, flags.data_ptr() + 4 * (i % 4096), 0)
                    else:
                        d.copy(raw, x.data_ptr() + 4 * (i % 512), x.data_ptr() + 2048, 4)
        g.replay()
        torch.cuda.synchronize(0)
        times = []
        for _ in range(30):
            t0 = time.perf_counter()
            g.replay()
            times.append(time.perf_counter() - t0)
            torch.cuda.synchronize(0)
        times.sort()
        print(f"graph of {nodes:4d} {kind:<7s} nodes: replay() host {times[len(times) // 2] * 1e6:8.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--copies", type=int, default=40)
    args = ap.parse_args()
    d = CeDriver.get()
    if "RANK" in os.environ:
        both_ways_ipc(d, args.mib, args.copies)
        return
    if torch.cuda.device_count() >= 2:
        both_ways(d, args.mib, args.copies)
    for nodes in (16, 128, 512):
        graph_launch(d, nodes)


if __name__ == "__main__":
    main()
