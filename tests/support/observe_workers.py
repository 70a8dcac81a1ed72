"""Worker functions for tests/observe/test_observe_backend.py (spawned by tests/support/harness.py).

Each returns a small picklable report; a failed check raises (the harness reports it).
"""

from __future__ import annotations

import contextlib
import io
import os
import time
import urllib.request
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tensorwire import observe

ELEMS = 1024  # float32: 4 KiB per message


def _init(rank: int, world: int, store: Any, transport: str) -> None:
    from cuda_workers import _cuda_path

    _cuda_path(transport)
    dist.init_process_group("tensorwire", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))


def profiled_backend_exchange(
    *, rank: int, world: int, store: Any, transport: str, n: int, device: str = "cpu"
) -> dict[str, Any]:
    """Under torch.profiler: dist.send/recv, isend/irecv + wait, batch_isend_irecv (tag 3 from rank 0, tag 4
    back); then ``n`` more sends from rank 0 without a profiler. Returns the ranges' names, tw.metrics(), the
    endpoint's text (TENSORWIRE_METRICS_PORT=0) and the summary line written at destroy_process_group().
    ``device="cuda"``: the tensors are on GPU ``rank % device_count`` and the profiler records CUDA too."""
    os.environ["TENSORWIRE_METRICS_PORT"] = "0"
    os.environ["TENSORWIRE_LOG"] = "info"
    observe.reset()
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
        device = f"cuda:{torch.cuda.current_device()}"
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    _init(rank, world, store, transport)
    peer = 1 - rank
    mine = torch.full((ELEMS,), float(rank), device=device)
    buf = torch.empty(ELEMS, device=device)
    with torch.profiler.profile(activities=activities) as prof:
        if rank == 0:
            dist.send(mine, peer, tag=3)
            dist.isend(mine, peer, tag=3).wait()
            ops = [dist.P2POp(dist.isend, mine, peer, tag=3), dist.P2POp(dist.irecv, buf, peer, tag=4)]
        else:
            dist.recv(buf, peer, tag=3)
            dist.irecv(buf, peer, tag=3).wait()
            ops = [dist.P2POp(dist.irecv, buf, peer, tag=3), dist.P2POp(dist.isend, mine, peer, tag=4)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    if device != "cpu":
        torch.cuda.synchronize()
    assert torch.equal(buf.cpu(), torch.full((ELEMS,), float(peer))), buf[:4]
    # (host ranges only: with CUDA recorded, a range around queued GPU work shows again as a GPU annotation)
    cpu = torch.autograd.DeviceType.CPU
    names = [e.name for e in prof.events() if e.name.startswith("tensorwire.") and e.device_type == cpu]
    for _ in range(n):
        if rank == 0:
            dist.send(mine, peer, tag=5)
        else:
            dist.recv(buf, peer, tag=5)
    if device != "cpu":
        torch.cuda.synchronize()
    # A CUDA message whose wait() only made a stream wait is counted complete when the group next sees it done
    # (its watchdog looks a few times a second; a thread busy in torch's profiler can hold it off): wait for that.
    deadline = time.monotonic() + 10.0
    metrics = observe.metrics()
    while time.monotonic() < deadline and any(f["completed"] < f["messages"] for f in metrics["flows"]):
        time.sleep(0.01)
        metrics = observe.metrics()
    port = observe.endpoint_port()
    assert port is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        dist.destroy_process_group()
    observe.stop_endpoint()
    return {"names": names, "metrics": metrics, "text": text, "summary": err.getvalue()}


def link_with_ucx_missing_on_one_side(*, rank: int, world: int, store: Any) -> dict[str, Any]:
    """Rank 1 has no UCX (its factory raises ImportError, as without ucxx); under auto with UCX preferred
    (TENSORWIRE_AUTO_PREFER=ucx), the link falls back to TCP. Returns the link's transport and the fallbacks."""
    import tensorwire.p2p.node as node_mod
    from tensorwire.spec import TensorSpec

    os.environ["TENSORWIRE_AUTO_PREFER"] = "ucx"
    observe.reset()
    if rank == 1:
        real = node_mod.get_factory

        def no_ucx(kind: str) -> Any:
            if kind == "ucx":
                raise ImportError("ucxx is not installed (forced by the test)")
            return real(kind)

        node_mod.get_factory = no_ucx  # type: ignore[assignment]
    spec = TensorSpec("x", (ELEMS,), "float32", "cpu")
    with node_mod.Node(rank=rank, world_size=world, store=store, transport="auto", timeout=30) as node:
        link = node.link(1 - rank, send=[spec] if rank == 0 else [], recv=[spec] if rank == 1 else [])
        if rank == 0:
            link.send("x", torch.ones(ELEMS))
        else:
            link.recv("x")
        kind = link.transport
    return {"transport": kind, "fallbacks": observe.metrics()["fallbacks"], "text": observe.render().decode()}
