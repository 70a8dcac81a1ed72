#!/usr/bin/env python
r"""Messages while every SM runs matmuls: backend "tensorwire" vs NCCL on two GPUs (the compute-overlap case).

::

    torchrun --standalone --nproc-per-node 2 bench/bench_overlap_gpu.py \
        --machine h200x2 --out bench/results/overlap-gpu_h200x2_DATE.md
    python bench/bench_overlap_gpu.py --device cpu --dim 256 --mib 1 --matmuls 3 --rounds 3 --turns 1   # dry run

(Started without torchrun, the script runs itself under torchrun with two processes.) Two ranks, one GPU each
(``rank % device_count``). The default group is ``tensorwire``; a second group over the same processes is
``new_group(backend="nccl")`` (gloo with ``--device cpu``, which uses float32, no streams and wall-clock timers).

One measurement queues ``--matmuls`` back-to-back ``--dim`` square bf16 matmuls on the current stream and, on a
side stream, rounds of ``--mib`` MiB each way (``isend`` + ``irecv`` to the peer, both waited for), then
synchronizes. Each backend gets as many rounds as cover the matmuls' time (measured alone first; ``--rounds`` at
least), so its messages flow for the whole of the matmuls. CUDA events time the matmuls on the compute stream and the messages on the side stream. Each
backend is measured with both running ("overlap") and with each alone, in ``--turns`` turns (every turn: each
backend in order); medians over the turns, the slowest rank's times. Received bytes are checked every time.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

MIB = 1 << 20
MODES = ("overlap", "matmul", "messages")  # both at once, matmuls alone, messages alone
BYTES_TARGET = 3.0  # tensorwire / NCCL bytes per second while the matmuls run: at least this
TARGET = (
    "target (issue): tensorwire moves >= 3x the bytes NCCL moves while the matmuls run, "
    "with matmul throughput no lower than with NCCL"
)


class Timer:
    """Two marks on the current stream: CUDA events on a GPU, ``time.perf_counter`` on the CPU. Read
    :meth:`seconds` after the device is synchronized."""

    def __init__(self, torch, device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if self.cuda else [0.0, 0.0]

    def mark(self, i: int) -> None:
        if self.cuda:
            self.marks[i].record()
        else:
            self.marks[i] = time.perf_counter()

    def seconds(self) -> float:
        return self.marks[0].elapsed_time(self.marks[1]) / 1e3 if self.cuda else self.marks[1] - self.marks[0]


def exchange(dist, group, rank: int, peer: int, out, inn) -> None:
    """One round: ``out`` to the peer and ``inn`` from it (rank 0 posts its send first, rank 1 its receive)."""
    if rank == 0:
        works = [dist.isend(out, peer, group=group), dist.irecv(inn, peer, group=group)]
    else:
        works = [dist.irecv(inn, peer, group=group), dist.isend(out, peer, group=group)]
    for w in works:
        w.wait()


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import tensorwire  # noqa: F401 - registers the backend

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    cuda = args.device == "cuda"
    if cuda:
        device = torch.device("cuda", int(os.environ["RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    dist.init_process_group("tensorwire")
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    if dist.get_world_size() != 2:
        raise SystemExit(f"two ranks, got {dist.get_world_size()}")
    ref = "gloo" if not cuda else "nccl" if torch.cuda.device_count() >= 2 else None
    groups = {"tensorwire": None, **({ref: dist.new_group(backend=ref)} if ref else {})}
    log = (lambda msg: print(f"[overlap bench] {msg}", file=sys.stderr, flush=True)) if rank == 0 else None

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    tiny = torch.zeros(16, device=device)
    for g in groups.values():  # every group's first p2p: one blocking pair (not a batch)
        for op in (dist.send, dist.recv) if rank == 0 else (dist.recv, dist.send):
            op(tiny, peer, group=g)
    dtype = torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator(device=device).manual_seed(rank)
    a, b = (torch.randn(args.dim, args.dim, device=device, dtype=dtype, generator=gen) for _ in range(2))
    c = torch.empty_like(a)
    out, inn = (torch.empty(args.mib * MIB // 4, device=device) for _ in range(2))
    side = torch.cuda.Stream(device) if cuda else None
    count = 0  # measurements so far: every one sends its own values

    def measure(g, matmuls: int, rounds: int) -> dict:
        nonlocal count
        count += 1
        out.fill_(float(rank + 1 + 2 * count))
        inn.fill_(0.0)
        mm, msg = Timer(torch, device), Timer(torch, device)
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        if matmuls:
            mm.mark(0)
            for _ in range(matmuls):
                torch.mm(a, b, out=c)
            mm.mark(1)
        if rounds:
            with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                msg.mark(0)
                for _ in range(rounds):
                    exchange(dist, g, rank, peer, out, inn)
                msg.mark(1)
        sync()
        wall = time.perf_counter() - t0
        bad = int((inn != float(peer + 1 + 2 * count)).sum().item()) if rounds else 0
        times = torch.tensor(
            [mm.seconds() if matmuls else 0.0, msg.seconds() if rounds else 0.0, wall], dtype=torch.float64
        )
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank's (CPU tensors: the default group)
        corrupt = torch.tensor([bad])
        dist.all_reduce(corrupt)
        mm_s, msg_s, wall = times.tolist()
        return {
            "matmul_s": mm_s if matmuls else None,
            "message_s": msg_s if rounds else None,
            "wall_s": wall,
            "tflops": 2 * args.dim**3 * matmuls / mm_s / 1e12 if matmuls else None,
            "gbps": rounds * args.mib * MIB / msg_s / 1e9 if rounds else None,
            "corrupt": int(corrupt.item()),
        }

    for g in groups.values():  # warm-up: kernels chosen, connections and buffers set up
        measure(g, 1, 1)
    # Each backend's messages must flow for as long as the matmuls run (a backend that finished its rounds early
    # would leave the matmuls alone for the rest, and look cheaper): rounds enough to cover the matmuls' time
    # alone, from one measurement of each alone (the same figures on both ranks: the slowest rank's).
    rounds: dict[str, int] = {}
    for name, g in groups.items():
        mm_s = measure(g, args.matmuls, 0)["matmul_s"]
        per_round = measure(g, 0, 4)["message_s"] / 4
        rounds[name] = max(args.rounds, math.ceil(1.2 * mm_s / per_round))
    if log:
        log("rounds per measurement (to cover the matmuls): " + ", ".join(f"{n} {r}" for n, r in rounds.items()))
    runs: list[dict] = []
    for turn in range(1, args.turns + 1):
        order = list(groups.items())
        if turn % 2 == 0:  # (every other turn the other backend first: an order effect hits both alike)
            order.reverse()
        for name, g in order:
            if log:
                log(f"turn {turn}/{args.turns}: {name} ...")
            n = rounds[name]
            plan = {"overlap": (args.matmuls, n), "matmul": (args.matmuls, 0), "messages": (0, n)}
            for mode in MODES:
                run = {"turn": turn, "backend": name, "mode": mode, "rounds": n, **measure(g, *plan[mode])}
                runs.append(run)
                if rank == 0:
                    print(json.dumps(run), flush=True)
    if rank == 0 and args.out is not None:
        gpus = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(device)}" if cuda else "no GPU"
        write_report(args, runs, list(groups), ref, gpus, torch.__version__)
    sync()
    dist.barrier()
    dist.destroy_process_group()


def summary(runs: list[dict], names: list[str]) -> dict:
    """Per backend: medians over the turns (TFLOP/s and GB/s, alone and overlapped) and the corrupt elements."""
    res: dict = {}
    for name in names:
        mine = [r for r in runs if r["backend"] == name]

        def med(mode: str, key: str, mine=mine) -> float:
            return statistics.median(r[key] for r in mine if r["mode"] == mode)

        res[name] = {
            "tflops_alone": med("matmul", "tflops"),
            "tflops_overlap": med("overlap", "tflops"),
            "gbps_alone": med("messages", "gbps"),
            "gbps_overlap": med("overlap", "gbps"),
            "message_over_matmul": med("overlap", "message_s") / med("overlap", "matmul_s"),
            "corrupt": sum(r["corrupt"] for r in mine),
        }
    return res


def write_report(args: argparse.Namespace, runs: list[dict], names: list[str], ref, gpus: str, version: str) -> None:
    res = summary(runs, names)
    label = {"tensorwire": "tensorwire", "nccl": "NCCL", "gloo": "gloo"}
    here = Path(__file__).resolve()
    script = str(here.relative_to(here.parents[1]))  # as run from the checkout's root
    # (the report's own path as the results index names it, not where this run wrote it)
    argv = [f"bench/results/{args.out.name}" if a == str(args.out) else a for a in sys.argv[1:]]
    command = shlex.join(["torchrun", "--standalone", "--nproc-per-node", "2", script, *argv])
    lines = [
        f"# Messages while matmuls run: tensorwire vs {label.get(ref, 'nothing')} ({args.machine})",
        "",
        f"Date {_dt.date.today().isoformat()}; machine {args.machine}; GPUs: {gpus}; torch {version}.",
        f"Command: `{command}`.",
        "",
        f"Per measurement: {args.matmuls} matmuls {args.dim}x{args.dim} @ {args.dim}x{args.dim} on the compute "
        f"stream and, on a side stream, rounds of {args.mib} MiB each way -- per backend as many as cover the "
        f"matmuls' time (at least {args.rounds}; "
        + ", ".join(f"{label[n]} {next(r['rounds'] for r in runs if r['backend'] == n)}" for n in names)
        + f"); medians over {args.turns} turn(s), the slowest rank's times. GB/s: bytes one rank sent / message "
        "time (per direction).",
        "",
        "| backend | matmul TFLOP/s alone | with messages | with / alone | messages GB/s per direction alone "
        "| with matmuls | corrupt elements |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in names:
        r = res[name]
        lines.append(
            f"| {label[name]} | {r['tflops_alone']:.4g} | {r['tflops_overlap']:.4g} "
            f"| {r['tflops_overlap'] / r['tflops_alone']:.3f} | {r['gbps_alone']:.2f} "
            f"| {r['gbps_overlap']:.2f} | {r['corrupt']} |"
        )
    lines += ["", "Message time / matmul time with both running (above 1: the last rounds ran after the matmuls): "]
    lines[-1] += ", ".join(f"{label[n]} {res[n]['message_over_matmul']:.2f}" for n in names) + "."
    lines += ["", f"- {TARGET}"]
    if ref is None:
        lines.append("- not evaluated: no NCCL group (one GPU)")
    else:
        tw, rf = res["tensorwire"], res[ref]
        bytes_ratio, flops_ratio = tw["gbps_overlap"] / rf["gbps_overlap"], tw["tflops_overlap"] / rf["tflops_overlap"]
        met = bytes_ratio >= BYTES_TARGET and flops_ratio >= 1.0
        lines += [
            f"- tensorwire/{label[ref]} bytes/s with matmuls: {bytes_ratio:.2f}x",
            f"- tensorwire/{label[ref]} matmul TFLOP/s with messages: {flops_ratio:.3f}x",
            f"- {'met' if met else '**missed**'}" + ("" if ref == "nccl" else f" (against {label[ref]}: a dry run)"),
        ]
    args.out.write_text("\n".join(lines) + "\n")
    raw = {"args": {k: str(v) for k, v in vars(args).items()}, "gpus": gpus, "summary": res, "runs": runs}
    args.out.with_suffix(".json").write_text(json.dumps(raw, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dim", type=int, default=8192, help="matmul size (square)")
    ap.add_argument("--matmuls", type=int, default=40, help="matmuls per measurement")
    ap.add_argument("--mib", type=int, default=64, help="message size in MiB")
    ap.add_argument(
        "--rounds", type=int, default=4, help="message rounds (each way) per measurement, at least (see above)"
    )
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--machine", default="gpu", help="names the machine in the report")
    ap.add_argument("--out", type=Path, default=None, help="markdown report (a .json beside it)")
    args = ap.parse_args()
    for name in ("dim", "matmuls", "mib", "rounds", "turns"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.stderr.write("CUDA is not available here: nothing was measured (--device cpu runs a dry run)\n")
            raise SystemExit(2)
    if "RANK" not in os.environ:  # not under torchrun: become torchrun, two processes
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        os.execv(sys.executable, [*launch, str(Path(__file__).resolve()), *sys.argv[1:]])
    worker(args)


if __name__ == "__main__":
    main()
