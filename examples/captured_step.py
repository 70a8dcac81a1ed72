#!/usr/bin/env python
"""A two-stage pipeline training step, point-to-point messages included, captured once in a CUDA graph.

::

    torchrun --standalone --nproc-per-node 2 examples/captured_step.py --backend tensorwire --check
    torchrun --standalone --nproc-per-node 2 examples/captured_step.py --microbatches 8 --hidden 2048
    torchrun --standalone --nproc-per-node 2 examples/captured_step.py --graphed-callables --check
    torchrun --standalone --nproc-per-node 2 examples/captured_step.py --eager          # no capture at all
    torchrun --standalone --nproc-per-node 2 examples/captured_step.py --backend nccl   # one GPU per rank

A small MLP (four Linear layers with Tanh between them) is built from one seed on both ranks and cut in two:
rank 0 keeps the first two layers (stage 0), rank 1 the last two (stage 1). One training step:

1. stage 0 runs its half on each of ``--microbatches`` microbatches and sends every activation to rank 1
   (``dist.batch_isend_irecv``: all of them in flight at once);
2. stage 1 receives them into buffers allocated once, runs its half and a squared-error loss, back-propagates
   and sends the gradient of every activation back to rank 0, again all at once;
3. stage 0 receives the gradients and back-propagates them; each rank steps its own SGD optimizer.

The step reads its data from static tensors (rank 0: the inputs, rank 1: the targets). After ``WARMUP`` eager
steps on a side stream (torch asks for that before capturing, and tensorwire needs the step's messages to have
run once), each rank captures one step in ``torch.cuda.graph`` -- messages, ``wait()`` calls, backward pass
and optimizer step -- and replays it for the remaining steps, copying the step's fresh batch into the static
tensor before each replay. Nothing in the step is recomputed on the host: a replay costs one launch.

With ``--graphed-callables`` the messages and the optimizer stay eager and only each stage's forward and
backward pass are graphed (``torch.cuda.make_graphed_callables``, one callable per microbatch sharing the
stage's parameters, called in the order they were captured: forwards first, backwards in reverse).

Afterwards the same steps run again from the same seed without any capture, in the same job; both runs'
times per step are printed (the first ``WARMUP`` steps not counted). ``--check`` compares the parameters of
both stages after the two runs and exits with code 1 when they differ by more than ``--tolerance``.

``--backend tensorwire`` runs two ranks on one GPU as well as on two (the device is ``LOCAL_RANK`` modulo the
number of GPUs); ``--backend nccl`` needs one GPU per rank.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

try:
    import tensorwire  # registers backend "tensorwire"
except ImportError:  # running from a source checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import tensorwire  # noqa: F401

PROG = os.path.basename(__file__)
WARMUP = 3  # eager steps before the capture (torch's CUDA-graph docs use 3 as well)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOLERANCE = {"float32": 1e-5, "bfloat16": 1e-2}


def fail(message: str) -> NoReturn:
    """One line on stderr, exit code 2: a usage problem, not a crash."""
    print(f"{PROG}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def build_stage(rank: int, hidden: int, seed: int) -> nn.Sequential:
    """Both ranks build the whole model from the same seed and keep their half of it."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(hidden, hidden),
        nn.Tanh(),
        nn.Linear(hidden, hidden),
        nn.Tanh(),
        nn.Linear(hidden, hidden),
        nn.Tanh(),
        nn.Linear(hidden, hidden),
    )
    return model[:4] if rank == 0 else model[4:]


def make_data(rank: int, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    """One batch per step for this rank: the inputs (rank 0) or the targets (rank 1) of a fixed teacher."""
    g = torch.Generator().manual_seed(args.seed + 1)
    rows, h = args.microbatches * args.batch, args.hidden
    teacher = torch.randn(h, h, generator=g) / h**0.5
    out = []
    for _ in range(args.steps):
        x = torch.randn(rows, h, generator=g)
        out.append((x if rank == 0 else torch.tanh(x @ teacher)).to(device=device, dtype=dtype))
    return out


class _Shared(nn.Module):
    """A view of the stage for one microbatch: make_graphed_callables graphs each of these separately."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x)


class Stage:
    """One rank's half of the step, on tensors allocated once (what a captured graph needs)."""

    def __init__(self, rank: int, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> None:
        self.rank, self.peer, self.micro = rank, 1 - rank, args.microbatches
        self.module = build_stage(rank, args.hidden, args.seed).to(device=device, dtype=dtype)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=args.lr)
        shape = (args.batch, args.hidden)
        # rank 0: the step's inputs and the gradients it receives; rank 1: targets and received activations
        self.data = torch.zeros(self.micro * args.batch, args.hidden, device=device, dtype=dtype)
        self.received = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(self.micro)]
        self.fns: list[nn.Module] = [self.module] * self.micro
        self.loss: torch.Tensor | None = None

    def graph_callables(self) -> None:
        """Graph the stage's forward and backward once per microbatch (--graphed-callables)."""
        wrappers = tuple(_Shared(self.module) for _ in range(self.micro))
        sample = tuple((torch.randn_like(self.received[0]).requires_grad_(self.rank == 1),) for _ in range(self.micro))
        # The parameters' gradient-accumulation nodes are made on the capture stream and stay alive with the
        # graphs, so torch warns that their stream differs from the caller's: expected here (autograd orders
        # the two streams; --check compares the result with eager training).
        quiet = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
        if quiet is not None:
            quiet(False)
        self.fns = list(torch.cuda.make_graphed_callables(wrappers, sample))

    def load(self, batch: torch.Tensor) -> None:
        self.data.copy_(batch)

    def _exchange(self, op, tensors: list[torch.Tensor]) -> None:
        # wait() on every operation: eagerly it orders the stream after the message, in a capture it records
        # that order (tensorwire and NCCL alike need every captured operation waited on inside the capture)
        for work in dist.batch_isend_irecv([dist.P2POp(op, t, self.peer) for t in tensors]):
            work.wait()

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        if self.rank == 0:
            outs = [fn(x) for fn, x in zip(self.fns, self.data.chunk(self.micro))]
            self._exchange(dist.isend, [o.detach() for o in outs])
            self._exchange(dist.irecv, self.received)
            for m in reversed(range(self.micro)):  # (graphed callables: backwards in reverse capture order)
                outs[m].backward(self.received[m])
        else:
            self._exchange(dist.irecv, self.received)
            acts = [a.detach().requires_grad_() for a in self.received]
            losses = [
                F.mse_loss(fn(a), y) / self.micro for fn, a, y in zip(self.fns, acts, self.data.chunk(self.micro))
            ]
            for m in reversed(range(self.micro)):
                losses[m].backward()
            grads = [a.grad for a in acts]
            assert all(g is not None for g in grads)
            self._exchange(dist.isend, [g.contiguous() for g in grads if g is not None])
            self.loss = torch.stack([loss.detach() for loss in losses]).sum()
        self.opt.step()


def train(
    rank: int, args: argparse.Namespace, device: torch.device, dtype: torch.dtype, mode: str, data: list[torch.Tensor]
) -> tuple[Stage, float, torch.cuda.CUDAGraph | None]:
    """Train ``args.steps`` steps in ``mode`` (eager, captured, graphed); (stage, seconds per timed step, graph)."""
    stage = Stage(rank, args, device, dtype)
    graph = None
    if mode == "graphed":
        stage.graph_callables()
    if mode == "captured":
        # warm-up on a side stream, as torch's CUDA-graph docs ask; these are real training steps
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(WARMUP):
                stage.load(data[i])
                stage.step()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # records the step; nothing runs, the parameters stay as they are
            stage.step()
        torch.cuda.synchronize()
    else:
        for i in range(WARMUP):
            stage.load(data[i])
            stage.step()
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(WARMUP, args.steps):
        stage.load(data[i])  # fresh data into the static tensor, then the step
        if graph is not None:
            graph.replay()
        else:
            stage.step()
    torch.cuda.synchronize()
    return stage, (time.perf_counter() - t0) / (args.steps - WARMUP), graph


def exchange_max(rank: int, value: float, device: torch.device) -> float:
    """The larger of this rank's value and its peer's (a blocking send/recv pair: no collective needed)."""
    mine = torch.tensor([value], dtype=torch.float32, device=device)
    theirs = torch.empty_like(mine)
    if rank == 0:
        dist.send(mine, 1)
        dist.recv(theirs, 1)
    else:
        dist.recv(theirs, 0)
        dist.send(mine, 0)
    return max(value, float(theirs.item()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=["tensorwire", "nccl"], default="tensorwire", help="(default: tensorwire)")
    ap.add_argument("--steps", type=int, default=50, help=f"training steps, the first {WARMUP} eager (default: 50)")
    ap.add_argument("--microbatches", type=int, default=4, help="messages per direction and step (default: 4)")
    ap.add_argument("--batch", type=int, default=32, help="rows per microbatch (default: 32)")
    ap.add_argument("--hidden", type=int, default=1024, help="width of every layer (default: 1024)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="(default: float32)")
    ap.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default: 0.05)")
    ap.add_argument("--seed", type=int, default=0, help="model and data seed (default: 0)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--eager", action="store_true", help="no capture: train eagerly only")
    mode.add_argument(
        "--graphed-callables",
        action="store_true",
        help="graph only each stage's forward and backward (torch.cuda.make_graphed_callables); "
        "messages and optimizer stay eager",
    )
    ap.add_argument(
        "--check",
        action="store_true",
        help="compare both stages' parameters with the eager run of the same steps; exit 1 when they differ",
    )
    ap.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="largest allowed |captured - eager| of any parameter (default: 1e-5 float32, 1e-2 bfloat16)",
    )
    ap.add_argument(
        "--stall-s",
        type=float,
        default=0.0,
        help="print every thread's stack and exit if the run takes longer than this many seconds (0: never)",
    )
    args = ap.parse_args()
    if args.steps <= WARMUP:
        fail(f"--steps must be more than the {WARMUP} warm-up steps")
    if not 1 <= args.microbatches <= 256:  # (tensorwire keeps 256 captured messages per tag and direction)
        fail("--microbatches must be between 1 and 256")
    if args.batch < 1 or args.hidden < 1:
        fail("--batch and --hidden must be positive")
    if args.check and args.eager:
        fail("--check compares a captured run with an eager one: leave out --eager")
    if not torch.cuda.is_available():
        fail("no CUDA GPU here: CUDA graphs need one (tensorwire runs both ranks on one GPU, nccl one per rank)")
    if "RANK" not in os.environ:
        fail(f"run it with torchrun and two processes: torchrun --standalone --nproc-per-node 2 {sys.argv[0]}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != 2:
        fail(f"two ranks, one per pipeline stage: run it with --nproc-per-node 2 (this job has {world})")
    ngpu = torch.cuda.device_count()
    if args.backend == "nccl" and ngpu < world:
        fail(
            f"--backend nccl needs one GPU per rank ({world}); this host has {ngpu}. "
            "--backend tensorwire runs both ranks on one GPU"
        )
    if args.stall_s > 0:  # a hung replay shows where each thread waits
        faulthandler.dump_traceback_later(args.stall_s, exit=True)

    rank = int(os.environ["RANK"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % ngpu)
    torch.cuda.set_device(device)  # before the group: tensorwire then picks CUDA links for the pair
    dtype = DTYPES[args.dtype]
    dist.init_process_group(args.backend)
    # one blocking round trip first: every pair's first message outside any capture and outside a batch
    ping = torch.zeros(1, device=device)
    if rank == 0:
        dist.send(ping, 1)
        dist.recv(ping, 1)
    else:
        dist.recv(ping, 0)
        dist.send(ping, 0)
    torch.cuda.synchronize()

    data = make_data(rank, args, device, dtype)
    if rank == 0:
        print(
            f"backend {args.backend}, 2 ranks on {min(world, ngpu)} GPU(s) ({torch.cuda.get_device_name(device)}), "
            f"{args.microbatches} microbatch(es) of {args.batch} x {args.hidden} {args.dtype}, {args.steps} steps",
            flush=True,
        )
    kind = "graphed" if args.graphed_callables else "captured"
    runs = ["eager"] if args.eager else [kind, "eager"]
    stages, times, graphs = {}, {}, []
    for run in runs:
        stages[run], times[run], graph = train(rank, args, device, dtype, run, data)
        graphs.append(graph)
    timed = args.steps - WARMUP
    line = f"rank {rank}: " + "; ".join(f"{run} {times[run] * 1e3:.3f} ms/step" for run in runs)
    if not args.eager:
        line += f" (over {timed} steps; {kind}/eager {times[kind] / times['eager']:.2f}x)"
    loss = stages[runs[0]].loss
    if loss is not None:
        line += f"; final loss {loss.item():.6f}"
    print(line, flush=True)

    rc = 0
    if args.check:
        tol = args.tolerance if args.tolerance is not None else TOLERANCE[args.dtype]
        diff = max(
            (p.detach().float() - q.detach().float()).abs().max().item()
            for p, q in zip(stages[kind].module.parameters(), stages["eager"].module.parameters())
        )
        worst = exchange_max(rank, diff, device)
        ok = worst <= tol
        if rank == 0:
            print(
                f"check: max |{kind} - eager| over both stages' parameters after {args.steps} steps = {worst:.3e} "
                f"(tolerance {tol:g}): " + ("CHECK PASSED" if ok else "CHECK FAILED"),
                flush=True,
            )
        if not ok:
            if rank == 0:
                print(f"{PROG}: the {kind} run's parameters differ from the eager run's", file=sys.stderr)
            rc = 1
    del graphs
    torch.cuda.synchronize()
    dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())
