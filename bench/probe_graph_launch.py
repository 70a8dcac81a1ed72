"""Host time of a CUDA graph's replay by the kind and number of its nodes (a probe, one GPU).

A captured step of ``backend="tensorwire"`` holds, per message, a copy and stream memory operations (flag
writes, flag waits with their resets) beside the step's kernels. This probe captures graphs of N nodes of
one kind each -- a small kernel, a flag write, a flag wait, a wait-and-reset batch, a 4-byte and a 1 MiB
device copy -- and times ``replay()`` on the host (the GPU synchronized between replays, not timed), so the
cost of each kind of node to a replay's launch can be read off. ``python bench/probe_graph_launch.py``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    import torch

    from tensorwire.transport.ce.driver import CeDriver

    drv = CeDriver.get()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    drv.context(0)
    one = torch.zeros(1, device=dev)
    flags = torch.zeros(1024, dtype=torch.int32, device=dev)
    a = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
    b = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
    fp = flags.data_ptr()
    # host words registered with CUDA (as the copy-engine path's flags are): [0] = 1, the rest written by copies
    import mmap

    import numpy as np

    mm = mmap.mmap(-1, 1 << 16)
    words = np.frombuffer(mm, dtype=np.int32)
    words[0] = 1
    host = drv.register_host(words.ctypes.data, 1 << 16)
    ones = torch.ones(1, dtype=torch.int32, device=dev)

    wait_kernel = _wait_kernel(drv)

    def kinds(s: int) -> dict[str, Callable[[int], Any]]:
        return {
            "kernel (x.add_(1))": lambda i: one.add_(1),
            "flag write": lambda i: drv.write(s, fp + 4 * (i % 1024), 1),
            "flag wait (met)": lambda i: drv.wait(s, fp + 4 * (i % 1024), 0),
            "wait + reset batch": lambda i: drv.wait_reset(s, fp + 4 * (i % 1024), 0),
            "wait kernel (met)": lambda i: wait_kernel(s, host, 1),
            "copy 4 B": lambda i: drv.copy(s, a.data_ptr(), b.data_ptr(), 4),
            "copy 4 B dev->host": lambda i: drv.copy(s, host + 4 + 4 * (i % 1024), ones.data_ptr(), 4),
            "copy 4 B host->host": lambda i: drv.copy(s, host + 8192 + 4 * (i % 1024), host, 4),
            "copy 1 MiB": lambda i: drv.copy(s, a.data_ptr(), b.data_ptr(), 1 << 20),
        }

    print(f"{'node kind':22s} " + " ".join(f"{f'N={n}':>10s}" for n in (1, 4, 32, 128)) + "   us per node (32->128)")
    for kind in kinds(0):
        row = []
        for n in (1, 4, 32, 128):
            g = torch.cuda.CUDAGraph()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):  # warm-up outside the graph
                    kinds(side.cuda_stream)[kind](0)
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                s = torch.cuda.current_stream().cuda_stream
                fn = kinds(s)[kind]
                for i in range(n):
                    fn(i)
            torch.cuda.synchronize()
            ts = []
            for _ in range(300):
                t0 = time.perf_counter()
                g.replay()
                ts.append(time.perf_counter() - t0)
                torch.cuda.synchronize()
            row.append(statistics.median(ts[50:]) * 1e6)
            del g
        per = (row[3] - row[2]) / 96
        print(f"{kind:22s} " + " ".join(f"{v:10.1f}" for v in row) + f"   {per:.2f}")
    got = (int(words[1:129].min()), int(words[2048 : 2048 + 128].min()))
    print(f"host words written by the captured 4-byte copies (all 1?): dev->host {got[0]}, host->host {got[1]}")


_PTX = b"""
.version 7.0
.target sm_70
.address_size 64
.visible .entry tw_wait(.param .u64 addr, .param .u32 value)
{
    .reg .pred p;
    .reg .b32 v, want, d;
    .reg .b64 a;
    ld.param.u64 a, [addr];
    ld.param.u32 want, [value];
WAIT:
    ld.volatile.u32 v, [a];
    sub.s32 d, v, want;
    setp.lt.s32 p, d, 0;
    @!p bra DONE;
    nanosleep.u32 200;
    bra WAIT;
DONE:
    fence.acq_rel.sys;
    ret;
}
"""


def _wait_kernel(drv: Any) -> Callable[[int, int, int], None]:
    """A one-thread kernel that waits until the 32-bit word at an address reaches a value (cyclic >=)."""
    import ctypes

    lib = ctypes.CDLL("libcuda.so.1")
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    assert lib.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(_PTX)) == 0, "cuModuleLoadData"
    assert lib.cuModuleGetFunction(ctypes.byref(fn), mod, b"tw_wait") == 0, "cuModuleGetFunction"
    launch = lib.cuLaunchKernel
    launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3

    def run(stream: int, addr: int, value: int) -> None:
        a, v = ctypes.c_uint64(addr), ctypes.c_uint32(value)
        params = (ctypes.c_void_p * 2)(ctypes.addressof(a), ctypes.addressof(v))
        assert launch(fn, 1, 1, 1, 1, 1, 1, 0, stream, params, None) == 0, "cuLaunchKernel"

    return run


if __name__ == "__main__":
    main()
