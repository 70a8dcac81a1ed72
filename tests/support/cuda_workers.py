"""Worker functions for tests/distributed/test_cuda_streams.py: two processes sharing one GPU (cuda:0).

Each returns a small picklable report; a failed check raises (the harness reports it).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import tensorwire  # noqa: F401 - registers backend "tensorwire"

#: cycles of torch.cuda._sleep: tens of milliseconds of GPU work on an H100/H200
LONG_KERNEL = 50_000_000


def _init(rank: int, world: int, store: Any, transport: str, *, stream_wait: bool = True, timeout: float = 60) -> Any:
    _cuda_path(transport)
    os.environ["TENSORWIRE_CUDA_STREAM_WAIT"] = "1" if stream_wait else "0"
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    dist.init_process_group("tensorwire", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
    return dev


def _cuda_path(transport: str) -> None:
    """``transport`` of the GPU tests: "ce" -- links over TCP, CUDA tensors on the copy-engine path; "tcp" / "ucx" --
    CUDA tensors on that transport itself (the copy-engine path off, as where ranks do not share a host)."""
    os.environ["TENSORWIRE_TRANSPORT"] = "tcp" if transport == "ce" else transport
    os.environ["TENSORWIRE_CUDA_PATH"] = "ce" if transport == "ce" else "ucx"


def _streamed(work: Any) -> bool:
    return bool(getattr(work, "_streamed", False))


def ordered(rank: int, world: int, store: Any, transport: str, layout: str = "contiguous") -> dict:
    """isend reads after the kernel queued before it; the sender overwrites right after its wait(); the receiver's
    earlier reader sees the old bytes, its consumer right after wait() the new ones; then 8 messages each way
    in flight at once through batch_isend_irecv."""
    dev = _init(rank, world, store, transport)
    n = 1 << 22  # 16 MiB of float32
    report: dict[str, Any] = {"wait_s": [], "streamed": []}
    for step in range(3):
        dist.barrier()
        if rank == 0:
            x = torch.empty((n, 2), device=dev)[:, 1] if layout == "strided" else torch.empty(n, device=dev)
            torch.cuda._sleep(LONG_KERNEL)  # GPU work queued before the write
            x.fill_(float(step + 1))  # the write, queued behind it on the current stream
            w = dist.isend(x, 1)
            t0 = time.perf_counter()
            w.wait()
            report["wait_s"].append(time.perf_counter() - t0)
            report["streamed"].append(_streamed(w))
            x.fill_(-1.0)  # right after wait(): the stream waits for the send to be out first
            torch.cuda.synchronize()
        else:
            base = torch.full((n, 2) if layout == "strided" else (n,), 0.5, device=dev)
            y = base[:, 0] if layout == "strided" else base
            torch.cuda._sleep(LONG_KERNEL)
            old = y.clone()  # still to run when irecv is called: it must see the old bytes
            w = dist.irecv(y, 0)
            t0 = time.perf_counter()
            w.wait()
            report["wait_s"].append(time.perf_counter() - t0)
            report["streamed"].append(_streamed(w))
            z = y * 2  # a kernel consuming it right after wait()
            assert torch.all(old == 0.5).item(), f"step {step}: the bytes landed before the earlier reader ran"
            assert torch.all(z == 2.0 * (step + 1)).item(), f"step {step}: stale or partial bytes {z[:4].tolist()}"
    # both ranks send and receive at once, 8 messages each way, every wait() only ordering the stream
    peer = 1 - rank
    xs = [torch.full((1 << 18,), float(rank * 100 + i), device=dev) for i in range(8)]
    ys = [torch.zeros(1 << 18, device=dev) for _ in range(8)]
    torch.cuda._sleep(LONG_KERNEL)
    for x in xs:
        x.add_(1.0)
    ops = [dist.P2POp(dist.isend, x, peer) for x in xs] + [dist.P2POp(dist.irecv, y, peer) for y in ys]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    got = torch.stack([y[:3] for y in ys]).cpu()
    expect = torch.tensor([[peer * 100 + i + 1.0] * 3 for i in range(8)])
    assert torch.equal(got, expect), got
    dist.destroy_process_group()
    return report


def wait_latency(rank: int, world: int, store: Any, transport: str, stream_wait: bool, mib: int = 256) -> dict:
    """Host time of wait() for a large CUDA receive against the time until its bytes are consumed, twice: the
    sender 0.3 s late (the receiver waits for bytes still to come), then right away (the transfer itself)."""
    dev = _init(rank, world, store, transport, stream_wait=stream_wait)
    n = mib * (1 << 20) // 4
    buf = torch.empty(n, device=dev)
    report: dict[str, Any] = {}
    for label, delay in (("warm", 0.0), ("late", 0.3), ("now", 0.0)):
        dist.barrier()
        if rank == 0:
            time.sleep(delay)
            buf.fill_(7.0)
            dist.isend(buf, 1).wait()
            torch.cuda.synchronize()
        else:
            buf.zero_()
            torch.cuda.synchronize()
            w = dist.irecv(buf, 0)
            t0 = time.perf_counter()
            w.wait()
            t_wait = time.perf_counter() - t0
            total = buf.sum()  # consumes the bytes on the current stream
            torch.cuda.synchronize()
            t_total = time.perf_counter() - t0
            assert total.item() == 7.0 * n, total.item()
            report[label] = {"wait_s": t_wait, "total_s": t_total, "streamed": _streamed(w)}
    dist.destroy_process_group()
    return report


def killed_mid_receive(rank: int, world: int, store: Any, transport: str) -> dict:
    """Rank 0 dies while rank 1's stream waits for a receive: the stream goes on, the Work reports PeerLost, and
    the next call on the group raises it."""
    os.environ["TENSORWIRE_PEER_TIMEOUT"] = "5"
    dev = _init(rank, world, store, transport, timeout=30)
    y = torch.zeros(1 << 22, device=dev)
    dist.barrier()
    if rank == 0:
        time.sleep(1.0)
        os._exit(17)  # never sends
    w = dist.irecv(y, 0)
    t0 = time.perf_counter()
    raised = None
    try:
        w.wait()  # through a slot (TCP): blocks the host, and raises once the peer is lost
    except dist.DistBackendError as err:
        raised = type(err).__name__
    report: dict[str, Any] = {"wait_s": time.perf_counter() - t0, "streamed": _streamed(w), "wait_raised": raised}
    z = y + 1.0  # queued behind the stream wait
    done = torch.cuda.Event()
    done.record()
    deadline = time.monotonic() + 30
    while not done.query() and time.monotonic() < deadline:
        time.sleep(0.01)
    report["stream_released"] = bool(done.query())
    report["released_after_s"] = time.perf_counter() - t0
    if not report["stream_released"]:
        os._exit(3)  # a hung stream would hang the process's exit too: report by exit code
    del z
    report["completed"] = w.is_completed()
    exc = w.exception()
    report["exception"] = type(exc).__name__ if exc is not None else None
    report["is_dist_backend_error"] = isinstance(exc, dist.DistBackendError)
    for what, call in (
        ("irecv", lambda: dist.irecv(torch.zeros(4, device=dev), 0).wait()),
        ("barrier", lambda: dist.barrier()),
    ):
        try:
            call()
            report[f"next_{what}"] = "no error"
        except RuntimeError as err:  # tensorwire's errors are DistBackendErrors; gloo's barrier raises its own
            report[f"next_{what}"] = type(err).__name__
    try:
        dist.destroy_process_group()
    except RuntimeError:  # gloo's pair with the dead rank
        pass
    return report
