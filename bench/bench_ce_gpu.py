#!/usr/bin/env python
"""The copy-engine path on GPUs: backend "tensorwire" against its floor (and NCCL with two GPUs), in turns.

::

    torchrun --standalone --nproc-per-node 2 bench/bench_ce_gpu.py --out bench/results/ce-gpu_<machine>_<date>.md
    torchrun --standalone --nproc-per-node 2 bench/bench_ce_gpu.py --check      # correctness only (GPU tests)

Two ranks; with two or more GPUs each rank has its own, with one GPU both share it (two processes on one GPU
take the same CUDA IPC path; NCCL refuses two ranks on one GPU, so its column is then empty).

- **floor**: the mechanism without tensorwire -- each rank maps the peer's receive buffer once (CUDA IPC,
  opened in its own context) and a flag word in shared host memory; a message is one ``cuMemcpyAsync`` into
  the peer's buffer and a flag write on the sender's stream, and a ``cuStreamWaitValue32`` on the
  receiver's stream.
- **tensorwire**: ``dist.send``/``dist.recv`` on a ``backend="tensorwire"`` group (the copy-engine path).
- **nccl**: the same calls on an NCCL group (two GPUs only).

Measured: a ping-pong (one-way time = round trip / 2) at 64 KiB ... ``--max-mib``; a stream rank 0 -> 1 with
four messages in flight; the host time of one ``isend`` and of one ``irecv`` + ``wait()``. Every size runs each
path in turn, ``--reps`` times; the best of the turns is reported. ``--check`` runs the correctness checks
instead (every dtype, 0-d, empty, non-contiguous, 256 MiB, a kernel right before ``isend`` and right after
``wait()``, ``batch_isend_irecv`` with 8 in flight both ways, a shape mismatch) and prints ``CHECKS PASSED``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import tensorwire  # (also registers the backend)
from tensorwire.transport.ce import CeDriver, Region
from tensorwire.transport.ce.region import HEADER

MIB = 1 << 20
KIB = 1 << 10


def _sizes(max_mib: int) -> list[int]:
    out = [64 * KIB, MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB]
    return [s for s in out if s <= max_mib * MIB]


class Floor:
    """The bare mechanism (see the module docstring): mapped peer buffer + host flag, no tensorwire."""

    def __init__(self, rank: int, device: torch.device, nbytes: int) -> None:
        self.rank = rank
        self.drv = CeDriver.get()
        self.drv.context(device.index)
        store = dist.distributed_c10d._get_default_store()
        if rank == 0:
            self.region = Region.create()
            store.set("floor/region", self.region.path)
            store.wait(["floor/attached"])
        else:
            store.wait(["floor/region"])
            self.region = Region.attach(store.get("floor/region").decode())
            store.set("floor/attached", "1")
        self.region.device_addr = self.drv.register_host(self.region.addr, len(self.region.buf))
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
        base, _size, _id = self.drv.allocation(self.buf.data_ptr())
        handle = self.drv.export(base)
        store.set(f"floor/handle/{rank}", handle.hex() + f":{self.buf.data_ptr() - base}")
        store.wait([f"floor/handle/{1 - rank}"])
        h, off = store.get(f"floor/handle/{1 - rank}").decode().split(":")
        self.peer_buf = self.drv.open(bytes.fromhex(h)) + int(off)
        self.my_flag = self.region.device_addr + HEADER + 64 * rank
        self.peer_flag = self.region.device_addr + HEADER + 64 * (1 - rank)
        self.seq = 0

    def send(self, n: int, stream: int) -> None:
        self.seq += 1
        self.drv.copy(stream, self.peer_buf, self.src.data_ptr(), n)
        self.drv.write(stream, self.peer_flag, self.seq)

    def recv(self, stream: int) -> None:
        self.drv.wait(stream, self.my_flag, self.seq if self.rank == 0 else self.seq + 1)

    def close(self) -> None:
        self.drv.unregister_host(self.region.addr)
        self.region.close()


def _raw_stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def pingpong(path: str, rank: int, n: int, iters: int, device, group, floor: Floor | None) -> float:
    """Seconds per one-way message (rank 0's clock)."""
    t = torch.ones(n // 4, dtype=torch.float32, device=device)
    stream = _raw_stream(device)
    dist.barrier()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for i in range(iters + 2):
        if i == 2:  # two warm-up round trips (first mappings of the buffers), then the clock starts
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
        if path == "floor":
            assert floor is not None
            if rank == 0:
                floor.send(n, stream)
                floor.recv(stream)
            else:
                floor.recv(stream)
                floor.send(n, stream)
        elif rank == 0:
            dist.send(t, 1, group=group)
            dist.recv(t, 1, group=group)
        else:
            dist.recv(t, 0, group=group)
            dist.send(t, 0, group=group)
    torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / (2 * iters)


def link_pingpong(rank: int, n: int, iters: int, device, node) -> float:
    """Seconds per one-way message of a ping-pong over a tensorwire Link (a static CUDA spec each way)."""
    spec = tensorwire.TensorSpec(f"x{n}", (n // 4,), "float32", "cuda")
    peer = 1 - rank
    link = node.link(peer, send=[spec], recv=[spec], name=f"bench-{n}")
    try:
        t = torch.ones(n // 4, dtype=torch.float32, device=device)
        dist.barrier()
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for i in range(iters + 2):
            if i == 2:
                torch.cuda.synchronize(device)
                t0 = time.perf_counter()
            if rank == 0:
                link.send(spec.name, t)
                t = link.recv(spec.name)
            else:
                t = link.recv(spec.name)
                link.send(spec.name, t)
        torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) / (2 * iters)
    finally:
        link.close()


def stream4(path: str, rank: int, n: int, iters: int, device, group) -> float:
    """Seconds per message of a stream rank 0 -> 1 with 4 in flight (until rank 1 got the last one)."""
    bufs = [torch.ones(n // 4, dtype=torch.float32, device=device) for _ in range(4)]
    ack = torch.zeros(1, device=device)
    dist.barrier()
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(0, iters, 4):
        if rank == 0:
            works = [dist.isend(b, 1, group=group) for b in bufs]
        else:
            works = [dist.irecv(b, 0, group=group) for b in bufs]
        for w in works:
            w.wait()
    if rank == 0:
        dist.recv(ack, 1, group=group)
    else:
        dist.send(ack, 0, group=group)
    torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / iters


def host_times(rank: int, n: int, device, group) -> tuple[float, float]:
    """(rank 0: host us per isend, rank 1: host us per irecv + wait()) over 16 messages, median of 5 rounds."""
    t = torch.ones(n // 4, dtype=torch.float32, device=device)
    rounds = []
    for _ in range(5):
        dist.barrier()
        torch.cuda.synchronize(device)
        works = []
        t0 = time.perf_counter()
        for _ in range(16):
            if rank == 0:
                works.append(dist.isend(t, 1, group=group))
            else:
                dist.irecv(t, 0, group=group).wait()
        dt = (time.perf_counter() - t0) / 16
        for w in works:
            w.wait()
        torch.cuda.synchronize(device)
        rounds.append(dt)
    return statistics.median(rounds) * 1e6, 0.0


# -- correctness ---------------------------------------------------------------------------------------
def check(rank: int, device, group) -> list[str]:
    peer = 1 - rank
    failures: list[str] = []

    def exchange(make, name: str) -> None:
        mine = make(rank)
        theirs = torch.zeros_like(make(peer))
        if theirs.dim() and theirs.numel():
            theirs.fill_(0)
        ops = [dist.P2POp(dist.isend, mine, peer, group=group), dist.P2POp(dist.irecv, theirs, peer, group=group)]
        if rank == 1:
            ops.reverse()
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        torch.cuda.synchronize(device)
        want = make(peer)
        if not torch.equal(theirs.cpu(), want.cpu()):
            failures.append(f"{name}: bytes differ")

    g = torch.Generator(device="cpu")

    def rnd(shape, dtype, seed):
        g.manual_seed(seed)
        if dtype == torch.bool:
            return (torch.rand(shape, generator=g) > 0.5).to(device)
        if dtype.is_floating_point:
            return torch.randn(shape, generator=g).to(dtype).to(device)
        return torch.randint(-100 if dtype.is_signed else 0, 100, shape, generator=g).to(dtype).to(device)

    for dtype in (
        torch.float32,
        torch.bfloat16,
        torch.float16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int8,
        torch.uint8,
        torch.bool,
    ):
        exchange(lambda r, d=dtype: rnd((37, 3), d, 10 + r), f"dtype {dtype}")
    exchange(lambda r: torch.tensor(float(r) + 0.5, device=device), "0-d")
    exchange(lambda r: torch.empty(0, 4, device=device), "empty")
    exchange(lambda r: rnd((256 * MIB // 4,), torch.float32, 77 + r), "256 MiB")
    # non-contiguous on both ends
    src = rnd((64, 48), torch.float32, 5 + rank)[:, ::2]
    big = torch.zeros(48, 64, device=device)
    dst = big[:24, :].t()  # (64, 24), not contiguous
    ops = [dist.P2POp(dist.isend, src, peer, group=group), dist.P2POp(dist.irecv, dst, peer, group=group)]
    for w in dist.batch_isend_irecv(ops if rank == 0 else ops[::-1]):
        w.wait()
    torch.cuda.synchronize(device)
    if not torch.equal(dst.cpu(), rnd((64, 48), torch.float32, 5 + peer)[:, ::2].cpu()) or big[24:].abs().sum() != 0:
        failures.append("non-contiguous: bytes differ or written outside the view")
    # a kernel right before isend, one right after wait(), no host synchronization between
    x = torch.empty(16 * MIB // 4, device=device)
    y = torch.empty_like(x)
    for i in range(20):
        x.fill_(float(i * 2 + rank))  # a kernel queued right before isend
        ops = [dist.P2POp(dist.isend, x, peer, group=group), dist.P2POp(dist.irecv, y, peer, group=group)]
        for w in dist.batch_isend_irecv(ops if rank == 0 else ops[::-1]):
            w.wait()
        s = y.sum()  # a kernel right after wait()
        if float(s) != float(i * 2 + peer) * y.numel():
            failures.append(f"stream order, step {i}: got {float(s)}")
            break
        x.mul_(0)  # overwrite right after (the send must have read it already)
    # 8 in flight both ways
    outs = [torch.zeros(MIB // 4 + k, device=device) for k in range(8)]
    ins = [torch.full((MIB // 4 + k,), float(rank * 100 + k), device=device) for k in range(8)]
    ops = [dist.P2POp(dist.isend, t, peer, group=group) for t in ins] + [
        dist.P2POp(dist.irecv, t, peer, group=group) for t in outs
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    torch.cuda.synchronize(device)
    for k, t in enumerate(outs):
        if not bool((t == float(peer * 100 + k)).all()):
            failures.append(f"8 in flight: message {k} differs")
    # host time of wait() for a 256 MiB receive
    big_t = torch.empty(256 * MIB // 4, device=device)
    dist.barrier()
    if rank == 0:
        time.sleep(0.05)
        dist.send(big_t, 1, group=group)
    else:
        w = dist.irecv(big_t, 0, group=group)
        t0 = time.perf_counter()
        w.wait()
        us = (time.perf_counter() - t0) * 1e6
        print(f"host time of wait() for a 256 MiB receive: {us:.1f} us", flush=True)
        if us > 1000:
            failures.append(f"wait() of a 256 MiB receive held the host {us:.0f} us")
    torch.cuda.synchronize(device)
    # the Link API: static CUDA specs over the copy-engine path, into the receiver's slots
    node = tensorwire.init(device=device)
    specs = [
        tensorwire.TensorSpec("a", (37, 3), "bfloat16", "cuda"),
        tensorwire.TensorSpec("b", (1 << 20,), "float32", "cuda"),
    ]
    link = node.link(peer, send=specs, recv=specs, name="check")
    if link.ce is None:
        failures.append("Link: no copy-engine pair between two ranks of one host")
    for step in range(5):
        for sp in specs:
            link.send(sp.name, rnd(sp.shape, sp.torch_dtype, 1000 * step + rank))
        for sp in specs:
            got = link.recv(sp.name)
            if not torch.equal(got.cpu(), rnd(sp.shape, sp.torch_dtype, 1000 * step + peer).cpu()):
                failures.append(f"Link: {sp.name} differs at step {step}")
    link.close()
    node.close()
    # a shape mismatch raises on the side that came second, and fails the first one's work
    dist.barrier()
    try:
        if rank == 0:
            w = dist.isend(torch.ones(4, 4, device=device), 1, group=group, tag=9)
            dist.barrier()
            w.wait(timeout=_dt.timedelta(seconds=5))
        else:
            dist.barrier()
            w = dist.irecv(torch.ones(4, 5, device=device), 0, group=group, tag=9)
            w.wait(timeout=_dt.timedelta(seconds=5))
        failures.append("shape mismatch: no error")
    except Exception as exc:  # noqa: BLE001
        if "4, 5" not in str(exc) or "4, 4" not in str(exc):
            failures.append(f"shape mismatch: the error does not name both sides: {exc}")
    return failures


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="markdown report (a .json beside it)")
    ap.add_argument("--check", action="store_true", help="correctness checks only")
    ap.add_argument("--max-mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--iters", type=int, default=200, help="round trips per turn at 1 MiB (fewer for larger)")
    ap.add_argument("--min-kib", type=int, default=64, help="the smallest message (KiB)")
    ap.add_argument(
        "--inline-max",
        type=int,
        help="diagnostic: the pairs' inline_max (bytes up to which the second side copies on the caller's stream)",
    )
    args = ap.parse_args()
    if args.max_mib < 1 or args.reps < 1 or args.iters < 4:
        ap.error("--max-mib, --reps and --iters must be >= 1, 1 and 4")
    rank = int(os.environ["RANK"])
    ngpu = torch.cuda.device_count()
    device = torch.device("cuda", rank % ngpu)
    torch.cuda.set_device(device)
    dist.init_process_group("tensorwire")
    tw = dist.group.WORLD
    pg = dist.distributed_c10d._get_default_group()
    dist.barrier()  # (the group's backend is made on its first call)
    try:
        backend = pg._get_backend(device)
    except RuntimeError:
        backend = None
    kinds = dict(getattr(backend, "transports", {}))
    pairs = [p.ce for p in getattr(backend, "_peers", {}).values() if p.ce is not None]
    if args.inline_max is not None:
        for pair in pairs:
            pair.inline_max = args.inline_max
    if rank == 0:
        calls = getattr(pairs[0].driver, "bindings", "?") if pairs else "no copy-engine pair"
        print(
            f"GPUs: {ngpu} ({torch.cuda.get_device_name(device)}); transports: {kinds}; driver calls: {calls}",
            flush=True,
        )
    if args.check:
        failures = check(rank, device, tw)
        gathered: list = [None, None]
        dist.all_gather_object(gathered, failures)
        dist.destroy_process_group()
        if rank == 0:
            bad = [f for f in gathered for f in (f or [])]
            print("\n".join(bad) if bad else "CHECKS PASSED", flush=True)
            return 1 if bad else 0
        return 0
    nccl = dist.new_group(backend="nccl") if ngpu >= 2 else None
    floor = Floor(rank, device, max(_sizes(args.max_mib)))
    node = tensorwire.init(device=device)
    rows = []
    for n in [n for n in _sizes(args.max_mib) if n >= args.min_kib * 1024]:
        iters = max(20, min(2000, int(args.iters * MIB / n))) if n >= MIB else 2 * args.iters
        res: dict[str, list[float]] = {"floor": [], "tensorwire": [], "nccl": [], "link": []}
        st: dict[str, list[float]] = {"tensorwire": [], "nccl": []}
        for _ in range(args.reps):
            res["floor"].append(pingpong("floor", rank, n, iters, device, None, floor))
            res["tensorwire"].append(pingpong("tw", rank, n, iters, device, tw, None))
            res["link"].append(link_pingpong(rank, n, iters, device, node))
            if nccl is not None:
                res["nccl"].append(pingpong("nccl", rank, n, iters, device, nccl, None))
            if n >= MIB:
                st["tensorwire"].append(stream4("tw", rank, n, max(8, iters // 2 * 2), device, tw))
                if nccl is not None:
                    st["nccl"].append(stream4("nccl", rank, n, max(8, iters // 2 * 2), device, nccl))
        host = host_times(rank, n, device, tw)
        row = {
            "bytes": n,
            "iters": iters,
            "oneway_us": {k: min(v) * 1e6 for k, v in res.items() if v},
            "stream4_us": {k: min(v) * 1e6 for k, v in st.items() if v},
            "host_us_rank": host[0],
        }
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    # the host time of irecv + wait is rank 1's: gather it
    mine = [r["host_us_rank"] for r in rows]
    both: list = [None, None]
    dist.all_gather_object(both, mine)
    for r, a, b in zip(rows, both[0], both[1]):
        r["host_isend_us"], r["host_irecv_wait_us"] = a, b
        del r["host_us_rank"]
    floor.close()
    node.close()
    dist.destroy_process_group()
    if rank == 0 and args.out:
        _report(args.out, rows, ngpu, torch.cuda.get_device_name(device), kinds)
    return 0


def _report(out: str, rows: list[dict], ngpu: int, name: str, kinds: dict) -> None:
    when = _dt.date.today().isoformat()
    lines = [
        f"# The copy-engine path: backend tensorwire vs its floor{' and NCCL' if ngpu >= 2 else ''}",
        "",
        f"{when}; {'two GPUs' if ngpu >= 2 else 'one GPU, two processes'} ({name}); transports {kinds}; "
        f"`torchrun --standalone --nproc-per-node 2 bench/bench_ce_gpu.py`. Best of the turns; one-way time of a "
        "ping-pong; `x floor` = floor's time / tensorwire's (1.0 = as fast as the bare mechanism).",
        "",
        "| size | floor | tensorwire | x floor | NCCL | x NCCL (bandwidth) | Link | Link x floor | 4 in flight tw "
        "| 4 in flight NCCL | host isend | host irecv+wait |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        o, s = r["oneway_us"], r["stream4_us"]
        n = r["bytes"]
        size = f"{n // MIB} MiB" if n >= MIB else f"{n // KIB} KiB"

        def gbs(us: float, n: int = n) -> str:
            return f"{us:.1f} us ({n / us / 1e3:.0f} GB/s)"

        nc = o.get("nccl")
        x_nccl = f"{nc / o['tensorwire']:.2f}" if nc else "-"
        lines.append(
            f"| {size} | {gbs(o['floor'])} | {gbs(o['tensorwire'])} | {o['floor'] / o['tensorwire']:.2f} | "
            f"{gbs(nc) if nc else '-'} | {x_nccl} | {gbs(o['link'])} | {o['floor'] / o['link']:.2f} | "
            f"{gbs(s['tensorwire']) if 'tensorwire' in s else '-'} | {gbs(s['nccl']) if 'nccl' in s else '-'} | "
            f"{r['host_isend_us']:.1f} us | {r['host_irecv_wait_us']:.1f} us |"
        )
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.splitext(out)[0] + ".json", "w") as f:
        json.dump(
            {
                "date": when,
                "gpus": ngpu,
                "device": name,
                "transports": {str(k): v for k, v in kinds.items()},
                "rows": rows,
            },
            f,
            indent=1,
        )
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    sys.exit(main())
