"""Workers of the copy-engine GPU tests (run under torchrun by tests/distributed/test_copyengine_gpu.py)."""

from __future__ import annotations

import datetime
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

import tensorwire  # noqa: F401


def killed_peer() -> int:
    """Rank 1 dies (SIGKILL) while rank 0's stream waits for its message; rank 0 must get an error, not hang."""
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    dist.init_process_group("tensorwire", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=20))
    t = torch.ones(1 << 20, device=device)
    dist.barrier()
    if rank == 1:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    w = dist.irecv(t, 1)
    w.wait()  # the stream waits
    t0 = time.monotonic()
    try:
        (t * 2).sum().item()  # the host waits for the stream: released by the watchdog
        w2 = dist.irecv(t, 1)  # the group's next call raises
        w2.wait(timeout=datetime.timedelta(seconds=5))
        print("NO ERROR", flush=True)
        return 1
    except Exception as exc:  # noqa: BLE001
        print(f"ERROR AFTER {time.monotonic() - t0:.2f}s: {type(exc).__name__}: {exc}", flush=True)
        return 0


def default_groups() -> int:
    """``new_group(backend="tensorwire")`` under a default group made with and without ``device_id=``."""
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    style = sys.argv[2]
    # NCCL refuses two ranks on one GPU: there gloo plays the default group (the same code path in torch)
    backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    kwargs = {"device_id": device} if style == "eager" else {}
    dist.init_process_group(backend, **kwargs)
    group = dist.new_group(backend="tensorwire")
    t = torch.full((1 << 16,), float(rank + 1), device=device)
    r = torch.zeros_like(t)
    ops = [dist.P2POp(dist.isend, t, 1 - rank, group=group), dist.P2POp(dist.irecv, r, 1 - rank, group=group)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    ok = bool((r == float(2 - rank)).all())
    probes = getattr(group, "ce_probes", {})
    print(f"rank {rank} style {style}: {'OK' if ok else 'WRONG BYTES'}; probe {probes.get(1 - rank)}", flush=True)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit({"killed_peer": killed_peer, "default_groups": default_groups}[sys.argv[1]]())
