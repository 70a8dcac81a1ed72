#!/usr/bin/env python
"""The pipeline example's exchange on GPUs: tensorwire vs torch.distributed (NCCL) vs gRPC, one run.

Run under torchrun, one stage per GPU (2 stages)::

    torchrun --standalone --nproc-per-node 2 bench/bench_pipeline_gpu.py \\
        --hidden 8192 --batch 4096 --microbatches 4 --steps 10 --out-md results.md --out-json results.json

Without CUDA it runs the same code on CPU with gloo (a dry run of the script,
not a measurement to report). Per variant — tensorwire (``TENSORWIRE_TRANSPORT``,
default auto: UCX for CUDA slots), NCCL ``send``/``recv`` (gloo on CPU), gRPC
(device→host copy, raw bytes in unary calls, host→device copy) — it measures:

- **exchange**: one GPipe step's messages with no compute (stage 0 sends M
  activations then receives M gradients; stage 1 mirrors) — time per step and
  GB/s of the link (bytes moved both ways / step time);
- **train**: real training steps of ``examples/pipeline_parallel.py``'s model
  through that exchange — step time, and the final loss (the variants must
  agree: the same bytes arrive whichever way they travel).

Every timed region ends with a device synchronize, so a variant cannot look
faster by leaving work queued.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))  # the repository (tensorwire, examples) when not installed


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class NcclComm:
    """torch.distributed send/recv (NCCL on GPU, gloo on CPU) into preallocated buffers.

    ``overlap=False``: every message is complete (device synchronized) before the next one starts --
    the same contract as a blocking tensorwire ``send``/``recv``. ``overlap=True``: NCCL as people use it
    in pipelines -- ``isend``s waited for in ``flush``, receives left stream-ordered (no host sync).
    """

    def __init__(self, ex: Any, plan: Any, *, rank: int, microbatches: int, device: Any) -> None:
        import torch

        self.stats = ex.Stats()
        self.rank = rank
        self.device = device
        self.overlap = False
        self._works: list[Any] = []
        self.inputs = (
            [
                [torch.empty(s.shape, dtype=s.torch_dtype, device=device) for s in plan.inputs]
                for _ in range(microbatches)
            ]
            if rank > 0
            else []
        )
        self.grad_bufs = [torch.empty(s.shape, dtype=s.torch_dtype, device=device) for s in plan.grads_of_outputs]

    def _send(self, tensors: Sequence[Any], peer: int) -> None:
        import torch.distributed as dist

        t0 = time.perf_counter()
        n = 0
        for t in tensors:
            if self.overlap:
                self._works.append(dist.isend(t.detach().contiguous(), peer))
            else:
                dist.send(t.detach().contiguous(), peer)
            n += t.numel() * t.element_size()
        if not self.overlap:
            _sync(self.device)
        self.stats.add(n, time.perf_counter() - t0)

    def _recv(self, bufs: Sequence[Any], peer: int) -> list[Any]:
        import torch.distributed as dist

        t0 = time.perf_counter()
        for b in bufs:
            dist.recv(b, peer)
        if not self.overlap:
            _sync(self.device)
        self.stats.add(sum(b.numel() * b.element_size() for b in bufs), time.perf_counter() - t0)
        return list(bufs)

    def send_forward(self, tensors: Sequence[Any]) -> None:
        self._send(tensors, self.rank + 1)

    def recv_forward(self, m: int) -> list[Any]:
        return self._recv(self.inputs[m], self.rank - 1)

    def send_backward(self, tensors: Sequence[Any]) -> None:
        self._send(tensors, self.rank - 1)

    def recv_backward(self) -> list[Any]:
        return self._recv(self.grad_bufs, self.rank + 1)

    def flush(self) -> None:
        t0 = time.perf_counter()
        works, self._works = self._works, []
        for w in works:
            w.wait()
        self.stats.add(0, time.perf_counter() - t0)

    def close(self) -> None:
        self.flush()


class DeviceGrpcComm:
    """bench_pipeline.GrpcComm (host bytes) plus the device<->host copies a gRPC user must make."""

    def __init__(self, ex: Any, bp: Any, node: Any, plan: Any, *, microbatches: int, device: Any) -> None:
        import torch

        self.inner = bp.GrpcComm(node, plan, n_stages=2, microbatches=microbatches, tag="gpu")
        self.stats = ex.Stats()
        self.device = device
        self.dev_inputs = (
            [
                [torch.empty(s.shape, dtype=s.torch_dtype, device=device) for s in plan.inputs]
                for _ in range(microbatches)
            ]
            if node.rank > 0
            else []
        )
        self.dev_grads = [torch.empty(s.shape, dtype=s.torch_dtype, device=device) for s in plan.grads_of_outputs]
        self.overlap = False  # not offered: gRPC's unary calls block

    def _timed(self, fn: Any, nbytes: int) -> Any:
        t0 = time.perf_counter()
        out = fn()
        _sync(self.device)
        self.stats.add(nbytes, time.perf_counter() - t0)
        return out

    def send_forward(self, tensors: Sequence[Any]) -> None:
        n = sum(t.numel() * t.element_size() for t in tensors)
        self._timed(lambda: self.inner.send_forward([t.detach().cpu() for t in tensors]), n)

    def send_backward(self, tensors: Sequence[Any]) -> None:
        n = sum(t.numel() * t.element_size() for t in tensors)
        self._timed(lambda: self.inner.send_backward([t.detach().cpu() for t in tensors]), n)

    def recv_forward(self, m: int) -> list[Any]:
        def go() -> list[Any]:
            for d, h in zip(self.dev_inputs[m], self.inner.recv_forward(m)):
                d.copy_(h)
            return self.dev_inputs[m]

        return self._timed(go, sum(b.numel() * b.element_size() for b in self.dev_inputs[m]))

    def recv_backward(self) -> list[Any]:
        def go() -> list[Any]:
            for d, h in zip(self.dev_grads, self.inner.recv_backward()):
                d.copy_(h)
            return self.dev_grads

        return self._timed(go, sum(b.numel() * b.element_size() for b in self.dev_grads))

    def flush(self) -> None:
        pass  # every unary call has returned (the peer answered) by the time send_* returns

    def close(self) -> None:
        self.inner.close()


def exchange(comm: Any, cfg: Any, rank: int, payload: dict[str, list[Any]], device: Any) -> float:
    """One GPipe step's messages, no compute; rank's wall seconds including the final flush + device sync."""
    import bench_pipeline as bp

    t0 = time.perf_counter()
    bp.exchange_step(comm, None, cfg, rank, payload)
    comm.flush()
    _sync(device)
    return time.perf_counter() - t0


def device_batches(ex: Any, cfg: Any, n: int, device: Any) -> list[tuple[Any, Any]]:
    """The example's batches of steps 0..n-1 (same inputs; targets computed on ``device``), made once so
    that host-side data generation does not sit inside the timed steps."""
    import math

    import torch

    gw = torch.Generator().manual_seed(cfg.seed + 7919)
    w = (torch.randn(cfg.d_in, cfg.d_out, generator=gw) / math.sqrt(cfg.d_in)).to(device)
    out = []
    for step in range(n):
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        x = torch.randn(cfg.batch, cfg.d_in, generator=g).to(device)
        out.append((x, torch.sin(x @ w)))
    return out


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import bench_pipeline as bp
    import tensorwire as tw

    ex = bp.load_example()
    node = tw.init()
    rank = node.rank
    if node.world_size != 2:
        raise SystemExit("run with --nproc-per-node 2 (one stage per GPU)")
    device = torch.device(node.device) if node.device is not None else torch.device("cpu")
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")
    cfg = ex.Config(
        d_in=args.hidden,
        hidden=args.hidden,
        d_out=args.hidden,
        layers=args.layers,
        batch=args.batch,
        microbatches=args.microbatches,
        steps=args.steps,
        lr=args.lr,
    )
    first, last = rank == 0, rank == 1
    variants = args.variants.split(",")
    # Every variant is built up front and the measurements interleave them (A B C, A B C, ...), so a
    # change of load on the host weighs on all of them alike.
    setups: dict[str, dict[str, Any]] = {}
    try:
        for variant in variants:
            stage = ex.build_stage(ex.build_model(cfg), 2, rank).to(device)
            plan = tw.discover(stage, torch.zeros(cfg.microbatch, cfg.hidden, device=device))
            if variant in ("tensorwire", "tensorwire-blocking"):
                comm = ex.TensorwireComm(
                    node, plan, n_stages=2, microbatches=cfg.microbatches, device=device, link_name=f"bench-{variant}"
                )
                how = comm.transports
            elif variant == "nccl":
                comm = NcclComm(ex, plan, rank=rank, microbatches=cfg.microbatches, device=device)
                how = dist.get_backend()
            elif variant == "grpc":
                comm = DeviceGrpcComm(ex, bp, node, plan, microbatches=cfg.microbatches, device=device)
                how = "grpc unary bytes + D2H/H2D"
            else:
                raise SystemExit(f"unknown variant {variant!r}")
            setups[variant] = {
                "stage": stage,
                "plan": plan,
                "comm": comm,
                "how": str(how),
                "opt": torch.optim.SGD(stage.parameters(), lr=cfg.lr),
            }
        plan = setups[variants[0]]["plan"]
        payload = {
            "act": [torch.randn(s.shape, device=device).to(s.torch_dtype) for s in plan.outputs],
            "grad": [torch.randn(s.shape, device=device).to(s.torch_dtype) for s in plan.grads_of_inputs],
        }
        step_bytes = cfg.microbatches * sum(s.nbytes for s in plan.outputs) * 2
        modes = {"blocking": False, "overlapped": True}
        ex_times: dict[tuple[str, str], list[float]] = {}
        for i in range(args.warmup + args.steps):
            for mode, overlap in modes.items():
                for variant in variants:
                    comm = setups[variant]["comm"]
                    if variant == "grpc" and overlap:
                        continue  # one mode only: each unary call returns after the peer's answer
                    if variant == "tensorwire-blocking":
                        continue  # the same exchange as tensorwire's: it differs in training only
                    comm.overlap = overlap
                    dist.barrier()
                    t = exchange(comm, cfg, rank, payload, device)
                    if i >= args.warmup:
                        ex_times.setdefault((variant, mode), []).append(t)
        batches = device_batches(ex, cfg, args.warmup + args.steps, device)
        train_times: dict[str, list[float]] = {v: [] for v in variants}
        losses: dict[str, Any] = {}
        for step in range(args.warmup + args.steps):
            for variant in variants:
                su = setups[variant]
                # the example's CUDA default: isend, flush per step; tensorwire-blocking: send, as on CPU
                su["comm"].overlap = variant not in ("grpc", "tensorwire-blocking")
                dist.barrier()
                _sync(device)
                t0 = time.perf_counter()
                out = ex.pipeline_step(
                    su["stage"],
                    su["opt"],
                    su["comm"],
                    cfg,
                    step,
                    first=first,
                    last=last,
                    device=device,
                    batch=batches[step],
                )
                _sync(device)
                if step >= args.warmup:
                    train_times[variant].append(time.perf_counter() - t0)
                if last:
                    losses[variant] = out
        results: dict[str, Any] = {}
        for variant in variants:
            su = setups[variant]
            su["comm"].close()
            r: dict[str, Any] = {
                "how": su["how"],
                "step_bytes": step_bytes,
                "train_step_ms": statistics.median(train_times[variant]) * 1e3,
                "train_steps_ms": [t * 1e3 for t in train_times[variant]],
                "final_loss": losses.get(variant),
            }
            for mode in modes:
                ts = ex_times.get((variant, mode))
                if ts:
                    med = statistics.median(ts)
                    r[f"exchange_{mode}_ms"] = med * 1e3
                    r[f"exchange_{mode}_gbps"] = step_bytes / med / 1e9
            results[variant] = r
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, results)
        if rank == 0:
            report(gathered, args, device)
    finally:
        setups.clear()
        dist.destroy_process_group()
        node.close()


def report(per_rank: list[dict[str, Any]], args: argparse.Namespace, device: Any) -> None:
    import torch

    r0, r1 = per_rank
    msg = args.batch // args.microbatches * args.hidden * 4
    gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (dry run)"

    def cell(r: dict[str, Any], mode: str) -> str:
        ms = r.get(f"exchange_{mode}_ms")
        return "n/a" if ms is None else f"{ms:.2f} ms / {r[f'exchange_{mode}_gbps']:.1f} GB/s"

    lines = [
        f"# Pipeline exchange on {gpu}: tensorwire vs NCCL vs gRPC",
        "",
        f"2 stages (one per {'GPU' if device.type == 'cuda' else 'process'}), model of "
        f"examples/pipeline_parallel.py with {args.layers} Linear blocks of width {args.hidden}, batch "
        f"{args.batch} in {args.microbatches} microbatches: each message {msg / 2**20:.1f} MiB. "
        f"Medians of {args.steps} steps after {args.warmup} warm-up, the variants interleaved step by "
        f"step. Command: `{' '.join(sys.argv)}` under `torchrun --standalone --nproc-per-node 2`.",
        "",
        "Exchange = one step's messages without compute (time / GB/s of the link, both directions). "
        "*blocking*: each message complete before the next (tensorwire send/recv; NCCL send/recv + "
        "device sync); *overlapped*: tensorwire isend, NCCL isend + stream-ordered recv, waited for at "
        "the end. Train step = the example's `pipeline_step` (overlapped sends, batches made on the "
        "device beforehand).",
        "",
        "| variant | exchange, blocking | exchange, overlapped | train step | final loss | how |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for v, r in r0.items():
        loss = r1.get(v, {}).get("final_loss")
        lines.append(
            f"| {v} | {cell(r, 'blocking')} | {cell(r, 'overlapped')} | {r['train_step_ms']:.2f} ms | "
            f"{loss if loss is None else f'{loss:.6f}'} | {r['how']} |"
        )
    if "tensorwire" in r0 and "nccl" in r0:
        t, n = r0["tensorwire"], r0["nccl"]
        parts = [
            f"{mode} {t[f'exchange_{mode}_gbps'] / n[f'exchange_{mode}_gbps']:.2f}x"
            for mode in ("blocking", "overlapped")
            if f"exchange_{mode}_gbps" in t and f"exchange_{mode}_gbps" in n
        ]
        lines += [
            "",
            f"tensorwire / NCCL exchange throughput: {', '.join(parts)}; train step time "
            f"{t['train_step_ms'] / n['train_step_ms']:.3f}x NCCL's (targets: >= 0.9x throughput, "
            f"step within 5%).",
        ]
    if "tensorwire" in r0 and "grpc" in r0:
        lines.append(
            f"tensorwire / gRPC exchange time (blocking): "
            f"{r0['tensorwire']['exchange_blocking_ms'] / r0['grpc']['exchange_blocking_ms']:.4f}"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out_md:
        Path(args.out_md).write_text(text)
    if args.out_json:
        Path(args.out_json).write_text(json.dumps({"ranks": per_rank, "args": vars(args)}, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--variants",
        default="tensorwire,nccl,grpc",
        help="comma-separated: tensorwire, tensorwire-blocking (train with send instead of isend), nccl, grpc",
    )
    p.add_argument("--out-md", default=None)
    p.add_argument("--out-json", default=None)
    args = p.parse_args()
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun: torchrun --standalone --nproc-per-node 2 " + " ".join(sys.argv))
    worker(args)


if __name__ == "__main__":
    main()
