#!/usr/bin/env python
"""torch.distributed on N GPUs of one host: backend "tensorwire" vs NCCL, one torchrun job, every backend in turns.

::

    python bench/bench_multi_gpu.py --out bench/results/multi-gpu_<machine>_<date>.md
    python bench/bench_multi_gpu.py --device cpu --nproc 4 --acts 1 --ring-mib 1 --width 256   # dry run (gloo)

One job, one rank per GPU (written for 4, works for any N >= 2). The default group is NCCL (gloo with
``--device cpu``); a second group over the same processes is ``dist.new_group(backend="tensorwire")``. Every
measurement alternates between the two groups (and which goes first flips every round), so a change of load
hits both alike. NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``, ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``).

- **pipelining**: ``torch.distributed.pipelining`` with ``Schedule1F1B`` (one stage per rank, N stages) and
  ``ScheduleInterleaved1F1B`` (two stages per rank, 2N stages, stage ``rank + k * N``). Stages are bfloat16
  MLP blocks (Linear+GELU; the last stage a Linear) of width ``--width``, ``--microbatches`` microbatches whose
  activations are ``--acts`` MiB each, SGD, MSE loss on the last stage. Each backend trains its own copy of the
  same model (same seed, same data), so the final losses agree. Reported: median step time (the slowest
  rank's), the final losses, tensorwire / NCCL step time (target: <= 0.95 at every size).
- **ring**: every rank streams to its right neighbour (rank + 1 mod N) and receives from its left, 4 messages
  in flight per direction (``dist.batch_isend_irecv``, one batch of 4 sends and 4 receives at a time), sizes
  ``--ring-mib``. Reported: per-link GB/s (bytes one rank sent / time) and total GB/s (the sum over the N
  links), tensorwire / NCCL (target: >= 1.0 at every size), and how many received elements differ from what
  the left neighbour sent (each send buffer holds a value of its rank, message index and measurement).

``--check`` exits 1 when a target is missed, a pair of losses disagrees or a received buffer is corrupt
(each printed). The report (markdown, with a .json and a .png beside it) names the GPUs, the machine, the
torch version, the date and the command.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

# (this script's folder is on sys.path)
from bench_distributed import add_tree_option, hot_path, run_ranks, with_tree, write_result
from bench_distributed_gpu import _gpus, _mib_list, _sync, start_worker

MIB = 1 << 20
#: the measurements, in the order they run
PARTS = ("pipelining", "ring")
#: the schedules of the pipelining part: name -> stages per rank
SCHEDULES = {"1f1b": 1, "interleaved-1f1b": 2}
#: targets: tensorwire / reference step time at most this; ring total bandwidth tensorwire / reference at least
PIPE_TARGET = 0.95
RING_TARGET = 1.0
#: messages in flight per direction in the ring
IN_FLIGHT = 4
#: final losses "agree" within this relative difference (bfloat16 keeps 8 bits of mantissa: 2**-8 = 0.004)
LOSS_RTOL = 1e-2
#: parameters and data of the pipelines (bfloat16 matmuls run on the CPU too, so the dry run keeps it)
DTYPE = "bfloat16"
#: the environment of the job: NVLink multicast off (NCCL's NVLS, symmetric memory's multicast)
JOB_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}


def _log(rank: int):
    if rank != 0:
        return None
    return lambda msg: print(f"[multi bench] {msg}", file=sys.stderr, flush=True)


def microbatch_problem(n_mb: int, nproc: int) -> str | None:
    """Why ``n_mb`` microbatches cannot run both schedules on ``nproc`` ranks (torch's own rules), or None."""
    if n_mb < nproc:  # Schedule1F1B: n_microbatches >= the number of stages (one per rank)
        return f"Schedule1F1B needs at least as many microbatches as stages ({nproc}), got {n_mb}"
    rounds = max(1, n_mb // nproc)  # ScheduleInterleaved1F1B: a whole number of rounds of microbatches
    if n_mb % rounds:
        return (
            f"ScheduleInterleaved1F1B needs the microbatches to be a multiple of its rounds "
            f"(max(1, {n_mb} // {nproc}) = {rounds}), got {n_mb}"
        )
    return None


class _Trainer:
    """One backend's copy of an MLP pipeline under one schedule; this rank's stages."""

    def __init__(self, torch, group, rank: int, nproc: int, device, schedule: str, args, act_mib: int) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

        dtype = getattr(torch, DTYPE)
        per_rank = SCHEDULES[schedule]
        n_stages = per_rank * nproc
        width, n_mb = args.width, args.microbatches
        self.torch, self.device, self.rank, self.nproc = torch, device, rank, nproc
        stages, params = [], []
        for k in range(per_rank):
            index = rank + k * nproc
            torch.manual_seed(1000 + index)  # the same weights for stage `index` on every backend, any device
            if index == n_stages - 1:
                mod = torch.nn.Linear(width, width)
            else:
                mod = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
            mod = mod.to(device=device, dtype=dtype)
            params += list(mod.parameters())
            # no input_args: the shapes are inferred in the warm-up step
            stages.append(PipelineStage(mod, index, n_stages, device, group=group))
        self.opt = torch.optim.SGD(params, lr=1e-3)
        itemsize = torch.empty((), dtype=dtype).element_size()
        rows = max(1, act_mib * MIB // (itemsize * width))
        self.act_mib = rows * width * itemsize / MIB
        gen = torch.Generator().manual_seed(1)
        self.x = torch.randn(rows * n_mb, width, generator=gen).to(device=device, dtype=dtype)
        self.y = torch.randn(rows * n_mb, width, generator=gen).to(device=device, dtype=dtype)
        loss = torch.nn.MSELoss()
        if per_rank == 1:
            self.sched = Schedule1F1B(stages[0], n_microbatches=n_mb, loss_fn=loss)
        else:
            self.sched = ScheduleInterleaved1F1B(stages, n_microbatches=n_mb, loss_fn=loss)
        self.losses: list[float] = []

    def step(self) -> float:
        torch = self.torch
        _sync(torch, self.device)
        t0 = time.perf_counter()
        self.opt.zero_grad()
        losses: list = []
        if self.rank == 0:
            self.sched.step(self.x)
        elif self.rank == self.nproc - 1:
            self.sched.step(target=self.y, losses=losses)
        else:
            self.sched.step()
        self.opt.step()
        _sync(torch, self.device)
        dt = time.perf_counter() - t0
        if losses:
            self.losses.append(float(sum(loss.float().item() for loss in losses) / len(losses)))
        return dt


def _ring(dist, torch, group, rank: int, nproc: int, sends, recvs, n: int, device) -> float:
    """n batches of len(sends) messages to the right neighbour and as many from the left; the seconds taken."""
    right, left = (rank + 1) % nproc, (rank - 1) % nproc
    ops = [dist.P2POp(dist.isend, buf, right, group) for buf in sends]
    ops += [dist.P2POp(dist.irecv, buf, left, group) for buf in recvs]
    _sync(torch, device)
    t0 = time.perf_counter()
    for _ in range(n):
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    _sync(torch, device)
    return time.perf_counter() - t0


def _tag(rank: int, k: int, turn: int, nproc: int) -> float:
    """The value rank sends as its message k in measurement turn (exact in float32 for any sane run)."""
    return float(((turn * nproc + rank) * IN_FLIGHT + k + 1) % (1 << 23))


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    device, ref, local = start_worker(args, one_thread_on_cpu=True)
    rank, nproc = dist.get_rank(), dist.get_world_size()
    barrier = (lambda: dist.barrier(device_ids=[local])) if device.type == "cuda" else dist.barrier
    tw = dist.new_group(list(range(nproc)), backend="tensorwire")
    groups = {ref: None, "tensorwire": tw}
    names = list(groups)
    out: dict = {"ref": ref, "device": str(device), "nproc": nproc, "pipelining": {}, "ring": {}}
    out["hot_path"] = hot_path()
    out["dtype"] = DTYPE
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    log = _log(rank)

    def turns(i: int) -> list[str]:  # which backend goes first flips every round
        return names if i % 2 == 0 else names[::-1]

    # Every group's first point-to-point operation: a small ring that every rank joins (NCCL wants all the
    # group's ranks in its first batch_isend_irecv).
    warm_s = [torch.zeros(1024, device=device)]
    warm_r = [torch.zeros(1024, device=device)]
    for g in groups.values():
        _ring(dist, torch, g, rank, nproc, warm_s, warm_r, 2, device)
    del warm_s, warm_r

    # -- pipelining
    for schedule in SCHEDULES if "pipelining" in args.parts else ():
        for act in args.acts:
            if log:
                log(f"pipelining {schedule} {act} MiB ...")
            trainers = {
                name: _Trainer(torch, g, rank, nproc, device, schedule, args, act) for name, g in groups.items()
            }
            times: dict[str, list[float]] = {k: [] for k in names}
            for name in names:
                barrier()
                trainers[name].step()  # warm-up: shapes inferred, connections made
            for i in range(args.steps):
                for name in turns(i):
                    barrier()
                    times[name].append(trainers[name].step())
            key = f"{schedule}/{act}"
            out["pipelining"][key] = {
                "mib": trainers[names[0]].act_mib,
                **{
                    name: {
                        "step": statistics.median(times[name]),
                        "loss": trainers[name].losses[-1] if trainers[name].losses else None,
                    }
                    for name in names
                },
            }
            if log:
                r = out["pipelining"][key]
                log(f"pipelining {schedule} {act} MiB: tw/{ref} step {r['tensorwire']['step'] / r[ref]['step']:.2f}x")
            del trainers
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if "pipelining" in args.parts:
        out["transport"] = {str(k): v for k, v in dict(getattr(tw, "transports", {})).items()}

    # -- ring
    turn = 0
    for mib in args.ring_mib if "ring" in args.parts else ():
        if log:
            log(f"ring {mib} MiB ...")
        size = mib * MIB
        sends = [torch.empty(size // 4, device=device) for _ in range(IN_FLIGHT)]
        recvs = [torch.empty(size // 4, device=device) for _ in range(IN_FLIGHT)]
        budget = (4096 if device.type == "cuda" else 64) * MIB  # bytes a rank sends per measurement
        n = max(2, min(100, budget // (IN_FLIGHT * size)))
        secs: dict[str, list[float]] = {k: [] for k in names}
        bad: dict[str, int] = {k: 0 for k in names}
        for g in groups.values():  # warm-up: the first message of this size on each link
            _ring(dist, torch, g, rank, nproc, sends, recvs, 1, device)
        left = (rank - 1) % nproc
        for i in range(args.rounds):
            for name in turns(i):
                turn += 1
                for k in range(IN_FLIGHT):
                    sends[k].fill_(_tag(rank, k, turn, nproc))
                    recvs[k].fill_(-1.0)
                barrier()
                secs[name].append(_ring(dist, torch, groups[name], rank, nproc, sends, recvs, n, device))
                for k in range(IN_FLIGHT):
                    bad[name] += int((recvs[k] != _tag(left, k, turn, nproc)).sum().item())
        sent = n * IN_FLIGHT * size
        out["ring"][str(mib)] = {
            "batches": n,
            "bytes": sent,
            **{name: {"seconds": statistics.median(secs[name]), "corrupt": bad[name]} for name in names},
        }
        if log:
            r = out["ring"][str(mib)]
            log(f"ring {mib} MiB: tw/{ref} bandwidth {r[ref]['seconds'] / r['tensorwire']['seconds']:.2f}x (rank 0)")
        del sends, recvs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "transport" not in out:
        out["transport"] = {str(k): v for k, v in dict(getattr(tw, "transports", {})).items()}
    barrier()
    dist.destroy_process_group(tw)
    dist.destroy_process_group()
    write_result(args.result_dir, rank, out)


# -- the parent: figures from every rank's result


def pipelining_rows(results: dict) -> list[dict]:
    """Per schedule and size: each backend's step time (the slowest rank's median), the last stage's losses."""
    ranks = sorted(results)
    r0, last = results[ranks[0]], results[ranks[-1]]
    ref = r0["ref"]
    rows = []
    for key, v in r0["pipelining"].items():
        schedule, act = key.split("/")
        step = {name: max(results[r]["pipelining"][key][name]["step"] for r in ranks) for name in (ref, "tensorwire")}
        loss = {name: last["pipelining"][key][name]["loss"] for name in (ref, "tensorwire")}
        lr, lt = loss[ref], loss["tensorwire"]
        agree = lr is not None and lt is not None and abs(lr - lt) <= LOSS_RTOL * max(abs(lr), abs(lt), 1e-12)
        rows.append(
            {
                "schedule": schedule,
                "act": int(act),
                "mib": v["mib"],
                "step": step,
                "loss": loss,
                "agree": agree,
                "ratio": step["tensorwire"] / step[ref],
            }
        )
    return rows


def ring_rows(results: dict) -> list[dict]:
    """Per size: each backend's per-link GB/s (mean over the links), total GB/s (their sum), corrupt elements."""
    ranks = sorted(results)
    r0 = results[ranks[0]]
    ref = r0["ref"]
    rows = []
    for mib in sorted(r0["ring"], key=int):
        row: dict = {"mib": int(mib), "link": {}, "total": {}, "corrupt": {}}
        for name in (ref, "tensorwire"):
            per = [results[r]["ring"][mib]["bytes"] / results[r]["ring"][mib][name]["seconds"] / 1e9 for r in ranks]
            row["link"][name] = sum(per) / len(per)
            row["total"][name] = sum(per)
            row["corrupt"][name] = sum(results[r]["ring"][mib][name]["corrupt"] for r in ranks)
        row["ratio"] = row["total"]["tensorwire"] / row["total"][ref]
        rows.append(row)
    return rows


def checks(results: dict) -> list[tuple[bool, str]]:
    """Every target and correctness condition: (met, what)."""
    ref = results[min(results)]["ref"]
    out = []
    for r in pipelining_rows(results):
        what = f"pipelining {r['schedule']} {r['act']} MiB"
        out.append((r["ratio"] <= PIPE_TARGET, f"{what}: tw/{ref} step {r['ratio']:.3f}x (target <= {PIPE_TARGET})"))
        lr, lt = r["loss"][ref], r["loss"]["tensorwire"]
        out.append((r["agree"], f"{what}: final losses {ref} {lr} / tensorwire {lt} agree (rtol {LOSS_RTOL})"))
    for r in ring_rows(results):
        what = f"ring {r['mib']} MiB"
        out.append(
            (r["ratio"] >= RING_TARGET, f"{what}: tw/{ref} total GB/s {r['ratio']:.3f}x (target >= {RING_TARGET})")
        )
        for name, n in r["corrupt"].items():
            out.append((n == 0, f"{what}: {n} corrupt elements over {name}"))
    return out


def _command(args: argparse.Namespace) -> str:
    cmd = ["python", "bench/bench_multi_gpu.py"]
    if args.device != "cuda":
        cmd += ["--device", args.device]
    cmd += ["--nproc", str(args.nproc), "--parts", ",".join(args.parts)]
    cmd += ["--rounds", str(args.rounds), "--steps", str(args.steps), "--width", str(args.width)]
    cmd += ["--microbatches", str(args.microbatches), "--acts", ",".join(map(str, args.acts))]
    cmd += ["--ring-mib", ",".join(map(str, args.ring_mib))]
    if args.tree is not None:
        cmd += ["--tree", str(args.tree)]
    return shlex.join(cmd)


def report(results: dict, args: argparse.Namespace, wall: float, gpus: str, torch_version: str) -> str:
    r0 = results[min(results)]
    ref = r0["ref"]
    ref_name = {"nccl": "NCCL", "gloo": "gloo"}[ref]
    n = len(results)
    env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("TENSORWIRE_"))
    lines = [
        f"# torch.distributed on {n} x {args.device}: backend tensorwire vs {ref_name} ({args.machine})",
        "",
        f"Date {_dt.date.today().isoformat()}; machine {args.machine}; {gpus}; {os.cpu_count()} cores; "
        f"Python {platform.python_version()}; torch {torch_version}. tensorwire transport: "
        f"{sorted(set(r0['transport'].values())) or 'n/a'}; hot path {r0.get('hot_path', 'unknown')}. "
        f"Run took {wall:.0f} s.",
        f"One torchrun job, {n} ranks ({', '.join(results[r]['device'] for r in sorted(results))}); "
        f'{ref_name} default group and `new_group(backend="tensorwire")` over the same processes, measured in turns '
        f"(which goes first flips every round); NVLink multicast off "
        f"({', '.join(f'{k}={v}' for k, v in JOB_ENV.items())}). Command: `{_command(args)}`"
        + (f" with `{env}`" if env else "")
        + ".",
    ]
    pipe = pipelining_rows(results)
    if pipe:
        lines += [
            "",
            f"## torch.distributed.pipelining: {n} ranks, {args.microbatches} microbatches, width {args.width}, "
            f"{args.steps} steps after one warm-up",
            "",
            f"Stages: Linear+GELU blocks, the last a Linear; parameters and data {r0['dtype']} on {args.device}; SGD, "
            f"MSE loss on the last stage. `1f1b`: Schedule1F1B, {n} stages (one per rank); `interleaved-1f1b`: "
            f"ScheduleInterleaved1F1B, {2 * n} stages (rank r holds r and r + {n}). Step time: the median over the "
            f"steps (forward, backward, optimizer step, device synchronized) of the slowest rank. Final loss: the "
            f"last step's mean over microbatches, from rank {n - 1} (the last stage). Target: tw/{ref_name} "
            f"<= {PIPE_TARGET}.",
            "",
            f"| schedule | activation per microbatch | {ref_name} step | tensorwire step | tw/{ref_name} | "
            f"{ref_name} final loss | tensorwire final loss | losses agree |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for r in pipe:
            lr, lt = r["loss"][ref], r["loss"]["tensorwire"]
            lines.append(
                f"| {r['schedule']} | {r['mib']:.3g} MiB | {r['step'][ref] * 1e3:.2f} ms | "
                f"{r['step']['tensorwire'] * 1e3:.2f} ms | {r['ratio']:.2f}x | "
                f"{lr if lr is None else f'{lr:.6f}'} | {lt if lt is None else f'{lt:.6f}'} | "
                f"{'yes' if r['agree'] else 'NO'} |"
            )
    ring = ring_rows(results)
    if ring:
        batches = {mib: r0["ring"][mib]["batches"] for mib in r0["ring"]}
        lines += [
            "",
            f"## Ring: every rank streams to rank + 1 (mod {n}) and receives from rank - 1",
            "",
            f"`dist.batch_isend_irecv` of {IN_FLIGHT} sends and {IN_FLIGHT} receives ({IN_FLIGHT} messages in flight "
            f"per direction), waited for, repeated (batches per measurement: "
            f"{', '.join(f'{b} at {m} MiB' for m, b in sorted(batches.items(), key=lambda kv: int(kv[0])))}); "
            f"median of {args.rounds} measurements per backend, device synchronized. Per link: bytes one rank sent / "
            f"time, the mean over the {n} links; total: the sum over the links. Corrupt: received elements (all "
            f"ranks, all measurements) that differ from what the left neighbour sent. Target: tw/{ref_name} "
            f">= {RING_TARGET}.",
            "",
            f"| size | {ref_name} per link | tensorwire per link | {ref_name} total | tensorwire total | "
            f"tw/{ref_name} | corrupt {ref_name} | corrupt tensorwire |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for r in ring:
            lines.append(
                f"| {r['mib']} MiB | {r['link'][ref]:.2f} GB/s | {r['link']['tensorwire']:.2f} GB/s | "
                f"{r['total'][ref]:.2f} GB/s | {r['total']['tensorwire']:.2f} GB/s | {r['ratio']:.2f}x | "
                f"{r['corrupt'][ref]} | {r['corrupt']['tensorwire']} |"
            )
    lines += ["", "## Targets", ""]
    lines += [f"- {'met' if ok else '**missed**'}: {what}" for ok, what in checks(results)]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ref = results[min(results)]["ref"]
    pipe, ring = pipelining_rows(results), ring_rows(results)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    colour = {ref: "C0", "tensorwire": "C1"}  # a colour per backend, a line style per schedule (or figure)
    for schedule, style in zip(SCHEDULES, ("-o", "--s")):
        rows = [r for r in pipe if r["schedule"] == schedule]
        for name in (ref, "tensorwire") if rows else ():
            x, y = [r["mib"] for r in rows], [r["step"][name] * 1e3 for r in rows]
            ax1.plot(x, y, style, color=colour[name], label=f"{name} {schedule}")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("activation per microbatch (MiB)")
    ax1.set_ylabel("step time (ms)")
    ax1.set_title("pipelining: median step time")
    for name in (ref, "tensorwire") if ring else ():
        x = [r["mib"] for r in ring]
        ax2.plot(x, [r["total"][name] for r in ring], "-o", color=colour[name], label=f"{name} total")
        ax2.plot(x, [r["link"][name] for r in ring], "--s", color=colour[name], label=f"{name} per link")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("message size (MiB)")
    ax2.set_ylabel("GB/s")
    ax2.set_title(f"ring, {len(results)} ranks, {IN_FLIGHT} in flight")
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result-dir", default=None, help=argparse.SUPPRESS)  # (the workers' results, one file each)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--nproc", type=int, default=None, help="ranks (default: every GPU; 4 with --device cpu)")
    ap.add_argument("--parts", default=",".join(PARTS), help="which measurements (comma-separated)")
    ap.add_argument("--rounds", type=int, default=5, help="ring measurements per size and backend")
    ap.add_argument("--steps", type=int, default=8, help="timed pipeline steps per schedule, size and backend")
    ap.add_argument(
        "--acts", type=_mib_list, default=[1, 16, 64], help="activation MiB per microbatch (comma-separated)"
    )
    ap.add_argument("--ring-mib", type=_mib_list, default=[16, 256], help="ring message sizes in MiB (comma-separated)")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--check", action="store_true", help="exit 1 when a target is missed (each printed)")
    ap.add_argument("--dump-after", type=float, default=0, help="dump every thread's stack and exit after S s")
    ap.add_argument("--machine", default=None, help="names the machine in the report (default: gpu, or cpu)")
    ap.add_argument("--out", type=Path, default=None, help="markdown report (and .json, .png beside it)")
    ap.add_argument("--timeout", type=float, default=540, help="seconds before the job is stopped")
    add_tree_option(ap)
    args = ap.parse_args()
    args.parts = [p for p in args.parts.split(",") if p]
    if args.worker:
        worker(args)
        return
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown or not args.parts:
        ap.error(f"--parts {','.join(args.parts)!r}: choose one or more of {','.join(PARTS)}")
    for name in ("rounds", "steps", "width", "microbatches"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.timeout <= 0:
        ap.error(f"--timeout must be positive, got {args.timeout}")
    for name in ("acts", "ring_mib"):
        if not getattr(args, name) or min(getattr(args, name)) < 1:
            ap.error(f"--{name.replace('_', '-')}: sizes in MiB, each at least 1, got {getattr(args, name)}")
    if args.machine is None:
        args.machine = "gpu" if args.device == "cuda" else "cpu"
    import torch

    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.stderr.write("CUDA is not available here: nothing was measured (--device cpu runs a dry run)\n")
            raise SystemExit(2)
        ngpu = torch.cuda.device_count()
        if args.nproc is None:
            args.nproc = ngpu
        if ngpu < 2:
            sys.stderr.write(f"needs at least two GPUs (NCCL refuses two ranks on one GPU), found {ngpu}\n")
            raise SystemExit(2)
        if args.nproc > ngpu:
            ap.error(f"--nproc {args.nproc}: one rank per GPU, and this host has {ngpu}")
    elif args.nproc is None:
        args.nproc = 4
    if args.nproc < 2:
        ap.error(f"--nproc must be at least 2, got {args.nproc}")
    if "pipelining" in args.parts:
        problem = microbatch_problem(args.microbatches, args.nproc)
        if problem:
            ap.error(f"--microbatches {args.microbatches} on {args.nproc} ranks: {problem}")
    here = Path(__file__).resolve()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc)]
    cmd += [str(here), "--worker", "--device", args.device, "--parts", ",".join(args.parts)]
    cmd += ["--rounds", str(args.rounds), "--steps", str(args.steps), "--width", str(args.width)]
    cmd += ["--microbatches", str(args.microbatches), "--acts", ",".join(map(str, args.acts))]
    cmd += ["--ring-mib", ",".join(map(str, args.ring_mib)), "--dump-after", str(args.dump_after)]
    env = dict(with_tree(ap, args.tree, dict(os.environ)), **JOB_ENV)
    print(f"[multi bench] {args.nproc} ranks on {args.device}: {', '.join(args.parts)}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    proc, results = run_ranks(cmd, env, args.timeout)
    wall = time.monotonic() - t0
    if proc.returncode != 0 or len(results) != args.nproc:
        sys.stderr.write(proc.stdout[-6000:])
        raise SystemExit(f"benchmark job failed (exit {proc.returncode}, {len(results)} of {args.nproc} results)")
    text = report(results, args, wall, _gpus() if args.device == "cuda" else "no GPU", torch.__version__)
    sys.stdout.write(text)
    if args.out is not None:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
        try:
            plot(results, args.out.with_suffix(".png"))
        except ImportError:
            print("matplotlib missing: no plot", file=sys.stderr)
    missed = [what for ok, what in checks(results) if not ok]
    for what in missed:
        print(f"[multi bench] missed: {what}", file=sys.stderr)
    if args.check and missed:
        print(f"[multi bench] --check: {len(missed)} missed", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
