#!/usr/bin/env python
"""torch.distributed on GPUs: backend "tensorwire" vs NCCL, one torchrun job, every backend in turns.

::

    python bench/bench_distributed_gpu.py --out bench/results/distributed-gpu_<machine>_<date>.md
    python bench/bench_distributed_gpu.py --device cpu --max-mib 4 --acts 1   # dry run: gloo stands in for NCCL

One job, two ranks, one GPU each (NCCL refuses two ranks on one GPU, so a host
needs two). The default group is NCCL (gloo with ``--device cpu``); a
second group over the same processes is ``dist.new_group(backend="tensorwire")``.
Every measurement alternates between the two groups, so a change of load hits
both alike.

- **point-to-point** (1 MiB ... ``--max-mib``): a ``dist.send``/``dist.recv``
  ping-pong (round trip) and a stream rank 0 -> rank 1 (``isend``/``irecv`` with
  four messages in flight; the time runs until rank 1 has waited for the last one
  and its reply arrived). Reported as GB/s; ratios tensorwire / NCCL.
- **overlap**: per step, each rank runs a matmul per microbatch and posts the
  result's ``isend`` and the peer's ``irecv`` at once (every microbatch's send and
  receive in flight while the next kernels run), waits for all, then a kernel
  consumes what arrived. Reported: step time and the compute alone.
- **pipelining**: ``torch.distributed.pipelining`` ``ScheduleGPipe`` and
  ``Schedule1F1B``, two stages (Linear+GELU, Linear), 4 microbatches whose
  activations are ``--acts`` MiB each (default 1, 16, 64), SGD; each backend trains
  its own copy of the same model on the same data. Reported: median step time and
  the final loss of each (the same bytes arrive either way, so the losses agree).

The ``device`` of every figure, the transport tensorwire chose, the GPUs and
their link are written to the report.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_distributed import _pingpong as _host_pingpong  # (this script's folder is on sys.path)
from bench_distributed import add_tree_option, hot_path, run_ranks, with_tree, write_result

MIB = 1 << 20
#: the measurements, in the order they run
PARTS = ("p2p", "overlap", "pipelining")


def _sync(torch, device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pingpong(dist, torch, group, rank: int, x, n: int, device) -> float:
    _sync(torch, device)
    return float(_host_pingpong(dist, torch, group, rank, x, n, settle=lambda: _sync(torch, device)))


def _stream(dist, torch, group, rank: int, bufs, n: int, device) -> float:
    """Rank 0 streams n messages to rank 1 (len(bufs) in flight); returns the time per message."""
    ack = torch.zeros(1, device=device)
    _sync(torch, device)
    t0 = time.perf_counter()
    pending = []
    for i in range(n):
        buf = bufs[i % len(bufs)]
        pending.append(dist.isend(buf, 1, group=group) if rank == 0 else dist.irecv(buf, 0, group=group))
        if len(pending) == len(bufs):
            for w in pending:
                w.wait()
            pending = []
    for w in pending:
        w.wait()
    if rank == 1:
        dist.send(ack, 0, group=group)
    else:
        dist.recv(ack, 1, group=group)
    _sync(torch, device)
    return (time.perf_counter() - t0) / n


def _overlap(dist, torch, group, rank: int, mats, outs, ins, device, exchange: bool = True) -> float:
    peer = 1 - rank
    _sync(torch, device)
    t0 = time.perf_counter()
    works = []
    for a, out, inp in zip(mats, outs, ins):
        torch.matmul(a, a, out=out)
        if exchange:
            works.append(dist.isend(out, peer, group=group))
            works.append(dist.irecv(inp, peer, group=group))
    for w in works:
        w.wait()
    total = sum(inp.sum() for inp in ins)
    total.item()
    _sync(torch, device)
    return time.perf_counter() - t0


class _Trainer:
    """One backend's copy of a two-stage model under one schedule."""

    def __init__(self, torch, group, rank: int, device, schedule: str, act_mib: int, width: int, n_mb: int) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        torch.manual_seed(0)
        first = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
        last = torch.nn.Linear(width, width)
        self.rank, self.torch, self.device = rank, torch, device
        mod = (first if rank == 0 else last).to(device)
        self.opt = torch.optim.SGD(mod.parameters(), lr=1e-3)
        rows = max(1, act_mib * MIB // (4 * width))
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(rows * n_mb, width, generator=gen).to(device)
        self.y = torch.randn(rows * n_mb, width, generator=gen).to(device)
        stage = PipelineStage(mod, rank, 2, device, group=group)  # shapes inferred in the warm-up step
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        self.sched = cls(stage, n_microbatches=n_mb, loss_fn=torch.nn.MSELoss())
        self.losses: list[float] = []

    def step(self) -> float:
        torch = self.torch
        _sync(torch, self.device)
        t0 = time.perf_counter()
        self.opt.zero_grad()
        if self.rank == 0:
            self.sched.step(self.x)
        else:
            losses: list = []
            self.sched.step(target=self.y, losses=losses)
        self.opt.step()
        _sync(torch, self.device)
        dt = time.perf_counter() - t0
        if self.rank == 1:
            self.losses.append(float(sum(loss.item() for loss in losses) / len(losses)))
        return dt


def start_worker(args: argparse.Namespace, *, tf32: bool = True, one_thread_on_cpu: bool = False) -> tuple:
    """A benchmark job's rank: ``(device, the reference backend, LOCAL_RANK)``, the default group made with that
    backend (NCCL on GPUs, gloo with ``--device cpu``), tensorwire's backend registered, ``--dump-after`` armed.

    ``tf32``: leave TF32 matmuls on (off: float32 matmuls exact); ``one_thread_on_cpu``: one torch thread per
    rank on CPU (N ranks share the host's cores)."""
    import torch
    import torch.distributed as dist

    import tensorwire  # noqa: F401 - registers the backend

    if args.dump_after:
        import faulthandler

        faulthandler.dump_traceback_later(args.dump_after, exit=True)  # every thread's stack, then exit
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        if not tf32:
            torch.backends.cuda.matmul.allow_tf32 = False
        ref = "nccl"
    else:
        device = torch.device("cpu")
        if one_thread_on_cpu:
            torch.set_num_threads(1)
        ref = "gloo"
    dist.init_process_group(ref)
    return device, ref, local


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    device, ref, _local = start_worker(args, tf32=False)
    rank = dist.get_rank()
    tw = dist.new_group([0, 1], backend="tensorwire")
    groups = {ref: None, "tensorwire": tw}
    names = list(groups)
    out: dict = {"ref": ref, "device": str(device), "transport": {}, "p2p": {}, "overlap": {}, "pipelining": {}}
    out["hot_path"] = hot_path()
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    log = (lambda msg: print(f"[bench_distributed_gpu] {msg}", file=sys.stderr, flush=True)) if rank == 0 else None
    # Every group's first point-to-point operation is a blocking ping-pong, whichever parts run: NCCL 2.28
    # (torch 2.11, two H200s, NVLS off) hit an illegal memory access when a group's first operation was an
    # unbatched isend from both ranks at once (the overlap part run alone); after one send/recv pair it does not.
    warm = torch.zeros(1024, device=device)
    for g in groups.values():
        _pingpong(dist, torch, g, rank, warm, 2, device)
    del warm

    # -- point-to-point
    sizes = [s * MIB for s in (1, 4, 16, 64, 256) if s <= args.max_mib and "p2p" in args.parts]
    for size in sizes:
        x = torch.zeros(size // 4, device=device)
        bufs = [torch.zeros(size // 4, device=device) for _ in range(4)]
        n_pp = max(2, min(50, (512 * MIB) // size // args.rounds))
        n_st = max(4, min(200, (1024 * MIB) // size // args.rounds))
        pp: dict[str, list[float]] = {k: [] for k in names}
        st: dict[str, list[float]] = {k: [] for k in names}
        for g in groups.values():  # warm-up: connections, the first message of each signature
            _pingpong(dist, torch, g, rank, x, 2, device)
            _stream(dist, torch, g, rank, bufs, 4, device)
        for _ in range(args.rounds):
            for name in names:
                dist.barrier()
                pp[name].append(_pingpong(dist, torch, groups[name], rank, x, n_pp, device))
                dist.barrier()
                st[name].append(_stream(dist, torch, groups[name], rank, bufs, n_st, device))
        out["p2p"][size] = {
            "pingpong": {k: statistics.median(v) for k, v in pp.items()},
            "stream": {k: statistics.median(v) for k, v in st.items()},
        }
        if log:
            r = out["p2p"][size]
            log(
                f"{size // MIB} MiB: ping-pong tw/{ref} {r['pingpong'][ref] / r['pingpong']['tensorwire']:.2f}x, "
                f"stream {r['stream'][ref] / r['stream']['tensorwire']:.2f}x (bandwidth)"
            )
        del x, bufs
    out["transport"] = {str(k): v for k, v in dict(getattr(tw, "transports", {})).items()}

    # -- overlap
    for act in args.acts if "overlap" in args.parts else ():
        side = max(64, int((act * MIB // 4) ** 0.5))
        n_mb = 4
        mats = [torch.randn(side, side, device=device) for _ in range(n_mb)]
        outs = [torch.empty(side, side, device=device) for _ in range(n_mb)]
        ins = [torch.empty(side, side, device=device) for _ in range(n_mb)]
        samples: dict[str, list[float]] = {k: [] for k in [*names, "compute alone"]}
        for name in names:
            _overlap(dist, torch, groups[name], rank, mats, outs, ins, device)
        for _ in range(args.steps):
            for name in names:
                dist.barrier()
                samples[name].append(_overlap(dist, torch, groups[name], rank, mats, outs, ins, device))
            samples["compute alone"].append(_overlap(dist, torch, None, rank, mats, outs, ins, device, exchange=False))
        out["overlap"][act] = {
            "mib": side * side * 4 / MIB,
            **{k: statistics.median(v) for k, v in samples.items()},
        }
        if log:
            r = out["overlap"][act]
            log(f"overlap {r['mib']:.0f} MiB x {n_mb}: tw/{ref} time {r['tensorwire'] / r[ref]:.2f}x")

    # -- pipelining
    for schedule in ("gpipe", "1f1b") if "pipelining" in args.parts else ():
        for act in args.acts:
            trainers = {
                name: _Trainer(torch, g, rank, device, schedule, act, args.width, 4) for name, g in groups.items()
            }
            times: dict[str, list[float]] = {k: [] for k in names}
            for name in names:
                dist.barrier()
                trainers[name].step()  # warm-up
            for _ in range(args.steps):
                for name in names:
                    dist.barrier()
                    times[name].append(trainers[name].step())
            key = f"{schedule}/{act}"
            out["pipelining"][key] = {
                name: {
                    "step": statistics.median(times[name]),
                    "loss": trainers[name].losses[-1] if trainers[name].losses else None,
                }
                for name in names
            }
            if log:
                r = out["pipelining"][key]
                log(f"{schedule} {act} MiB: tw/{ref} step {r['tensorwire']['step'] / r[ref]['step']:.2f}x")
            del trainers
    dist.barrier()
    dist.destroy_process_group(tw)
    dist.destroy_process_group()
    write_result(args.result_dir, rank, out)


def _fmt(n: int) -> str:
    return f"{n // MIB} MiB"


def report(results: dict, args: argparse.Namespace, wall: float, gpus: str) -> str:
    r0, r1 = results[0], results[1]
    ref = r0["ref"]
    ref_name = {"nccl": "NCCL", "gloo": "gloo"}[ref]
    cmd = "python bench/bench_distributed_gpu.py" + (f" --device {args.device}" if args.device != "cuda" else "")
    cmd += (
        f" --rounds {args.rounds} --steps {args.steps} --max-mib {args.max_mib} --acts {','.join(map(str, args.acts))}"
    )
    cmd += f" --tree {args.tree}" if args.tree is not None else ""
    env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("TENSORWIRE_"))
    lines = [
        f"# torch.distributed on {args.device}: backend tensorwire vs {ref_name} ({args.machine})",
        "",
        f"Date {_dt.date.today().isoformat()}; {os.cpu_count()} cores; Python {platform.python_version()}; "
        f"ranks on {r0['device']} / {r1['device']}; {gpus}. tensorwire transport: "
        f"{sorted(set(r0['transport'].values())) or 'n/a'}; hot path {r0.get('hot_path', 'unknown')}. "
        f"Run took {wall:.0f} s.",
        f'One torchrun job, 2 ranks; {ref_name} default group and `new_group(backend="tensorwire")` over the same '
        f"processes, measured in turns. Command: `{cmd}`" + (f" with `{env}`" if env else "") + ".",
    ]
    # (a part left out with --parts gets no section)
    if r0.get("p2p"):
        lines += _p2p_section(r0, ref, ref_name)
    if r0.get("overlap"):
        lines += _overlap_section(r0, r1, ref, ref_name)
    if r0.get("pipelining"):
        lines += _pipelining_section(r0, r1, ref, ref_name, args)
    return "\n".join(lines) + "\n"


def _p2p_section(r0: dict, ref: str, ref_name: str) -> list[str]:
    lines = [
        "",
        "## Point-to-point (rank 0's view)",
        "",
        "Ping-pong: `dist.send` then `dist.recv` (rank 1 mirrors), bandwidth 2 x size / round trip. Stream: rank 0 "
        "`isend`s to rank 1's `irecv`s, 4 in flight, until rank 1 has waited for the last.",
        "",
        f"| size | ping-pong {ref_name} GB/s | ping-pong tensorwire GB/s | tw/{ref_name} | stream {ref_name} GB/s | "
        f"stream tensorwire GB/s | tw/{ref_name} |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for size, v in sorted(r0["p2p"].items(), key=lambda kv: int(kv[0])):
        size = int(size)
        pg, pt = 2 * size / v["pingpong"][ref] / 1e9, 2 * size / v["pingpong"]["tensorwire"] / 1e9
        sg, st = size / v["stream"][ref] / 1e9, size / v["stream"]["tensorwire"] / 1e9
        lines.append(f"| {_fmt(size)} | {pg:.1f} | {pt:.1f} | {pt / pg:.2f}x | {sg:.1f} | {st:.1f} | {st / sg:.2f}x |")
    return lines


def _overlap_section(r0: dict, r1: dict, ref: str, ref_name: str) -> list[str]:
    lines = [
        "",
        "## Overlap: every microbatch's send and receive in flight while the kernels run",
        "",
        "Per step and rank: 4 x (matmul, `isend` of its result, `irecv` of the peer's), then wait for all and "
        "a kernel reading what arrived. Time per step (rank 0 / rank 1), lower is better.",
        "",
        f"| message | compute alone | {ref_name} | tensorwire | tw/{ref_name} time |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for act, v in sorted(r0["overlap"].items(), key=lambda kv: int(kv[0])):
        w = r1["overlap"][act]
        lines.append(
            f"| {v['mib']:.0f} MiB | {v['compute alone'] * 1e3:.2f} / {w['compute alone'] * 1e3:.2f} ms | "
            f"{v[ref] * 1e3:.2f} / {w[ref] * 1e3:.2f} ms | {v['tensorwire'] * 1e3:.2f} / {w['tensorwire'] * 1e3:.2f} ms "
            f"| {v['tensorwire'] / v[ref]:.2f}x |"
        )
    return lines


def _pipelining_section(r0: dict, r1: dict, ref: str, ref_name: str, args: argparse.Namespace) -> list[str]:
    lines = [
        "",
        f"## torch.distributed.pipelining: 2 stages, 4 microbatches, width {args.width}, {args.steps} steps after one "
        "warm-up",
        "",
        "Median step time on rank 0 (forward, backward, optimizer step, device synchronized); final loss from "
        "rank 1 (the last stage).",
        "",
        f"| schedule | activation per microbatch | {ref_name} step | tensorwire step | tw/{ref_name} | "
        f"{ref_name} final loss | tensorwire final loss |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key, v in r0["pipelining"].items():
        schedule, act = key.split("/")
        losses = r1["pipelining"][key]
        lg, lt = losses[ref]["loss"], losses["tensorwire"]["loss"]
        lines.append(
            f"| {schedule} | {act} MiB | {v[ref]['step'] * 1e3:.2f} ms | {v['tensorwire']['step'] * 1e3:.2f} ms | "
            f"{v['tensorwire']['step'] / v[ref]['step']:.2f}x | {lg:.6f} | {lt:.6f} |"
        )
    return lines


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r0 = results[0]
    ref = r0["ref"]
    sizes = sorted(int(s) for s in r0["p2p"])
    fig, ax = plt.subplots(figsize=(7, 4))
    for kind, factor, style in (("pingpong", 2, "-o"), ("stream", 1, "--s")):
        for name in (ref, "tensorwire"):
            bw = [factor * s / r0["p2p"][str(s)][kind][name] / 1e9 for s in sizes]
            ax.plot([s / MIB for s in sizes], bw, style, label=f"{name} {kind}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (MiB)")
    ax.set_ylabel("GB/s")
    ax.set_title(f"torch.distributed point-to-point: tensorwire vs {ref}")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _mib_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of MiB counts") from None


def _gpus() -> str:
    try:
        q = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        )
        names = [n.strip() for n in q.stdout.splitlines() if n.strip()]
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20).stdout
        link = ""
        for line in topo.splitlines():
            if line.startswith("GPU0"):
                link = line.split()[2] if len(line.split()) > 2 else ""
        return f"{len(names)} x {names[0]}" + (f", GPU0-GPU1 link {link}" if link and len(names) > 1 else "")
    except (OSError, subprocess.SubprocessError, IndexError):
        return "no GPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result-dir", default=None, help=argparse.SUPPRESS)  # (the workers' results, one file each)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--max-mib", type=int, default=256)
    ap.add_argument("--acts", type=_mib_list, default=[1, 16, 64], help="activation sizes in MiB (comma-separated)")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--parts", default=",".join(PARTS), help="which measurements (comma-separated)")
    ap.add_argument("--dump-after", type=float, default=0, help="dump every thread's stack and exit after S s")
    ap.add_argument("--machine", default="gpu")
    ap.add_argument("--out", type=Path, default=None, help="markdown report (and .json, .png beside it)")
    ap.add_argument("--timeout", type=float, default=540, help="seconds before the job is stopped")
    add_tree_option(ap)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        ap.error(f"--parts {args.parts!r}: choose one or more of {','.join(PARTS)}")
    for name in ("rounds", "steps", "max_mib", "width"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not args.acts or min(args.acts) < 1:
        ap.error(f"--acts: activation sizes in MiB, each at least 1, got {args.acts}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            sys.stderr.write("CUDA is not available here: nothing was measured (--device cpu runs a dry run)\n")
            raise SystemExit(2)
        if torch.cuda.device_count() < 2:
            sys.stderr.write("needs two GPUs (NCCL refuses two ranks on one GPU): nothing was measured\n")
            raise SystemExit(2)
    here = Path(__file__).resolve()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(here)]
    cmd += ["--worker", "--device", args.device, "--rounds", str(args.rounds), "--steps", str(args.steps)]
    cmd += ["--max-mib", str(args.max_mib), "--acts", ",".join(map(str, args.acts)), "--width", str(args.width)]
    cmd += ["--parts", args.parts, "--dump-after", str(args.dump_after)]
    env = with_tree(ap, args.tree, dict(os.environ))
    t0 = time.monotonic()
    proc, results = run_ranks(cmd, env, args.timeout)
    wall = time.monotonic() - t0
    if proc.returncode != 0 or len(results) != 2:
        sys.stderr.write(proc.stdout[-6000:])
        raise SystemExit(f"benchmark job failed (exit {proc.returncode})")
    text = report(results, args, wall, _gpus() if args.device == "cuda" else "no GPU")
    sys.stdout.write(text)
    if args.out is not None:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
        try:
            plot(results, args.out.with_suffix(".png"))
        except ImportError:
            print("matplotlib missing: no plot", file=sys.stderr)


if __name__ == "__main__":
    main()
