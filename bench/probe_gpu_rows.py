"""Where a lease get_rows into a CUDA tensor spends its time, against the UVA floor (a probe, one GPU).

Every variant is timed in turns with the floor (20 calls of each at a time), each call ending when the
GPU has the rows. ``python bench/probe_gpu_rows.py``.
"""

from __future__ import annotations

import mmap
import os
import statistics
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    import numpy as np
    import torch

    import tensorwire as tw
    from bench_serve import _spawn, _stop
    from tensorwire.hostmap import map_host
    from tensorwire.serve.client.shm_rows import check_rows, lease_rows

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    R, D, B = 200_000, 128, 4096
    daemon, info = _spawn([sys.executable, "-m", "tensorwire", "serve", "--port", "0", "--max-bytes", "8GiB"])
    try:
        c = tw.Client(f"127.0.0.1:{info['port']}", transport="shm", timeout=120)
        table = torch.randn(R, D)
        c.put("table", table)
        gen = torch.Generator().manual_seed(0)
        idxs = [torch.randint(0, R, (B,), generator=gen) for _ in range(64)]
        out = torch.empty(B, D, device=dev)
        for _ in range(3):
            assert torch.equal(c.get_rows("table", idxs[3], out=out).cpu(), table[idxs[3]])
        path = c._current()
        mem = path.mem
        t = mem.leased["table"]
        region = t.lease[2]
        view = t.cuda[0].view
        stream = torch.cuda.current_stream(dev)
        ev = torch.cuda.Event()
        it = iter(range(10**9))

        host = table.clone()
        reg = map_host(host.data_ptr(), host.numel() * 4, 0)
        uva = reg.tensor.view(torch.float32).view(host.shape)
        idx_pinned = torch.empty(B, dtype=torch.int64).pin_memory()

        # the index through host memory the GPU reads in place (registered, mapped)
        mm = mmap.mmap(-1, 1 << 20)
        ih = np.frombuffer(mm, dtype=np.int64)
        ireg = map_host(np.frombuffer(mm, dtype=np.uint8).ctypes.data, 1 << 20, 0)
        icuda = ireg.tensor.view(torch.int64)
        ih_t = torch.from_numpy(ih)
        idev = torch.empty(1 << 17, dtype=torch.int64, device=dev)
        outw = out.view(-1).view(torch.int64).view(B, D // 2)

        def sync() -> None:
            torch.cuda.synchronize(dev)

        def floor() -> None:
            i = idxs[next(it) % 64]
            idx_pinned.copy_(i)
            torch.index_select(uva, 0, idx_pinned.to(dev, non_blocking=True), out=out)
            sync()

        def client() -> None:
            c.get_rows("table", idxs[next(it) % 64], out=out)
            sync()

        def direct() -> None:
            lease_rows(path, "table", idxs[next(it) % 64], out)
            sync()

        def leased() -> None:
            i = idxs[next(it) % 64]
            path.gpu.leased(t, region, i, out)

        def prim_pinned() -> None:  # what leased() does, inline
            i = idxs[next(it) % 64]
            check_rows(i, R)
            buf = idx_pinned
            buf[:B].copy_(i)
            torch.index_select(view, 0, buf[:B].to(dev, non_blocking=True), out=outw)
            ev.record(stream)
            ev.synchronize()

        def prim_uva_index() -> None:  # the GPU reads the index from host memory
            i = idxs[next(it) % 64]
            check_rows(i, R)
            ih_t[:B].copy_(i)
            torch.index_select(view, 0, icuda[:B], out=outw)
            ev.record(stream)
            ev.synchronize()

        def prim_np_uva_index() -> None:  # the same, the copy by numpy
            i = idxs[next(it) % 64].numpy()
            if int(i.view(np.uint64).max()) >= R:
                raise IndexError
            ih[:B] = i
            torch.index_select(view, 0, icuda[:B], out=outw)
            ev.record(stream)
            ev.synchronize()

        def prim_dev_index() -> None:  # one pageable host-to-device copy into a kept device buffer
            i = idxs[next(it) % 64]
            check_rows(i, R)
            d = idev[:B]
            d.copy_(i, non_blocking=True)
            torch.index_select(view, 0, d, out=outw)
            ev.record(stream)
            ev.synchronize()

        def prim_nocheck() -> None:  # prim_pinned without the index check (what the check costs)
            i = idxs[next(it) % 64]
            buf = idx_pinned
            buf[:B].copy_(i)
            torch.index_select(view, 0, buf[:B].to(dev, non_blocking=True), out=outw)
            ev.record(stream)
            ev.synchronize()

        def kernel_only() -> None:  # the gather alone, the index already on the GPU
            torch.index_select(view, 0, idev[:B], out=outw)
            ev.record(stream)
            ev.synchronize()

        typed = view.view(-1).view(torch.float32).view(R, D)

        def kernel_typed() -> None:  # the same over the table's own dtype (4-byte elements, no word view)
            torch.index_select(typed, 0, idev[:B], out=out)
            ev.record(stream)
            ev.synchronize()

        fns: dict[str, Callable[[], Any]] = {
            "floor (UVA, index via pinned .to)": floor,
            "client.get_rows": client,
            "lease_rows": direct,
            "GpuGather.leased": leased,
            "inline: pinned copy + .to (today)": prim_pinned,
            "inline: today without the check": prim_nocheck,
            "inline: index read by the GPU from host (torch copy)": prim_uva_index,
            "inline: index read by the GPU from host (numpy)": prim_np_uva_index,
            "inline: pageable copy into a kept device index": prim_dev_index,
            "kernel alone, index on the GPU": kernel_only,
            "kernel alone, float32 elements": kernel_typed,
        }
        idev[:B].copy_(idxs[0])
        for fn in fns.values():
            for _ in range(20):
                fn()
        ts: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(30):
            for k, fn in fns.items():
                for _ in range(20):
                    t0 = time.perf_counter()
                    fn()
                    ts[k].append(time.perf_counter() - t0)
        f = statistics.median(ts["floor (UVA, index via pinned .to)"])
        print(f"get_rows -> GPU, {B} x {D} float32 of {R:,} rows; median of {len(ts['client.get_rows'])} calls, in turns")
        print(f"{'variant':56s} {'median µs':>10s} {'p10 µs':>8s} {'floor/this':>10s}")
        for k, v in ts.items():
            v.sort()
            m = statistics.median(v)
            print(f"{k:56s} {m * 1e6:10.1f} {v[len(v) // 10] * 1e6:8.1f} {f / m:10.2f}")
        i = idxs[5]
        ih_t[:B].copy_(i)
        torch.index_select(view, 0, icuda[:B], out=outw)
        sync()
        assert torch.equal(out.cpu(), table[i])
        print("host-read index: rows bit-exact")
        if "--profile" in sys.argv:
            import cProfile
            import pstats

            pr = cProfile.Profile()
            pr.enable()
            for _ in range(3000):
                client()
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(35)
        c.close()
    finally:
        _stop(daemon)


if __name__ == "__main__":
    main()
