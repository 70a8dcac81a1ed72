"""torch.distributed point-to-point: ``dist.send`` / ``dist.recv``, gloo on CPU, NCCL on CUDA.

The process group is built on the runner's store (a ``PrefixStore``), so no
extra port is needed. With NCCL the host waits for the ack with a stream
synchronize (the ack is queued after the data on NCCL's stream, so its arrival
means the data arrived).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tensorwire.benchmark.backends.base import BackendUnavailable, PairContext
from tensorwire.benchmark.backends.base import Receiver as _Receiver
from tensorwire.benchmark.backends.base import Sender as _Sender

if TYPE_CHECKING:  # pragma: no cover
    import torch


class _Group:
    def __init__(self, ctx: PairContext, backend: str) -> None:
        import datetime

        import torch
        import torch.distributed as dist

        if backend == "nccl" and (not torch.cuda.is_available() or ctx.device.type != "cuda"):
            raise BackendUnavailable("NCCL needs CUDA buffers (--device cuda)")
        if backend == "gloo" and ctx.device.type == "cuda":
            raise BackendUnavailable("gloo is the CPU peer; NCCL is the CUDA one")
        if not dist.is_available():
            raise BackendUnavailable("torch.distributed is not available in this torch build")
        self.dist = dist
        self.nccl = backend == "nccl"
        store = dist.PrefixStore(ctx.key("pg/"), ctx.store)
        kwargs = {"device_id": ctx.device} if self.nccl else {}
        dist.init_process_group(
            backend, store=store, rank=ctx.rank, world_size=2, timeout=datetime.timedelta(seconds=ctx.timeout), **kwargs
        )
        self.ack = torch.ones(1, dtype=torch.uint8, device=ctx.device)
        self.peer = 1 - ctx.rank

    def sync(self) -> None:
        if self.nccl:
            import torch

            torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


class Sender(_Sender):
    def __init__(self, ctx: PairContext, arg: str | None = None) -> None:
        super().__init__(ctx, arg)
        self.g = _Group(ctx, arg or "gloo")
        self.transport = arg
        self.src: "torch.Tensor | None" = None

    def open(self, size: int, src: "torch.Tensor") -> None:
        self.src = src

    def send(self) -> None:
        self.g.dist.send(self.src, self.g.peer)

    def wait_ack(self) -> None:
        self.g.dist.recv(self.g.ack, self.g.peer)
        self.g.sync()

    def close_size(self) -> None:
        self.src = None

    def close(self) -> None:
        self.g.close()


class Receiver(_Receiver):
    def __init__(self, ctx: PairContext, arg: str | None = None) -> None:
        super().__init__(ctx, arg)
        self.g = _Group(ctx, arg or "gloo")
        self.buf: "torch.Tensor | None" = None

    def open(self, size: int) -> None:
        import torch

        self.buf = torch.empty(size, dtype=torch.uint8, device=self.ctx.device)

    def recv(self) -> "torch.Tensor":
        self.g.dist.recv(self.buf, self.g.peer)
        assert self.buf is not None
        return self.buf

    def ack(self) -> None:
        self.g.dist.send(self.g.ack, self.g.peer)

    def close_size(self) -> None:
        self.buf = None

    def close(self) -> None:
        self.g.close()
