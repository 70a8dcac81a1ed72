#!/usr/bin/env python
"""GPipe-style pipeline parallelism over tensorwire links, one stage per rank.

::

    torchrun --standalone --nproc-per-node 2 examples/pipeline_parallel.py --steps 20 --microbatches 4 --check
    torchrun --standalone --nproc-per-node 4 examples/pipeline_parallel.py --transport tcp
    python examples/pipeline_parallel.py --reference --steps 20     # the same training in one process

The model (``--layers`` blocks of Linear+Tanh, the last one Linear only) is
built from a fixed seed on every rank; rank ``r`` keeps the contiguous blocks
of stage ``r``. Each step feeds one synthetic regression batch (fixed per
seed and step) cut into ``--microbatches`` microbatches:

1. forward every microbatch: receive the activation from the previous stage
   (``plan.inputs`` of this stage), run the stage, send the output forward
   (``plan.outputs``); the last stage computes the MSE loss (divided by the
   number of microbatches, so the step's loss is the full-batch mean);
2. backward every microbatch, in the same order: receive the gradient of the
   outputs (``plan.grads_of_outputs``), back-propagate, send the gradient of
   the inputs back (``plan.grads_of_inputs``);
3. each stage steps its own SGD optimizer (fixed learning rate).

The specs come from :func:`tensorwire.discover` on the stage with a
microbatch-shaped example input, so the two sides of every link are checked
against each other at negotiation (a stage boundary whose shapes disagree
fails on both ranks with ShapeMismatchError before any data moves). On the
wire, the activation ``output.<k>`` of stage r and ``input.<k>`` of stage r+1
are both called ``act.<k>``, their gradients ``grad.act.<k>``.

The last rank prints the loss of every step; rank 0 and the last rank print
their exchange throughput: bytes sent+received divided by the time spent in
``send``/``recv`` (which includes waiting for the peer: the pipeline bubble).

Flags worth knowing: ``--check`` (every rank also trains the whole model in
one process and compares its parameters and, on the last rank, the losses),
``--save-params DIR`` (``DIR/stage<r>.pt``: parameters by global qualified
name, the losses, the config), ``--ckpt-dir DIR --ckpt-every K`` (per-stage
checkpoints; after an elastic restart the ranks agree, through the bootstrap
store, on the newest step every stage has, and resume from it),
``--die-at-step N`` (rank ``--die-rank`` SIGKILLs itself at step N on the
first attempt only, to exercise ``torchrun --max-restarts``).

On CUDA hosts each stage runs on ``cuda:LOCAL_RANK`` (``tw.init`` selects it).
A tensorwire error (e.g. PeerLostError when the network is cut) is reported
as one ``tensorwire-failure rank=R error=Type`` line on stderr and the process
exits non-zero, so torchrun reports the failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import signal
import sys
import time
from collections import OrderedDict
from typing import Any, Sequence

try:
    import tensorwire as tw
except ImportError:  # running from a source checkout without installing
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import tensorwire as tw

import torch
from torch import nn

# ---------------------------------------------------------------------------
# configuration, model, data (shared with the reference run and bench/bench_pipeline.py)
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    d_in: int = 32
    hidden: int = 64
    d_out: int = 8
    layers: int = 8
    batch: int = 64
    microbatches: int = 4
    lr: float = 1.0
    seed: int = 0
    steps: int = 30

    def __post_init__(self) -> None:
        if self.layers < 1 or self.microbatches < 1 or self.steps < 0:
            raise SystemExit("--layers and --microbatches must be >= 1, --steps >= 0")
        if self.batch % self.microbatches:
            raise SystemExit(f"--batch {self.batch} must be a multiple of --microbatches {self.microbatches}")

    @property
    def microbatch(self) -> int:
        return self.batch // self.microbatches


def build_model(cfg: Config) -> nn.Sequential:
    """The full model, identical on every rank and in the reference: ``cfg.layers`` blocks."""
    dims = [cfg.d_in] + [cfg.hidden] * (cfg.layers - 1) + [cfg.d_out]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        blocks = []
        for i in range(cfg.layers):
            layers: list[nn.Module] = [nn.Linear(dims[i], dims[i + 1])]
            if i < cfg.layers - 1:
                layers.append(nn.Tanh())
            blocks.append(nn.Sequential(*layers))
    return nn.Sequential(*blocks)


def stage_bounds(n_blocks: int, n_stages: int, stage: int) -> tuple[int, int]:
    """Blocks ``[start, end)`` of a stage: contiguous, sizes differ by at most one."""
    if n_stages > n_blocks:
        raise SystemExit(f"{n_stages} stages need at least {n_stages} layers (--layers {n_blocks})")
    base, extra = divmod(n_blocks, n_stages)
    start = stage * base + min(stage, extra)
    return start, start + base + (1 if stage < extra else 0)


def build_stage(model: nn.Sequential, n_stages: int, stage: int) -> nn.Sequential:
    """Stage ``stage`` of ``model``; parameter names keep their global index (``"5.0.weight"``)."""
    start, end = stage_bounds(len(model), n_stages, stage)
    return nn.Sequential(OrderedDict((str(i), model[i]) for i in range(start, end)))


def batch_for_step(cfg: Config, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The synthetic batch of ``step``: inputs ~ N(0, 1), targets sin(x @ W) for a fixed W."""
    gw = torch.Generator().manual_seed(cfg.seed + 7919)
    w = torch.randn(cfg.d_in, cfg.d_out, generator=gw) / math.sqrt(cfg.d_in)
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    x = torch.randn(cfg.batch, cfg.d_in, generator=g)
    return x, torch.sin(x @ w)


def loss_fn(y: torch.Tensor, target: torch.Tensor, microbatches: int) -> torch.Tensor:
    return nn.functional.mse_loss(y, target) / microbatches


def train_reference(
    cfg: Config, *, start_step: int = 0, model: nn.Sequential | None = None
) -> tuple[nn.Sequential, list[float]]:
    """The same training in one process (same model, seed, microbatching and order); returns (model, losses)."""
    model = build_model(cfg) if model is None else model
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    losses = []
    for step in range(start_step, cfg.steps):
        x, t = batch_for_step(cfg, step)
        opt.zero_grad(set_to_none=True)
        outs = [
            loss_fn(model(xm), tm, cfg.microbatches)
            for xm, tm in zip(x.chunk(cfg.microbatches), t.chunk(cfg.microbatches))
        ]
        for out in outs:  # GPipe order: all forwards, then all backwards in microbatch order
            out.backward()
        opt.step()
        losses.append(float(sum(o.item() for o in outs)))
    return model, losses


def global_params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().cpu().clone() for name, p in module.named_parameters()}


# ---------------------------------------------------------------------------
# the exchange: what a stage says to its neighbours
# ---------------------------------------------------------------------------


def wire_name(name: str) -> str:
    """``output.k``/``input.k`` -> ``act.k``; ``grad.output.k``/``grad.input.k`` -> ``grad.act.k``."""
    for old, new in (
        ("grad.output.", "grad.act."),
        ("grad.input.", "grad.act."),
        ("output.", "act."),
        ("input.", "act."),
    ):
        if name.startswith(old):
            return new + name[len(old) :]
    raise ValueError(f"not an activation or its gradient: {name!r}")


def wire(specs: Sequence[tw.TensorSpec]) -> list[tw.TensorSpec]:
    return [s.with_name(wire_name(s.name)) for s in specs]


class Stats:
    """Bytes sent+received and seconds spent in send/recv, for one step and in total."""

    def __init__(self) -> None:
        self.bytes = 0
        self.seconds = 0.0
        self.total_bytes = 0
        self.total_seconds = 0.0
        self.steps = 0

    def add(self, nbytes: int, seconds: float) -> None:
        self.bytes += nbytes
        self.seconds += seconds

    def end_step(self) -> tuple[int, float]:
        out = (self.bytes, self.seconds)
        self.total_bytes += self.bytes
        self.total_seconds += self.seconds
        self.steps += 1
        self.bytes, self.seconds = 0, 0.0
        return out


class Comm:
    """The four exchanges of a stage. ``TensorwireComm`` here, a gRPC one in bench/bench_pipeline.py.

    ``recv_forward`` fills and returns this stage's preallocated input buffers
    of microbatch ``m`` (they must outlive the forward pass); ``recv_backward``
    may return transient tensors (used at once by backward).
    """

    stats: Stats

    def send_forward(self, tensors: Sequence[torch.Tensor]) -> None: ...
    def recv_forward(self, m: int) -> list[torch.Tensor]: ...
    def send_backward(self, tensors: Sequence[torch.Tensor]) -> None: ...
    def recv_backward(self) -> list[torch.Tensor]: ...
    def flush(self) -> None:
        """Wait for sends still in flight (end of a step). Comms whose sends block have nothing to do."""

    def close(self) -> None: ...


class TensorwireComm(Comm):
    """Links to the previous and next stage, negotiated from the stage's discovered plan."""

    def __init__(
        self,
        node: Any,
        plan: Any,
        *,
        n_stages: int,
        microbatches: int,
        device: torch.device,
        connect_timeout: float | None = None,
        link_name: str = "pipeline",
        overlap: bool | None = None,
    ) -> None:
        self.rank = node.rank
        self.device = device
        self.stats = Stats()
        # overlap: sends are isends, waited for at the end of the step (flush), so activation k moves
        # while microbatch k+1 is computed. Default: on for CUDA stages (the copy is the GPU's/NIC's
        # work), off on CPU (there a send is the CPU's own work; nothing to overlap it with).
        self.overlap = device.type == "cuda" if overlap is None else overlap
        self._pending: list[Any] = []
        self.prev = self.next = None
        # Link to the previous stage first, then the next: the links form a chain, so no rank waits in a cycle.
        # Every microbatch's activation is kept in its own receive slot until its backward pass:
        # microbatches + 2 slots per activation (two still posted for the next messages while a
        # whole step's are held), so recv_forward hands out slots, no copies.
        depth = microbatches + 2
        if self.rank > 0:
            self.prev = node.link(
                self.rank - 1,
                recv=wire(plan.inputs),
                send=wire(plan.grads_of_inputs),
                name=link_name,
                timeout=connect_timeout,
                depth={s.name: depth for s in wire(plan.inputs)},
            )
        if self.rank < n_stages - 1:
            self.next = node.link(
                self.rank + 1,
                send=wire(plan.outputs),
                recv=wire(plan.grads_of_outputs),
                name=link_name,
                timeout=connect_timeout,
            )
        self.act_names = [s.name for s in wire(plan.inputs)]
        self.out_names = [s.name for s in wire(plan.outputs)]
        self.grad_in_names = [s.name for s in wire(plan.grads_of_inputs)]
        self.grad_out_names = [s.name for s in wire(plan.grads_of_outputs)]
        # A CUDA activation staged through host memory (TCP between hosts) has one device slot: there the
        # inputs of every microbatch are copied into buffers of their own, allocated once.
        self.zero_copy = self.prev is not None and all(self.prev.depth(n) >= depth for n in self.act_names)
        self.inputs = (
            [
                [torch.empty(s.shape, dtype=s.torch_dtype, device=device) for s in plan.inputs]
                for _ in range(microbatches)
            ]
            if self.prev is not None and not self.zero_copy
            else []
        )

    @property
    def transports(self) -> dict[str, str]:
        out = {}
        if self.prev is not None:
            out["prev"] = self.prev.transport
        if self.next is not None:
            out["next"] = self.next.transport
        return out

    def _send(self, link: Any, names: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
        t0 = time.perf_counter()
        n = 0
        for name, t in zip(names, tensors):
            if self.overlap:
                self._pending.append(link.isend(name, t))  # t stays untouched until flush()
            else:
                link.send(name, t)
            n += t.numel() * t.element_size()
        self.stats.add(n, time.perf_counter() - t0)

    def send_forward(self, tensors: Sequence[torch.Tensor]) -> None:
        self._send(self.next, self.out_names, tensors)

    def recv_forward(self, m: int) -> list[torch.Tensor]:
        # recv returns once the bytes have landed; what it returns is ready for work queued on the
        # current stream (no device synchronization needed here)
        t0 = time.perf_counter()
        if self.zero_copy:  # the slots themselves, valid through this step's backward (depth)
            bufs = [self.prev.recv(name) for name in self.act_names]  # type: ignore[union-attr]
        else:
            bufs = self.inputs[m]
            for name, buf in zip(self.act_names, bufs):
                self.prev.recv(name, out=buf)  # type: ignore[union-attr]
        self.stats.add(sum(b.numel() * b.element_size() for b in bufs), time.perf_counter() - t0)
        return bufs

    def send_backward(self, tensors: Sequence[torch.Tensor]) -> None:
        self._send(self.prev, self.grad_in_names, tensors)

    def recv_backward(self) -> list[torch.Tensor]:
        t0 = time.perf_counter()
        out = [self.next.recv(name) for name in self.grad_out_names]  # type: ignore[union-attr]
        self.stats.add(sum(t.numel() * t.element_size() for t in out), time.perf_counter() - t0)
        return out

    def flush(self) -> None:
        if not self._pending:
            return
        t0 = time.perf_counter()
        pending, self._pending = self._pending, []
        for h in pending:
            h.wait()
        self.stats.add(0, time.perf_counter() - t0)

    def close(self) -> None:
        try:
            self.flush()
        finally:
            for link in (self.prev, self.next):
                if link is not None:
                    link.close()


# ---------------------------------------------------------------------------
# one pipeline step on one stage
# ---------------------------------------------------------------------------


def pipeline_step(
    stage: nn.Module,
    opt: torch.optim.Optimizer,
    comm: Comm,
    cfg: Config,
    step: int,
    *,
    first: bool,
    last: bool,
    device: torch.device,
    batch: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> float | None:
    """Forward all microbatches, backward all (same order), optimizer step. Returns the loss on the last stage.

    ``batch``: this step's ``(x, target)`` if the caller has it already (default: ``batch_for_step``).
    Sends still in flight are waited for before the optimizer step (``comm.flush``).
    """
    x, target = batch if batch is not None else batch_for_step(cfg, step)
    xs = x.to(device).chunk(cfg.microbatches) if first else None
    ts = target.to(device).chunk(cfg.microbatches) if last else None
    opt.zero_grad(set_to_none=True)
    leaves: list[list[torch.Tensor]] = []
    outs: list[list[torch.Tensor]] = []
    for m in range(cfg.microbatches):
        if first:
            inputs = [xs[m]]  # type: ignore[index]
        else:
            inputs = [b.detach().requires_grad_(b.is_floating_point()) for b in comm.recv_forward(m)]
        y = stage(*inputs)
        ys = list(y) if isinstance(y, (tuple, list)) else [y]
        if last:
            ys = [loss_fn(ys[0], ts[m], cfg.microbatches)]  # type: ignore[index]
        else:
            comm.send_forward(ys)
        leaves.append(inputs)
        outs.append(ys)
    loss = 0.0
    for m in range(cfg.microbatches):
        if last:
            outs[m][0].backward()
            loss += outs[m][0].item()
        else:
            torch.autograd.backward(outs[m], comm.recv_backward())
        if not first:
            comm.send_backward([t.grad for t in leaves[m] if t.is_floating_point()])
    flush = getattr(comm, "flush", None)  # comms written against the older interface have none
    if flush is not None:
        flush()
    opt.step()
    return loss if last else None


# ---------------------------------------------------------------------------
# checkpoints (per stage)
# ---------------------------------------------------------------------------


def _ckpt_path(d: str, rank: int, step: int) -> str:
    return os.path.join(d, f"stage{rank}-step{step:06d}.pt")


def ckpt_steps(d: str, rank: int) -> list[int]:
    if not d or not os.path.isdir(d):
        return []
    out = []
    pre = f"stage{rank}-step"
    for name in os.listdir(d):
        if name.startswith(pre) and name.endswith(".pt"):
            try:
                out.append(int(name[len(pre) : -3]))
            except ValueError:
                continue
    return sorted(out)


def save_ckpt(
    d: str, rank: int, step: int, stage: nn.Module, opt: torch.optim.Optimizer, losses: list[float], keep: int = 3
) -> None:
    os.makedirs(d, exist_ok=True)
    path = _ckpt_path(d, rank, step)
    tmp = path + f".tmp{os.getpid()}"
    torch.save({"step": step, "model": stage.state_dict(), "opt": opt.state_dict(), "losses": losses}, tmp)
    os.replace(tmp, path)  # atomic: a reader never sees a half-written checkpoint
    for old in ckpt_steps(d, rank)[:-keep]:
        try:
            os.remove(_ckpt_path(d, rank, old))
        except OSError:
            pass


def agree_resume_step(node: Any, d: str, timeout: float) -> int:
    """The newest step every stage has a checkpoint of (0: none), agreed through the bootstrap store.

    Keys live under the node's prefix, which includes the restart count, so a
    previous attempt's answer is never read.
    """
    from datetime import timedelta

    mine = ckpt_steps(d, node.rank)
    node.store.set(node.prefix + f"ckpt/{node.rank}", json.dumps(mine))
    keys = [node.prefix + f"ckpt/{r}" for r in range(node.world_size)]
    node.store.wait(keys, timedelta(seconds=timeout))
    common = set(mine)
    for key in keys:
        common &= set(json.loads(node.store.get(key).decode()))
    return max(common, default=0)


# ---------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=Config.steps)
    p.add_argument("--microbatches", type=int, default=Config.microbatches)
    p.add_argument("--batch", type=int, default=Config.batch, help="samples per step (split into microbatches)")
    p.add_argument("--layers", type=int, default=Config.layers, help="Linear(+Tanh) blocks, split across stages")
    p.add_argument("--hidden", type=int, default=Config.hidden)
    p.add_argument("--d-in", type=int, default=Config.d_in)
    p.add_argument("--d-out", type=int, default=Config.d_out)
    p.add_argument("--lr", type=float, default=Config.lr)
    p.add_argument("--seed", type=int, default=Config.seed)
    p.add_argument(
        "--transport", choices=["auto", "tcp", "ucx"], default=None, help="default: env TENSORWIRE_TRANSPORT, else auto"
    )
    p.add_argument(
        "--overlap",
        choices=["auto", "on", "off"],
        default="auto",
        help="send with isend and wait at the end of the step, overlapping transfers with the "
        "next microbatch (auto: on for CUDA stages)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="also train the whole model in one process and compare (params per stage, losses)",
    )
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--atol", type=float, default=1e-6)
    p.add_argument("--save-params", metavar="DIR", default=None, help="write DIR/stage<rank>.pt at the end")
    p.add_argument("--ckpt-dir", default=None, help="per-stage checkpoints; resume from the newest common one")
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument(
        "--die-at-step",
        type=int,
        default=None,
        help="rank --die-rank SIGKILLs itself at this step on the first attempt (restart count 0)",
    )
    p.add_argument("--die-rank", type=int, default=1)
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=None,
        help="seconds to wait for the neighbours at start-up (link negotiation, checkpoint agreement); "
        "default max(TENSORWIRE_TIMEOUT, 120). Transfers use TENSORWIRE_TIMEOUT",
    )
    p.add_argument("--reference", action="store_true", help="train in this single process (no torchrun)")
    return p.parse_args(argv)


def config_from(args: argparse.Namespace) -> Config:
    return Config(
        d_in=args.d_in,
        hidden=args.hidden,
        d_out=args.d_out,
        layers=args.layers,
        batch=args.batch,
        microbatches=args.microbatches,
        lr=args.lr,
        seed=args.seed,
        steps=args.steps,
    )


def say(msg: str, *, err: bool = False) -> None:
    """One line in one write: torchrun runs workers with ``python -u``, where ``print`` writes the text and
    the newline separately, so lines of concurrent ranks would interleave."""
    stream = sys.stderr if err else sys.stdout
    stream.write(msg + "\n")
    stream.flush()


def _mib(n: float) -> float:
    return n / (1 << 20)


def check_against_reference(
    cfg: Config, stage: nn.Module, losses: list[float], *, rank: int, last: bool, rtol: float, atol: float
) -> bool:
    ref_model, ref_losses = train_reference(cfg)
    ref = global_params(ref_model)
    worst, bad = 0.0, []
    for name, p in global_params(stage).items():
        diff = (p - ref[name]).abs().max().item() if p.numel() else 0.0
        worst = max(worst, diff)
        if not torch.allclose(p, ref[name], rtol=rtol, atol=atol):
            bad.append(name)
    loss_diff = max((abs(a - b) for a, b in zip(losses, ref_losses)), default=0.0) if last else 0.0
    loss_ok = (not last) or (
        len(losses) == len(ref_losses)
        and all(math.isclose(a, b, rel_tol=rtol, abs_tol=atol) for a, b in zip(losses, ref_losses))
    )
    ok = not bad and loss_ok
    say(
        f"[rank {rank}] check {'OK' if ok else 'FAILED'}: max |param - reference| = {worst:.3g}"
        + (f", max |loss - reference| = {loss_diff:.3g}" if last else "")
        + (f"; differing: {bad}" if bad else "")
    )
    return ok


def run_reference(args: argparse.Namespace) -> int:
    cfg = config_from(args)
    model, losses = train_reference(cfg)
    for step, loss in enumerate(losses):
        if step % args.log_every == 0 or step == len(losses) - 1:
            say(f"step {step:4d} loss {loss:.6f}")
    if args.save_params:
        os.makedirs(args.save_params, exist_ok=True)
        torch.save(
            {"params": global_params(model), "losses": losses, "config": dataclasses.asdict(cfg)},
            os.path.join(args.save_params, "reference.pt"),
        )
    return 0


def run_worker(args: argparse.Namespace) -> int:
    cfg = config_from(args)
    t_start = time.time()
    node = tw.init(transport=args.transport)
    rank, world = node.rank, node.world_size
    restart = node.torchrun.restart_count
    device = torch.device(node.device) if node.device is not None else torch.device("cpu")
    first, last = rank == 0, rank == world - 1
    comm: TensorwireComm | None = None
    try:
        model = build_model(cfg)
        stage = build_stage(model, world, rank).to(device)
        del model
        example_in = cfg.d_in if first else cfg.hidden
        plan = tw.discover(stage, torch.zeros(cfg.microbatch, example_in, device=device))
        opt = torch.optim.SGD(stage.parameters(), lr=cfg.lr)
        connect_timeout = args.connect_timeout if args.connect_timeout is not None else max(node.timeout, 120.0)
        comm = TensorwireComm(
            node,
            plan,
            n_stages=world,
            microbatches=cfg.microbatches,
            device=device,
            connect_timeout=connect_timeout,
            overlap=None if args.overlap == "auto" else args.overlap == "on",
        )
        start, losses = 0, []
        if args.ckpt_dir:
            start = agree_resume_step(node, args.ckpt_dir, connect_timeout)
            if start:
                state = torch.load(_ckpt_path(args.ckpt_dir, rank, start), map_location=device)
                stage.load_state_dict(state["model"])
                opt.load_state_dict(state["opt"])
                losses = list(state["losses"])
        say(
            f"[rank {rank}] attempt {restart} prefix {node.prefix} host {node.host} "
            f"links {comm.transports} overlap {comm.overlap} stage blocks {list(stage_bounds(cfg.layers, world, rank))} "
            f"plan via {plan.method}; start at step {start}; ready in {time.time() - t_start:.1f}s"
        )
        for step in range(start, cfg.steps):
            if args.die_at_step is not None and step == args.die_at_step and rank == args.die_rank and restart == 0:
                say(f"[rank {rank}] --die-at-step {step}: SIGKILL self (attempt {restart})")
                os.kill(os.getpid(), signal.SIGKILL)
            loss = pipeline_step(stage, opt, comm, cfg, step, first=first, last=last, device=device)
            nbytes, secs = comm.stats.end_step()
            if last:
                losses.append(loss)  # type: ignore[arg-type]
            if step % args.log_every == 0 or step == cfg.steps - 1:
                if last:
                    say(f"step {step:4d} loss {loss:.6f}")
                if first or last:
                    rate = _mib(nbytes) / secs if secs > 0 else float("inf")
                    say(
                        f"[rank {rank}] step {step:4d} exchange {_mib(nbytes):.3f} MiB in {secs * 1e3:.2f} ms "
                        f"= {rate:.1f} MiB/s"
                    )
            if args.ckpt_dir and args.ckpt_every > 0 and (step + 1) % args.ckpt_every == 0:
                save_ckpt(args.ckpt_dir, rank, step + 1, stage, opt, losses)
        st = comm.stats
        if st.steps and (first or last):
            rate = _mib(st.total_bytes) / st.total_seconds if st.total_seconds > 0 else float("inf")
            say(
                f"[rank {rank}] summary: {st.steps} steps, {_mib(st.total_bytes):.3f} MiB exchanged in "
                f"{st.total_seconds:.3f} s of send+recv = {rate:.1f} MiB/s "
                f"({st.total_seconds / st.steps * 1e3:.2f} ms/step) over {comm.transports}"
            )
        if args.save_params:
            os.makedirs(args.save_params, exist_ok=True)
            torch.save(
                {
                    "params": global_params(stage),
                    "losses": losses if last else [],
                    "stage": rank,
                    "world": world,
                    "attempt": restart,
                    "transports": comm.transports,
                    "overlap": comm.overlap,
                    "config": dataclasses.asdict(cfg),
                },
                os.path.join(args.save_params, f"stage{rank}.pt"),
            )
        ok = True
        if args.check:
            ok = check_against_reference(cfg, stage, losses, rank=rank, last=last, rtol=args.rtol, atol=args.atol)
        return 0 if ok else 3
    except tw.TensorWireError as exc:
        say(
            f"tensorwire-failure rank={rank} error={type(exc).__name__} t={time.time():.3f} attempt={restart}: {exc}",
            err=True,
        )
        raise
    finally:
        if comm is not None:
            comm.close()
        node.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.reference:
        return run_reference(args)
    return run_worker(args)


if __name__ == "__main__":
    try:  # torchrun writes the exception (type, message, traceback) into its error report
        from torch.distributed.elastic.multiprocessing.errors import record
    except ImportError:  # pragma: no cover

        def record(f):  # type: ignore[no-redef]
            return f

    sys.exit(record(main)())
