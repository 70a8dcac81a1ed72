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
    """torch.distributed send/recv (NCCL on GPU, gloo on CPU) into preallocated buffers."""

    def __init__(self, ex: Any, plan: Any, *, rank: int, microbatches: int, device: Any) -> None:
        import torch

        self.stats = ex.Stats()
        self.rank = rank
        self.device = device
        self.inputs = [[torch.empty(s.shape, dtype=s.torch_dtype, device=device) for s in plan.inputs]
                       for _ in range(microbatches)] if rank > 0 else []
        self.grad_bufs = [torch.empty(s.shape, dtype=s.torch_dtype, device=device) for s in plan.grads_of_outputs]

    def _send(self, tensors: Sequence[Any], peer: int) -> None:
        import torch.distributed as dist

        t0 = time.perf_counter()
        n = 0
        for t in tensors:
            dist.send(t.detach().contiguous(), peer)
            n += t.numel() * t.element_size()
        _sync(self.device)
        self.stats.add(n, time.perf_counter() - t0)

    def _recv(self, bufs: Sequence[Any], peer: int) -> list[Any]:
        import torch.distributed as dist

        t0 = time.perf_counter()
        for b in bufs:
            dist.recv(b, peer)
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

    def close(self) -> None:
        pass


class DeviceGrpcComm:
    """bench_pipeline.GrpcComm (host bytes) plus the device<->host copies a gRPC user must make."""

    def __init__(self, ex: Any, bp: Any, node: Any, plan: Any, *, microbatches: int, device: Any) -> None:
        import torch

        self.inner = bp.GrpcComm(node, plan, n_stages=2, microbatches=microbatches, tag="gpu")
        self.stats = ex.Stats()
        self.device = device
        self.dev_inputs = [[torch.empty(s.shape, dtype=s.torch_dtype, device=device) for s in plan.inputs]
                           for _ in range(microbatches)] if node.rank > 0 else []
        self.dev_grads = [torch.empty(s.shape, dtype=s.torch_dtype, device=device) for s in plan.grads_of_outputs]

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

    def close(self) -> None:
        self.inner.close()


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
    cfg = ex.Config(d_in=args.hidden, hidden=args.hidden, d_out=args.hidden, layers=args.layers, batch=args.batch,
                    microbatches=args.microbatches, steps=args.steps, lr=args.lr)
    first, last = rank == 0, rank == 1
    results: dict[str, Any] = {}
    try:
        for variant in args.variants.split(","):
            stage = ex.build_stage(ex.build_model(cfg), 2, rank).to(device)
            plan = tw.discover(stage, torch.zeros(cfg.microbatch, cfg.hidden, device=device))
            if variant == "tensorwire":
                comm = ex.TensorwireComm(node, plan, n_stages=2, microbatches=cfg.microbatches, device=device,
                                         link_name=f"bench-{variant}")
                how = comm.transports
            elif variant == "nccl":
                comm = NcclComm(ex, plan, rank=rank, microbatches=cfg.microbatches, device=device)
                how = dist.get_backend()
            elif variant == "grpc":
                comm = DeviceGrpcComm(ex, bp, node, plan, microbatches=cfg.microbatches, device=device)
                how = "grpc unary bytes + D2H/H2D"
            else:
                raise SystemExit(f"unknown variant {variant!r}")
            payload = {"act": [torch.randn(s.shape, device=device).to(s.torch_dtype) for s in plan.outputs],
                       "grad": [torch.randn(s.shape, device=device).to(s.torch_dtype) for s in plan.grads_of_inputs]}
            step_bytes = cfg.microbatches * sum(s.nbytes for s in plan.outputs) * 2
            ex_times = []
            for i in range(args.warmup + args.steps):
                dist.barrier()
                t = bp.exchange_step(comm, plan, cfg, rank, payload)
                _sync(device)
                if i >= args.warmup:
                    ex_times.append(t)
            opt = torch.optim.SGD(stage.parameters(), lr=cfg.lr)
            train_times, loss = [], None
            for step in range(args.warmup + args.steps):
                dist.barrier()
                _sync(device)
                t0 = time.perf_counter()
                out = ex.pipeline_step(stage, opt, comm, cfg, step, first=first, last=last, device=device)
                _sync(device)
                if step >= args.warmup:
                    train_times.append(time.perf_counter() - t0)
                if last:
                    loss = out
            comm.stats.end_step()
            comm.close()
            med = statistics.median(ex_times)
            results[variant] = {"how": str(how), "exchange_ms": med * 1e3, "exchange_gbps": step_bytes / med / 1e9,
                                "step_bytes": step_bytes, "train_step_ms": statistics.median(train_times) * 1e3,
                                "final_loss": loss}
            del stage, opt, comm, payload
            if device.type == "cuda":
                torch.cuda.empty_cache()
        gathered: list[Any] = [None, None]
        dist.all_gather_object(gathered, results)
        if rank == 0:
            report(gathered, args, device)
    finally:
        dist.destroy_process_group()
        node.close()


def report(per_rank: list[dict[str, Any]], args: argparse.Namespace, device: Any) -> None:
    import torch

    r0, r1 = per_rank
    msg = args.batch // args.microbatches * args.hidden * 4
    gpu = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (dry run)"
    lines = [f"# Pipeline exchange on {gpu}: tensorwire vs NCCL vs gRPC", "",
             f"2 stages (one per {'GPU' if device.type == 'cuda' else 'process'}), model of "
             f"examples/pipeline_parallel.py with {args.layers} Linear blocks of width {args.hidden}, batch "
             f"{args.batch} in {args.microbatches} microbatches: each message {msg / 2**20:.1f} MiB. "
             f"Medians of {args.steps} steps after {args.warmup} warm-up. Command: `{' '.join(sys.argv)}` under "
             f"`torchrun --standalone --nproc-per-node 2`.", "",
             "| variant | exchange per step | link GB/s (both ways) | train step | final loss | how |",
             "| --- | --- | --- | --- | --- | --- |"]
    for v, r in r0.items():
        loss = r1.get(v, {}).get("final_loss")
        lines.append(f"| {v} | {r['exchange_ms']:.2f} ms | {r['exchange_gbps']:.1f} | {r['train_step_ms']:.2f} ms | "
                     f"{loss if loss is None else f'{loss:.6f}'} | {r['how']} |")
    if "tensorwire" in r0 and "nccl" in r0:
        t, n = r0["tensorwire"], r0["nccl"]
        lines += ["", f"tensorwire / NCCL: exchange throughput {t['exchange_gbps'] / n['exchange_gbps']:.2f}x, "
                      f"train step time {t['train_step_ms'] / n['train_step_ms']:.3f}x (target: >= 0.9x throughput, "
                      f"step within 5%)."]
    if "tensorwire" in r0 and "grpc" in r0:
        lines.append(f"tensorwire / gRPC exchange time: {r0['tensorwire']['exchange_ms'] / r0['grpc']['exchange_ms']:.4f}")
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
    p.add_argument("--variants", default="tensorwire,nccl,grpc")
    p.add_argument("--out-md", default=None)
    p.add_argument("--out-json", default=None)
    args = p.parse_args()
    if "RANK" not in os.environ:
        raise SystemExit("run under torchrun: torchrun --standalone --nproc-per-node 2 " + " ".join(sys.argv))
    worker(args)


if __name__ == "__main__":
    main()
