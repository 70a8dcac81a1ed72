"""Worker functions for tests/test_distributed.py (run in spawned processes or under torchrun).

Each returns a small picklable report; any failed check raises (the harness reports it).
"""

from __future__ import annotations

import copy
import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import tensorwire

PAYLOAD_DTYPES = [
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "bool",
    "complex64",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
]


def _init(
    rank: int, world: int, store: Any, transport: str, *, backend: str = "tensorwire", timeout: float = 60.0
) -> None:
    from cuda_workers import _cuda_path

    _cuda_path(transport)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout))


def _pattern(dtype_name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Deterministic bytes of a dtype (float8 and bool included), compared as bytes."""
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(seed)
    n = int(torch.tensor(shape).prod().item()) if shape else 1
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw % 2
    return raw.view(dtype).reshape(shape)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    )


def p2p_suite(rank: int, world: int, store: Any, transport: str) -> dict:
    """Every dtype, 0-d/empty/non-contiguous, tags out of order, 8 in flight, both ways at once, futures."""
    _init(rank, world, store, transport)
    pg = dist.group.WORLD
    assert pg.name() == "tensorwire", pg.name()
    peer = 1 - rank
    report: dict[str, Any] = {"transports": dict(pg.transports)}
    # every dtype, both ranks sending and receiving at once through batch_isend_irecv
    for i, dt in enumerate(PAYLOAD_DTYPES):
        x = _pattern(dt, (3, 5), seed=100 * rank + i)
        y = torch.empty_like(x)
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, y, peer)])
        for w in works:
            w.wait()
        assert _same_bytes(y, _pattern(dt, (3, 5), seed=100 * peer + i)), dt
    # 0-d, empty, rank 8
    for j, shape in enumerate([(), (0,), (2, 0, 3), (2, 1, 2, 1, 2, 1, 2, 3)]):
        x = _pattern("float32", shape, seed=10 * rank + j)
        y = torch.full(shape, -1.0)
        if rank == 0:
            dist.send(x, 1)
            dist.recv(y, 1)
        else:
            dist.recv(y, 0)
            dist.send(x, 0)
        assert _same_bytes(y, _pattern("float32", shape, seed=10 * peer + j)), shape
    # non-contiguous send and receive tensors (through a preallocated slot of their signature)
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8) + 100 * rank
    out = torch.zeros(6, 8)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, base.t(), peer), dist.P2POp(dist.irecv, out.t(), peer)])
    for w in works:
        w.wait()
    assert torch.equal(out, torch.arange(48, dtype=torch.float32).reshape(6, 8) + 100 * peer)
    # tags honoured: sent on tags 1 then 2, received 2 then 1
    if rank == 0:
        a = dist.isend(torch.full((4,), 1.0), 1, tag=1)
        b = dist.isend(torch.full((4,), 2.0), 1, tag=2)
        a.wait()
        b.wait()
    else:
        r2, r1 = torch.zeros(4), torch.zeros(4)
        dist.irecv(r2, 0, tag=2).wait()
        dist.irecv(r1, 0, tag=1).wait()
        assert r2.eq(2.0).all() and r1.eq(1.0).all()
    # 8 messages in flight; the receiver waits on them newest first
    n = 8
    if rank == 0:
        sends = [dist.isend(torch.full((1024,), float(k)), 1) for k in range(n)]
        for w in sends:
            w.wait()
    else:
        bufs = [torch.zeros(1024) for _ in range(n)]
        works = [dist.irecv(b, 0) for b in bufs]
        assert not all(w.is_completed() for w in works[1:]) or True  # is_completed never blocks
        for w in reversed(works):
            w.wait()
        assert all(b.eq(float(k)).all() for k, b in enumerate(bufs))
    # futures: completed without anyone calling wait()
    y = torch.zeros(16)
    if rank == 0:
        fut = dist.isend(torch.ones(16) * 5, 1).get_future()
        fut.wait()
    else:
        work = dist.irecv(y, 0)
        got = work.get_future().wait()
        assert got[0].eq(5).all() and work.is_completed() and work.is_success() and work.exception() is None
    # a wait that times out raises WorkTimeout (a DistBackendError) and the receive goes on
    from tensorwire.distributed.errors import WorkTimeout

    if rank == 1:
        late = torch.zeros(8)
        w = dist.irecv(late, 0, tag=7)
        t0 = time.monotonic()
        try:
            w.wait(timedelta(seconds=0.3))
        except WorkTimeout as exc:
            assert isinstance(exc, dist.DistBackendError) and isinstance(exc, tensorwire.TransferTimeout)
            report["timeout_after_s"] = time.monotonic() - t0
        else:
            raise AssertionError("wait on a message nobody sent returned")
        dist.barrier()
        w.wait()
        assert late.eq(3.0).all()
    else:
        dist.barrier()
        dist.send(torch.full((8,), 3.0), 1, tag=7)
    # receive from any source: a clear error naming the alternative
    try:
        dist.recv(torch.zeros(1))
    except Exception as exc:  # noqa: BLE001
        assert "src=" in str(exc), str(exc)
    else:
        raise AssertionError("recv without src did not raise")
    # collectives through the inner group
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    assert t.eq(sum(range(1, world + 1))).all()
    b = torch.full((3,), float(rank))
    dist.broadcast(b, src=1)
    assert b.eq(1.0).all()
    gathered = [torch.zeros(2) for _ in range(world)]
    dist.all_gather(gathered, torch.full((2,), float(rank)))
    assert all(g.eq(float(r)).all() for r, g in enumerate(gathered))
    rs = torch.zeros(2)
    dist.reduce_scatter(rs, [torch.full((2,), float(rank + r)) for r in range(world)])
    assert rs.eq(sum(r + rank for r in range(world))).all()
    a2a_out = torch.zeros(world)
    dist.all_to_all_single(a2a_out, torch.arange(world, dtype=torch.float32) + 10 * rank)
    assert a2a_out.tolist() == [10 * r + rank for r in range(world)]
    outs = [torch.zeros(1) for _ in range(world)]
    dist.all_to_all(outs, [torch.full((1,), float(10 * rank + r)) for r in range(world)])
    assert [o.item() for o in outs] == [10 * r + rank for r in range(world)]
    dist.barrier()
    objs: list[Any] = [{"from": rank, "shape": [2, 3]}] if rank == 0 else [None]
    if rank == 0:
        dist.send_object_list(objs, dst=1)
    else:
        dist.recv_object_list(objs, src=0)
        assert objs[0] == {"from": 0, "shape": [2, 3]}
    dist.destroy_process_group()
    report["threads_left"] = no_backend_threads_left()
    return report


def big(rank: int, world: int, store: Any, transport: str, mib: int = 256) -> dict:
    """One ``mib`` MiB tensor each way (rank 0 -> 1, then back)."""
    _init(rank, world, store, transport)
    n = mib * 1024 * 1024 // 4
    x = torch.arange(n, dtype=torch.int32)
    t0 = time.perf_counter()
    if rank == 0:
        dist.send(x, 1)
        y = torch.empty_like(x)
        dist.recv(y, 1)
        assert torch.equal(y, x + 1)
    else:
        y = torch.empty(n, dtype=torch.int32)
        dist.recv(y, 0)
        assert torch.equal(y, x)
        y += 1
        dist.send(y, 0)
    elapsed = time.perf_counter() - t0
    dist.destroy_process_group()
    return {"seconds": elapsed}


def send_then_destroy(rank: int, world: int, store: Any, transport: str) -> dict:
    """Rank 0 sends and destroys its group at once; rank 1 posts its receives only a moment later."""
    _init(rank, world, store, transport)
    msgs = [torch.full((64, 1024), float(i)) for i in range(3)]  # 256 KiB each (the eager size over TCP)
    got = []
    if rank == 0:
        for t in msgs:
            dist.send(t, 1)
    else:
        time.sleep(0.5)  # its credits reach rank 0 after rank 0 began closing
        for t in msgs:
            r = torch.empty_like(t)
            dist.recv(r, 0)
            got.append(bool(torch.equal(r, t)))
    dist.destroy_process_group()
    return {"got": got}


def ring(rank: int, world: int, store: Any, transport: str) -> dict:
    """Every rank sends to the next and receives from the previous at once (a cycle of isends)."""
    _init(rank, world, store, transport)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for step in range(3):
        x = torch.full((1000,), float(rank * 10 + step))
        y = torch.zeros(1000)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, y, prv)]):
            w.wait()
        assert y.eq(float(prv * 10 + step)).all()
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world
    dist.destroy_process_group()
    return {"ok": True}


MISMATCHES = {
    # name: (what rank 0 sends, what rank 1 receives into)
    "shape_same_bytes": ((4, 4), "float32", (2, 8), "float32"),
    "dtype_same_bytes": ((4, 4), "float32", (4, 4), "int32"),
    "smaller": ((4, 4), "float32", (4, 5), "float32"),
    "larger": ((4, 5), "float32", (4, 4), "float32"),
}


def mismatch(rank: int, world: int, store: Any, transport: str) -> dict:
    """Each mismatch in its own tensorwire group made with new_group under a gloo default group."""
    from tensorwire.distributed.errors import SignatureMismatch

    _init(rank, world, store, transport, backend="gloo")
    report: dict[str, Any] = {}
    for name, (s_shape, s_dtype, r_shape, r_dtype) in MISMATCHES.items():
        g = dist.new_group([0, 1], backend="tensorwire", timeout=timedelta(seconds=20))
        assert g.name() == "tensorwire"
        # a good message first: the group works
        ok = torch.zeros(3)
        if rank == 0:
            dist.send(torch.ones(3), 1, group=g)
        else:
            dist.recv(ok, 0, group=g)
            assert ok.eq(1).all()
        t0 = time.monotonic()
        if rank == 0:
            x = torch.ones(s_shape, dtype=getattr(torch, s_dtype))
            try:
                dist.send(x, 1, group=g)
                # the receiver closes the pair: the next operation fails, it does not hang
                dist.recv(torch.zeros(1), 1, group=g)
                report[name] = ("sender", "no error")
            except Exception as exc:  # noqa: BLE001
                report[name] = ("sender", type(exc).__name__, isinstance(exc, dist.DistBackendError))
        else:
            y = torch.zeros(r_shape, dtype=getattr(torch, r_dtype))
            try:
                dist.recv(y, 0, group=g)
                report[name] = ("receiver", "no error")
            except SignatureMismatch as exc:
                assert isinstance(exc, dist.DistBackendError) and isinstance(exc, tensorwire.ShapeMismatchError)
                report[name] = ("receiver", "SignatureMismatch", str(exc))
            except Exception as exc:  # noqa: BLE001
                report[name] = ("receiver", type(exc).__name__, str(exc))
        report[name] += (round(time.monotonic() - t0, 2),)
        dist.barrier()  # (gloo default group)
        dist.destroy_process_group(g)
    dist.destroy_process_group()
    return report


def killed(rank: int, world: int, store: Any, transport: str) -> dict:
    """Rank 1 dies mid-step: rank 0's pending receive and send fail with PeerLost (a DistBackendError)."""
    from tensorwire.distributed.errors import PeerLost

    os.environ["TENSORWIRE_PEER_TIMEOUT"] = "5"
    _init(rank, world, store, transport, timeout=60)
    x = torch.zeros(1024)
    if rank == 1:
        dist.recv(x, 0)
        dist.send(x, 0)
        dist.recv(x, 0)  # posted; then this process dies mid-step
        os._exit(17)
    dist.send(x, 0 + 1)
    dist.recv(x, 1)
    dist.send(x, 1)
    pending = dist.irecv(torch.zeros(1024), 1)
    big_send = dist.isend(torch.zeros(8 << 20), 1)
    t0 = time.monotonic()
    errors = []
    for w in (pending, big_send):
        try:
            w.wait()
            errors.append("no error")
        except PeerLost as exc:
            assert isinstance(exc, dist.DistBackendError) and isinstance(exc, tensorwire.PeerLostError)
            errors.append("PeerLost")
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{type(exc).__name__}: {exc}")
    elapsed = time.monotonic() - t0
    dist.destroy_process_group()
    return {"errors": errors, "seconds": elapsed}


def _pipeline_model(n_layers: int, d: int) -> torch.nn.Sequential:
    torch.manual_seed(1234)
    layers: list[torch.nn.Module] = []
    for _ in range(n_layers):
        layers += [torch.nn.Linear(d, d), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def pipeline(
    rank: int, world: int, store: Any, transport: str, schedule: str, steps: int = 3, backend: str = "tensorwire"
) -> dict:
    """torch.distributed.pipelining training matches single-process training (parameters within 1e-5)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    if store is not None:
        _init(rank, world, store, transport, backend=backend)
    else:  # under torchrun: env://
        os.environ["TENSORWIRE_TRANSPORT"] = transport
        dist.init_process_group(backend)
        rank, world = dist.get_rank(), dist.get_world_size()
    d, n_layers, n_mb, batch = 16, 8, 4, 16
    full = _pipeline_model(n_layers, d)
    ref = copy.deepcopy(full)
    g = torch.Generator().manual_seed(99)
    xs = [torch.randn(batch, d, generator=g) for _ in range(steps)]
    ys = [torch.randn(batch, d, generator=g) for _ in range(steps)]
    loss_fn = torch.nn.MSELoss()
    interleaved = schedule == "interleaved1f1b"
    n_stages = 2 * world if interleaved else world
    my_stages = [rank, rank + world] if interleaved else [rank]
    per = 2 * n_layers // n_stages
    stages = [
        PipelineStage(torch.nn.Sequential(*full[s * per : (s + 1) * per]), s, n_stages, torch.device("cpu"))
        for s in my_stages
    ]
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved1f1b": ScheduleInterleaved1F1B}[schedule]
    sched = cls(stages if interleaved else stages[0], n_microbatches=n_mb, loss_fn=loss_fn)
    mine = [p for st in stages for p in st.submod.parameters()]
    opt = torch.optim.SGD(mine, lr=0.05)
    for step in range(steps):
        opt.zero_grad()
        args = (xs[step],) if 0 in my_stages else ()
        kwargs = {"target": ys[step]} if n_stages - 1 in my_stages else {}
        sched.step(*args, **kwargs)
        opt.step()
    # the same training in one process
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(steps):
        ref_opt.zero_grad()
        loss = sum(loss_fn(ref(xm), ym) for xm, ym in zip(xs[step].chunk(n_mb), ys[step].chunk(n_mb))) / n_mb
        loss.backward()
        ref_opt.step()
    worst = 0.0
    for s in my_stages:
        got = list(full[s * per : (s + 1) * per].parameters())
        want = list(ref[s * per : (s + 1) * per].parameters())
        for a, b in zip(got, want):
            worst = max(worst, (a - b).abs().max().item())
    moved = max(
        (a - b).abs().max().item() for a, b in zip(full.parameters(), _pipeline_model(n_layers, d).parameters())
    )
    backend_name = dist.group.WORLD.name()
    dist.destroy_process_group()
    assert worst <= 1e-5, f"parameters differ from single-process training by {worst}"
    return {"worst": worst, "moved": moved, "backend": backend_name}


def no_backend_threads_left() -> list[str]:
    """Names of this backend's threads still alive (after destroy_process_group: none)."""
    import threading

    deadline = time.monotonic() + 5
    while True:
        left = [t.name for t in threading.enumerate() if t.name.startswith("tw-dist-") and t.is_alive()]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def cuda_p2p(rank: int, world: int, store: Any, transport: str) -> dict:
    """Two processes on one GPU: a kernel writes the tensor right before isend, a kernel consumes it right after
    wait(); the send reads it only after the writes queued on the current stream."""
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)  # before the group, as GPU jobs do: auto then picks a CUDA transport
    _init(rank, world, store, transport)
    n = 1 << 22  # 16 MiB of float32
    results = {}
    for step in range(3):
        if rank == 0:
            x = torch.empty(n, device=dev)
            torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU work queued before the write
            x.fill_(float(step + 1))  # the write, queued behind it on the current stream
            w = dist.isend(x, 1)
            w.wait()
        else:
            y = torch.zeros(n, device=dev)
            w = dist.irecv(y, 0)
            t0 = time.perf_counter()
            w.wait()
            results[f"wait_s_{step}"] = time.perf_counter() - t0
            z = y * 2  # a kernel consuming it right after wait()
            assert torch.all(z == 2.0 * (step + 1)).item(), f"step {step}: stale or partial bytes"
    results["transports"] = dict(dist.group.WORLD.transports)
    dist.destroy_process_group()
    return results


def overlapping_groups(rank: int, world: int, store: Any, transport: str) -> dict:
    """new_group([0, 1]) and new_group([0, 2]), both "tensorwire", under a gloo default group: rank 0 is in both,
    ranks 1 and 2 in one each (so the groups a process makes differ between ranks), and each works."""
    _init(rank, world, store, transport, backend="gloo")
    a = dist.new_group([0, 1], backend="tensorwire")
    b = dist.new_group([0, 2], backend="tensorwire")
    got = {}
    for g, other in ((a, 1), (b, 2)):
        if rank == 0:
            dist.send(torch.full((5,), float(other)), other, group=g)
        elif rank == other:
            y = torch.zeros(5)
            dist.recv(y, 0, group=g)
            got[other] = y[0].item()
    dist.barrier()
    dist.destroy_process_group(a) if rank in (0, 1) else None
    dist.destroy_process_group(b) if rank in (0, 2) else None
    dist.destroy_process_group()
    return got


def small_messages(rank: int, world: int, store: Any, transport: str) -> dict:
    """Small messages: a 4 KiB ping-pong goes out in the caller's thread (no sender thread is ever started), more
    isends than the peer has eager buffers before any receive is posted, a receive completed by polling
    is_completed() alone, and messages just over the eager size."""
    _init(rank, world, store, transport)
    peer = 1 - rank
    report: dict[str, Any] = {}
    x = torch.zeros(1024)
    for k in range(300):
        if rank == 0:
            x.fill_(float(k))
            dist.send(x, peer)
            dist.recv(x, peer)
            assert x[0].item() == k + 0.5 and x[-1].item() == k + 0.5, (k, x[0].item())
        else:
            dist.recv(x, peer)
            assert x.eq(float(k)).all(), k
            x.add_(0.5)
            dist.send(x, peer)
    report["send_threads"] = sorted(t.name for t in threading.enumerate() if t.name.startswith("tw-dist-send-"))
    # 20 isends of 4 KiB before the receiver posts anything (more than its eager buffers): in order, none lost
    n = 20
    if rank == 0:
        sends = [dist.isend(torch.full((1024,), float(k)), 1, tag=2) for k in range(n)]
        dist.barrier()
        for w in sends:
            w.wait()
    else:
        dist.barrier()
        time.sleep(0.2)
        bufs = [torch.zeros(1024) for _ in range(n)]
        for w in [dist.irecv(b, 0, tag=2) for b in bufs]:
            w.wait()
        assert [b[0].item() for b in bufs] == [float(k) for k in range(n)] and all(b.eq(b[0]).all() for b in bufs)
    # a receive nobody waits on completes by polling is_completed()
    if rank == 1:
        y = torch.zeros(256)
        w = dist.irecv(y, 0, tag=3)
        dist.barrier()
        deadline = time.monotonic() + 20
        while not w.is_completed():
            assert time.monotonic() < deadline, "is_completed() never saw the message"
            time.sleep(0.001)
        assert y.eq(7.0).all() and w.is_success()
    else:
        dist.barrier()
        dist.send(torch.full((256,), 7.0), 1, tag=3)
    # just over the eager size, both ways, a few times
    big = torch.zeros((64 << 10) // 4 + 1)
    for k in range(5):
        if rank == 0:
            big.fill_(float(k))
            dist.send(big, 1, tag=4)
            dist.recv(big, 1, tag=4)
            assert big.eq(k + 1.0).all()
        else:
            dist.recv(big, 0, tag=4)
            big.add_(1.0)
            dist.send(big, 0, tag=4)
    dist.destroy_process_group()
    return report


def into_leaves_requiring_grad(rank: int, world: int, store: Any, transport: str) -> dict:
    """Receive into leaf tensors that require grad (what pipelining's stage inputs are), contiguous and not:
    the bytes land (as NCCL and gloo write them) and the tensors stay leaves that require grad."""
    _init(rank, world, store, transport)
    x = torch.arange(32, dtype=torch.float32).reshape(4, 8)
    if rank == 0:
        dist.send(x, 1)
        dist.send(x, 1)
        dist.destroy_process_group()
        return {}
    flat = torch.zeros(4, 8, requires_grad=True)
    strided = torch.zeros(8, 4).t().requires_grad_()  # a leaf, not contiguous: received through a slot
    assert not strided.is_contiguous() and strided.is_leaf
    dist.recv(flat, 0)
    dist.recv(strided, 0)
    dist.destroy_process_group()
    return {
        "flat": torch.equal(flat.detach(), x),
        "strided": torch.equal(strided.detach(), x),
        "leaves": flat.is_leaf and strided.is_leaf and flat.requires_grad and strided.requires_grad,
    }
