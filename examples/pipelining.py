#!/usr/bin/env python
"""torch.distributed.pipelining over backend "tensorwire" (or gloo, or NCCL): change one word.

::

    torchrun --standalone --nproc-per-node 2 examples/pipelining.py --backend tensorwire --check
    torchrun --standalone --nproc-per-node 2 examples/pipelining.py --backend gloo --schedule 1f1b
    torchrun --standalone --nproc-per-node 4 examples/pipelining.py --schedule interleaved1f1b --check
    torchrun --standalone --nproc-per-node 2 examples/pipelining.py --backend nccl      # one GPU per rank
    torchrun --standalone --nproc-per-node 2 examples/pipelining.py --device cuda --check   # tensorwire, GPUs

A stack of MLP blocks is cut into one stage per rank (two per rank for the
interleaved schedule) and trained with torch's own schedules. ``import
tensorwire`` is all it takes to make ``backend="tensorwire"`` known to torch:
point-to-point traffic (activations, gradients, shape inference) then runs on
tensorwire links, collectives on an inner gloo/NCCL group.

``--check`` also trains the whole model in every process and verifies that
each rank's parameters match that single-process training within 1e-5.
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

import tensorwire  # noqa: F401 - registers backend "tensorwire"

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved1f1b": ScheduleInterleaved1F1B}


def build_model(blocks: int, width: int) -> torch.nn.Sequential:
    torch.manual_seed(0)  # every rank builds the same model, then keeps its stages
    layers: list[torch.nn.Module] = []
    for _ in range(blocks):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["tensorwire", "gloo", "nccl"], default="tensorwire")
    ap.add_argument("--schedule", choices=sorted(SCHEDULES), default="gpipe")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--check", action="store_true", help="compare with single-process training (1e-5)")
    ap.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default=None,
        help="where the stages and their activations live (default: cuda for nccl, cpu otherwise); "
        "tensorwire takes either, one GPU per rank",
    )
    args = ap.parse_args()
    where = args.device or ("cuda" if args.backend == "nccl" else "cpu")
    if where == "cuda" and args.backend == "gloo":
        ap.error("--device cuda runs with --backend tensorwire or nccl")
    if where == "cpu" and args.backend == "nccl":
        ap.error("--backend nccl needs --device cuda")
    if where == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available here")

    device = torch.device("cpu")
    if where == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # --check compares with float32 training on the CPU
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    interleaved = args.schedule == "interleaved1f1b"
    n_stages = 2 * world if interleaved else world
    my_stages = [rank, rank + world] if interleaved else [rank]
    blocks = 2 * n_stages
    full = build_model(blocks, args.width)
    reference = copy.deepcopy(full) if args.check else None
    per = 2 * blocks // n_stages  # modules per stage (Linear + GELU per block)
    stages = [
        PipelineStage(torch.nn.Sequential(*full[s * per : (s + 1) * per]).to(device), s, n_stages, device)
        for s in my_stages
    ]
    loss_fn = torch.nn.MSELoss()
    schedule = SCHEDULES[args.schedule](
        stages if interleaved else stages[0], n_microbatches=args.microbatches, loss_fn=loss_fn
    )
    params = [p for st in stages for p in st.submod.parameters()]
    opt = torch.optim.SGD(params, lr=0.01)
    gen = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(args.batch, args.width, generator=gen), torch.randn(args.batch, args.width, generator=gen))
        for _ in range(args.steps)
    ]
    t0 = time.perf_counter()
    for x, y in data:
        opt.zero_grad()
        schedule.step(
            *((x.to(device),) if 0 in my_stages else ()),
            **({"target": y.to(device)} if n_stages - 1 in my_stages else {}),
        )
        opt.step()
    elapsed = time.perf_counter() - t0
    line = f"rank {rank}: {args.steps} {args.schedule} steps over {dist.group.WORLD.name()} in {elapsed:.3f} s"
    if reference is not None:
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.01)
        for x, y in data:
            ref_opt.zero_grad()
            loss = sum(
                loss_fn(reference(xm), ym) for xm, ym in zip(x.chunk(args.microbatches), y.chunk(args.microbatches))
            )
            (loss / args.microbatches).backward()
            ref_opt.step()
        worst = max(
            (a.detach().cpu() - b.detach()).abs().max().item()
            for s in my_stages
            for a, b in zip(full[s * per : (s + 1) * per].parameters(), reference[s * per : (s + 1) * per].parameters())
        )
        line += f"; max |param - single-process| = {worst:.2e}"
        if worst > 1e-5:
            dist.destroy_process_group()
            raise SystemExit(line + " -- MISMATCH")
        line += " (check passed)"
    print(line, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
