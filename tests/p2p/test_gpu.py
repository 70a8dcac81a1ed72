"""GPU data path: bit-exact CUDA links over UCX and TCP (staged), stream ordering, overlapped staging,
IPC-safe slots under ``expandable_segments``. Skipped without CUDA; run on a GPU host with ``pytest -m gpu``.

The chunk-staged TCP path (``tensorwire.p2p.staging.StagedSender`` / ``StagedReceiver`` wired into ``Link``) is
checked for: every dtype and sizes around and across the chunk (1 MiB, default 2 MiB, unchunked), sends
ordered after the caller's (non-default) stream including ``isend``, receives consumed on the current stream
(and through ``out=``), a next ``recv`` that must wait for work still reading the slot, 100 steps without
allocations, cudaMalloc slots under expandable segments, and the engines alone with real streams. Its
protocol is also checked without a GPU, under a lazy stream simulator, in ``tests/p2p/test_staging.py``.

Each rank uses ``cuda:(rank % device_count)``: on a 2-GPU host GPU0 <-> GPU1 (cuda_ipc / NVLink),
on a 1-GPU host both ranks share the GPU.

The device kind is part of a spec (``TensorSpec.device``) and must be the same on both sides:
a GPU sender and a CPU receiver of one tensor do not negotiate (``ShapeMismatchError``, tested
below); a link may carry CUDA and CPU specs side by side, each the same kind on both sides.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from harness import run_ranks

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HAVE_UCX = (
    importlib.util.find_spec("ucxx") is not None and importlib.util.find_spec("tensorwire.transport.ucx") is not None
)
#: "ce": a link over TCP whose CUDA specs go over the copy-engine path (both ranks on one host); "tcp"/"ucx": CUDA
#: specs on that transport (the copy-engine path off, as between hosts) -- see ``_node``
TRANSPORTS = [pytest.param("ucx", marks=pytest.mark.skipif(not HAVE_UCX, reason="ucxx not installed")), "tcp", "ce"]


# -- worker bodies (module level: the spawned ranks import them) ---------------------------------


def _dev(rank: int):
    import torch

    d = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(d)
    return d


def _node(rank, world, store, transport):
    """ "ce": a link over TCP whose CUDA specs take the copy-engine path; "tcp"/"ucx": CUDA specs on that transport."""
    from cuda_workers import _cuda_path

    import tensorwire as tw

    _cuda_path(transport)
    transport = "tcp" if transport == "ce" else transport

    return tw.Node(rank=rank, world_size=world, store=store, transport=transport, device=_dev(rank))


def _pattern(spec, seed: int, device):
    import torch

    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (spec.nbytes,), dtype=torch.uint8, generator=g)
    if spec.dtype == "bool":
        raw = raw % 2
    return raw.view(spec.torch_dtype).reshape(spec.shape).to(device)


def _bits(t):
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def every_dtype(rank, world, store, transport):
    """Rank 0 sends one CUDA tensor per dtype (and one CPU tensor); rank 1 checks the bits and echoes them back."""
    import torch

    import tensorwire as tw
    from tensorwire.spec import DTYPES

    dev = _dev(rank)
    specs = [tw.TensorSpec(f"d.{d}", (3, 1000), d, "cuda") for d in DTYPES]
    specs += [tw.TensorSpec("big", (64 << 20,), "uint8", "cuda"), tw.TensorSpec("host", (4096,), "float32", "cpu")]
    echo = [s.with_name("echo." + s.name) for s in specs]
    with _node(rank, world, store, transport) as node:
        link = node.link(1 - rank, send=specs if rank == 0 else echo, recv=echo if rank == 0 else specs)
        bad = []
        for i, s in enumerate(specs):
            want = _pattern(s, i, dev if s.device == "cuda" else "cpu")
            if rank == 0:
                link.send(s.name, want)
                got = link.recv("echo." + s.name)
            else:
                got = link.recv(s.name)
                link.send("echo." + s.name, got)
            if got.device.type != s.device or not torch.equal(_bits(got), _bits(want)):
                bad.append(s.name)
        return {"transport": link.transport, "bad": bad}


def mixed_device_kinds(rank, world, store, transport):
    """Rank 0 declares the tensor on CUDA, rank 1 on the CPU: refused on both sides."""
    import tensorwire as tw

    spec = tw.TensorSpec("x", (16,), "float32", "cuda" if rank == 0 else "cpu")
    with _node(rank, world, store, transport) as node:
        node.link(1 - rank, send=[spec] if rank == 0 else [], recv=[] if rank == 0 else [spec])


def send_after_kernel(rank, world, store, transport):
    """The sender writes the tensor with a slow kernel queued on the current stream and sends at once."""
    import torch

    import tensorwire as tw

    dev = _dev(rank)
    spec = tw.TensorSpec("x", (16 << 20,), "float32", "cuda")
    ack = tw.TensorSpec("ack", (1,), "uint8")
    with _node(rank, world, store, transport) as node:
        if rank == 0:
            link = node.link(1, send=[spec], recv=[ack])
            x = torch.zeros(spec.shape, device=dev)
            for k in range(1, 6):
                torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time before the write
                x.fill_(float(k))  # queued behind the sleep; the send must wait for it
                link.send("x", x)
                link.recv("ack")
            return "sent"
        link = node.link(0, send=[ack], recv=[spec])
        wrong = []
        for k in range(1, 6):
            got = link.recv("x")
            # consumed by a kernel on the receiver's current stream, right away
            s = got.sum().item()
            if s != float(k) * got.numel():
                wrong.append((k, s))
            link.send("ack", torch.ones(1, dtype=torch.uint8))
        return wrong


def recv_consumed_by_kernel(rank, world, store, transport):
    """Many steps; the receiver feeds each received slot straight into kernels (no synchronize of its own)."""
    import torch

    import tensorwire as tw

    dev = _dev(rank)
    spec = tw.TensorSpec("x", (1 << 20,), "float32", "cuda")
    back = tw.TensorSpec("y", (1 << 20,), "float32", "cuda")
    with _node(rank, world, store, transport) as node:
        link = node.link(1 - rank, send=[spec] if rank == 0 else [back], recv=[back] if rank == 0 else [spec])
        bad = 0
        for step in range(50):
            if rank == 0:
                x = torch.full(spec.shape, float(step), device=dev)
                link.send("x", x)
                y = link.recv("y")
                bad += int(not torch.equal(y, x * 2 + 1))
            else:
                got = link.recv("x")
                y = got * 2 + 1  # kernel on the current stream reading the slot
                link.send("y", y)
        return bad


def _send_step_numbers(node, spec, steps: int, dev) -> int:
    """Rank 0 of the slot-reuse workers: message k of ``x`` is filled with float(k)."""
    import torch

    link = node.link(1, send=[spec])
    for step in range(steps):
        link.send("x", torch.full(spec.shape, float(step), device=dev))
    return 0


def slot_reused_while_a_kernel_reads_it(rank, world, store, transport):
    """The receiver queues slow work reading each received slot and keeps receiving (no sync of its own):
    a slot must not be overwritten by a later message while that work still reads it."""
    import torch

    import tensorwire as tw

    dev = _dev(rank)
    spec = tw.TensorSpec("x", (1 << 20,), "float32", "cuda")
    steps = 40
    with _node(rank, world, store, transport) as node:
        if rank == 0:
            return _send_step_numbers(node, spec, steps, dev)
        link = node.link(0, recv=[spec])
        sums = torch.zeros(steps, device=dev)
        for step in range(steps):
            got = link.recv("x")
            torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time before the slot is read
            sums[step] = got.sum()
        torch.cuda.current_stream(dev).synchronize()
        want = torch.arange(steps, device=dev, dtype=torch.float32) * spec.shape[0]
        return int((sums != want).sum().item())


def recv_out_copy_still_queued(rank, world, store, transport):
    """``recv(out=)`` with the copy queued behind slow work on the current stream: the slot must not be
    re-posted (and overwritten by a later message) before that copy has read it."""
    import torch

    import tensorwire as tw

    dev = _dev(rank)
    spec = tw.TensorSpec("x", (1 << 20,), "float32", "cuda")
    steps = 40
    with _node(rank, world, store, transport) as node:
        if rank == 0:
            return _send_step_numbers(node, spec, steps, dev)
        link = node.link(0, recv=[spec])
        outs = [torch.empty(spec.shape, device=dev) for _ in range(steps)]
        for step in range(steps):
            torch.cuda._sleep(2_000_000)  # ~1 ms of GPU time queued before the copy out of the slot
            link.recv("x", out=outs[step])
        torch.cuda.current_stream(dev).synchronize()
        return sum(int((o != float(i)).sum().item()) for i, o in enumerate(outs))


def deep_cuda_slots_read_late(rank, world, store, transport):
    """depth=4 CUDA slots: each received slot is read by slow work queued three recvs later; the slot
    must still hold its message (UCX: the slots themselves; TCP: staged, depth stays 2 -> copies)."""
    import torch

    import tensorwire as tw

    dev = _dev(rank)
    spec = tw.TensorSpec("x", (1 << 20,), "float32", "cuda")
    steps = 30
    with _node(rank, world, store, transport) as node:
        if rank == 0:
            return _send_step_numbers(node, spec, steps, dev)
        link = node.link(0, recv=[spec], depth=4)
        deep = link.depth("x") == 4
        sums = torch.zeros(steps, device=dev)
        window: list[tuple[int, "torch.Tensor"]] = []
        for step in range(steps):
            got = link.recv("x")
            window.append((step, got if deep else got.clone()))
            if len(window) == 3:  # read the oldest one only now, behind ~1 ms of GPU time
                j, t = window.pop(0)
                torch.cuda._sleep(2_000_000)
                sums[j] = t.sum()
        for j, t in window:
            sums[j] = t.sum()
        torch.cuda.current_stream(dev).synchronize()
        want = torch.arange(steps, device=dev, dtype=torch.float32) * spec.shape[0]
        return {"deep": deep, "bad": int((sums != want).sum().item())}


def staged_tcp_slots(rank, world, store, transport):
    """CUDA specs over TCP: staged through pinned host slots, bit-exact."""
    import torch

    import tensorwire as tw

    dev = _dev(rank)
    spec = tw.TensorSpec("x", (8 << 20,), "bfloat16", "cuda")
    with _node(rank, world, store, "tcp") as node:
        if rank == 0:
            link = node.link(1, send=[spec])
            link.send("x", _pattern(spec, 7, dev))
            return {"transport": link.transport, "pinned": [s.pinned for s in link.slots() if not s.is_cuda]}
        link = node.link(0, recv=[spec])
        got = link.recv("x")
        return {
            "transport": link.transport,
            "ok": bool(torch.equal(_bits(got), _bits(_pattern(spec, 7, dev)))),
            "device": got.device.type,
            "pinned": [s.pinned for s in link.slots() if not s.is_cuda],
        }


def _set_chunk(chunk) -> None:
    """Pin the staging chunk of this (spawned) rank; ``None`` keeps the default."""
    from tensorwire.p2p.staging import STAGING_CHUNK_ENV

    if chunk is None:
        os.environ.pop(STAGING_CHUNK_ENV, None)
    else:
        os.environ[STAGING_CHUNK_ENV] = str(chunk)


def _staged_specs(chunk: int):
    """Every dtype at a size that is not a multiple of the chunk, plus edge sizes around the chunk, and a dynamic spec."""
    import tensorwire as tw
    from tensorwire.p2p.staging import DEFAULT_CHUNK
    from tensorwire.spec import DTYPES

    c = chunk or DEFAULT_CHUNK
    specs = [tw.TensorSpec(f"d.{d}", (1000, 1037), d, "cuda") for d in DTYPES]  # 1.04e6 elements: 1..8 chunks of 1 MiB
    for label, n in (
        ("empty", 0),
        ("one", 1),
        ("below", c - 1),
        ("exact", c),
        ("above", c + 1),
        ("three_and_a_bit", 3 * c + 12345),
        ("many", 64 * c + 3),
    ):
        specs.append(tw.TensorSpec(f"u8.{label}", (n,), "uint8", "cuda"))
    specs.append(tw.TensorSpec("scalar", (), "float64", "cuda"))
    specs.append(tw.TensorSpec("dyn", (64, 4099), "float32", "cuda", dynamic=[0]))
    return specs


def staged_every_dtype_and_size(rank, world, store, transport, chunk=None, steps=3):
    """TCP-staged CUDA specs: rank 0 sends each spec ``steps`` times (new bits each time), rank 1 checks and echoes
    the received slot straight back (a send of a slot right after its recv), rank 0 checks the echo."""
    import torch

    _set_chunk(chunk)
    dev = _dev(rank)
    from tensorwire.p2p.staging import DEFAULT_CHUNK

    specs = _staged_specs(int(chunk) if chunk not in (None, "") else DEFAULT_CHUNK)
    echo = [s.with_name("echo." + s.name) for s in specs]
    with _node(rank, world, store, "tcp") as node:
        link = node.link(1 - rank, send=specs if rank == 0 else echo, recv=echo if rank == 0 else specs)
        bad = []
        plans = {s.name: (len(link.staging_plan(s.name)) if link.staging_plan(s.name) else None) for s in specs}
        for step in range(steps):
            for i, s in enumerate(specs):
                if s.is_dynamic:
                    rows = (64, 1, 37)[step % 3]
                    want = _pattern(s, 100 * step + i, dev)[:rows]
                else:
                    want = _pattern(s, 100 * step + i, dev)
                if rank == 0:
                    link.send(s.name, want)
                    got = link.recv("echo." + s.name)
                else:
                    got = link.recv(s.name)
                    link.send("echo." + s.name, got)
                if got.device.type != "cuda" or got.shape != want.shape or not torch.equal(_bits(got), _bits(want)):
                    bad.append((step, s.name))
        return {"transport": link.transport, "bad": bad, "plans": plans}


def staged_streams_and_isend(rank, world, store, transport, numel=(3 << 20) + 77):
    """Sender writes on a non-default stream with a slow kernel first, then send / isend from inside that stream;
    receiver consumes on its own non-default stream, sometimes through out= (CUDA and CPU)."""
    import torch

    import tensorwire as tw

    dev = _dev(rank)
    spec = tw.TensorSpec("x", (numel,), "float32", "cuda")
    ack = tw.TensorSpec("ack", (1,), "uint8")
    with _node(rank, world, store, transport) as node:
        if rank == 0:
            link = node.link(1, send=[spec], recv=[ack])
            s = torch.cuda.Stream(device=dev)
            x = torch.zeros(spec.shape, device=dev)
            with torch.cuda.stream(s):
                for k in range(1, 9):
                    torch.cuda._sleep(50_000_000)
                    x.fill_(float(k))
                    if k % 2:
                        link.send("x", x)
                    else:
                        link.isend("x", x).wait(60)
                    link.recv("ack")
            return "sent"
        link = node.link(0, send=[ack], recv=[spec])
        s2 = torch.cuda.Stream(device=dev)
        out_dev = torch.empty(spec.shape, device=dev)
        out_cpu = torch.empty(spec.shape)
        wrong = []
        with torch.cuda.stream(s2):
            for k in range(1, 9):
                if k % 3 == 0:
                    got = link.recv("x", out=out_dev)
                    assert got is out_dev
                elif k % 3 == 1:
                    got = link.recv("x", out=out_cpu)
                    assert got is out_cpu
                else:
                    got = link.recv("x")
                total = float(got.double().sum().item())  # kernels on s2 (the current stream), no extra sync
                if total != float(k) * numel or float(got[-1]) != float(k):
                    wrong.append((k, total))
                link.send("ack", torch.ones(1, dtype=torch.uint8))
        return wrong


def staged_receive_war(rank, world, store, transport, numel=(3 << 20) + 4097, steps=10):
    """Back-to-back messages; the receiver queues a slow kernel and then a read of the slot, and calls recv again at
    once: the next message's host->device copies must wait for that read (the slot is valid until the next recv)."""
    import torch

    import tensorwire as tw

    dev = _dev(rank)
    spec = tw.TensorSpec("x", (numel,), "float32", "cuda")
    done = tw.TensorSpec("done", (1,), "uint8")
    with _node(rank, world, store, "tcp") as node:
        if rank == 0:
            link = node.link(1, send=[spec], recv=[done])
            x = torch.empty(spec.shape, device=dev)
            for k in range(1, steps + 1):
                x.fill_(float(k))
                link.send("x", x)
            link.recv("done")  # stay connected until the receiver has everything
            return "sent"
        link = node.link(0, send=[done], recv=[spec])
        acc = torch.zeros(spec.shape, device=dev, dtype=torch.float64)
        for _ in range(steps):
            got = link.recv("x")
            torch.cuda._sleep(100_000_000)  # the read below is queued behind ~50 ms of GPU time
            acc.add_(got)
        want = float(sum(range(1, steps + 1)))
        link.send("done", torch.ones(1, dtype=torch.uint8))
        return {
            "min": float(acc.min()),
            "max": float(acc.max()),
            "want": want,
            "chunks": len(link.staging_plan("x") or ()),
        }


def staged_no_new_allocations(rank, world, store, transport, steps=100):
    """100 steps, both directions at once, over the staged path: no CUDA caching-allocator or pinned-host
    allocation inside send/recv after the first step, slots never move, and the bytes are right."""
    import torch

    import tensorwire as tw

    dev = _dev(rank)
    a = tw.TensorSpec("a", ((3 << 20) + 5,), "float32", "cuda")  # 7 chunks of 2 MiB, the last one short
    b = tw.TensorSpec("b", (1 << 16,), "bfloat16", "cuda")  # one chunk
    mine, theirs = (a, b) if rank == 0 else (b, a)
    with _node(rank, world, store, "tcp") as node:
        link = node.link(1 - rank, send=[mine], recv=[theirs])
        x = torch.zeros(mine.shape, device=dev, dtype=mine.torch_dtype)

        def counters():
            d = torch.cuda.memory_stats(dev)
            h = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
            return (
                d.get("allocation.all.allocated", 0),
                d.get("segment.all.allocated", 0),
                h.get("active_requests.allocated", 0),
                h.get("num_host_alloc", 0),
            )

        def step(k):  # both ranks send, then receive: both directions at once, never a deadlock
            x.fill_(float(k % 200))
            link.send(mine.name, x)
            return link.recv(theirs.name)

        step(0)
        torch.cuda.synchronize(dev)
        ptrs = sorted(s.data_ptr for s in link.slots())
        grew = [0, 0, 0, 0]
        wrong = 0
        for k in range(1, steps + 1):
            c0 = counters()
            got = step(k)
            c1 = counters()
            grew = [g + (q - p) for g, p, q in zip(grew, c0, c1)]
            wrong += int(float(got[0]) != float(k % 200) or float(got[-1]) != float(k % 200))
        torch.cuda.synchronize(dev)
        return {
            "grew": grew,
            "wrong": wrong,
            "moved": ptrs != sorted(s.data_ptr for s in link.slots()),
            "chunks": len(link.staging_plan(mine.name) or ()),
        }


def staged_under_expandable_segments(rank, world, store, transport):
    """PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: CUDA slots come from cudaMalloc (outside the caching
    allocator, page-aligned) and the staged link stays bit-exact."""
    import torch

    import tensorwire as tw
    from tensorwire.buffers import PAGE, cuda_slot_source

    dev = _dev(rank)
    spec = tw.TensorSpec("x", (5 << 20,), "float16", "cuda")
    done = tw.TensorSpec("done", (1,), "uint8")
    torch.empty(1, device=dev)  # initialize the allocator
    before = torch.cuda.memory_allocated(dev)
    with _node(rank, world, store, "tcp") as node:
        link = node.link(1 - rank, send=[spec] if rank == 0 else [done], recv=[done] if rank == 0 else [spec])
        after = torch.cuda.memory_allocated(dev)
        cuda_slots = [s for s in link.slots() if s.is_cuda]
        ok = True
        for k in range(3):
            want = _pattern(spec, 40 + k, dev)
            if rank == 0:
                link.send("x", want)
            else:
                ok &= bool(torch.equal(_bits(link.recv("x")), _bits(want)))
        if rank == 0:
            link.recv("done")
        else:
            link.send("done", torch.ones(1, dtype=torch.uint8))
        return {
            "source": cuda_slot_source(),
            "outside": after == before,
            "ok": ok,
            "aligned": all(s.data_ptr % PAGE == 0 for s in cuda_slots),
            "n_cuda": len(cuda_slots),
        }


# -- tests -------------------------------------------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_every_dtype_bit_exact_gpu_to_gpu(transport):
    res = run_ranks(every_dtype, transport=transport, timeout=240)
    assert res[0]["bad"] == [] and res[1]["bad"] == []
    assert res[0]["transport"] == ("tcp" if transport == "ce" else transport)


@pytest.mark.timeout(120)
def test_gpu_spec_against_cpu_spec_is_refused_on_both_sides():
    res = run_ranks(mixed_device_kinds, transport="tcp", expect_fail=True, timeout=90)
    for r in (0, 1):
        assert res[r][0] == "error" and res[r][1] == "ShapeMismatchError", res[r]
        assert "cuda" in res[r][2] and "cpu" in res[r][2]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_send_right_after_a_kernel_writing_the_tensor(transport):
    res = run_ranks(send_after_kernel, transport=transport, timeout=240)
    assert res[1] == [], f"received stale data: {res[1]}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_received_slot_is_safe_on_the_current_stream(transport):
    assert run_ranks(recv_consumed_by_kernel, transport=transport, timeout=240)[0] == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_slot_is_not_overwritten_while_queued_work_still_reads_it(transport):
    assert run_ranks(slot_reused_while_a_kernel_reads_it, transport=transport, timeout=240)[1] == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_recv_into_out_is_not_overwritten_before_the_queued_copy_ran(transport):
    assert run_ranks(recv_out_copy_still_queued, transport=transport, timeout=240)[1] == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_deeper_cuda_slots_outlive_later_recvs(transport):
    res = run_ranks(deep_cuda_slots_read_late, transport=transport, timeout=240)[1]
    assert res == {"deep": transport in ("ucx", "ce"), "bad": 0}  # (TCP stages through depth-2 pinned slots)


@pytest.mark.timeout(300)
def test_tcp_staged_path_bit_exact_through_pinned_slots():
    res = run_ranks(staged_tcp_slots, transport="tcp", timeout=240)
    assert res[1]["ok"] and res[1]["device"] == "cuda"
    assert res[0]["transport"] == res[1]["transport"] == "tcp"
    assert res[0]["pinned"] and all(res[0]["pinned"]) and all(res[1]["pinned"])


_EXPANDABLE_CHILD = r"""
import ctypes, json, torch
import tensorwire.cuda as gpu
rep = gpu.expandable_segments()
lib = gpu.cudart()
lib.cudaIpcGetMemHandle.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
def ipc_ok(t):
    h = ctypes.create_string_buffer(64)
    ok = lib.cudaIpcGetMemHandle(h, ctypes.c_void_p(t.data_ptr())) == 0
    lib.cudaGetLastError()  # a failed call stays the runtime's "last error"; torch would raise it at its next check
    return ok
cached = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
before = torch.cuda.memory_allocated()
slot = gpu.alloc_cuda(64 << 20)
slot.fill_(7)
print(json.dumps({"expandable": rep.expandable, "cached_ipc": ipc_ok(cached), "slot_ipc": ipc_ok(slot),
                  "slot_outside_caching_allocator": torch.cuda.memory_allocated() == before,
                  "slot_ok": bool((slot == 7).all())}))
"""


@pytest.mark.timeout(120)
def test_expandable_segments_detected_and_cudamalloc_slots_stay_ipc_capable():
    import json

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(
        os.environ,
        PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
        PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    out = subprocess.run(
        [sys.executable, "-c", _EXPANDABLE_CHILD], capture_output=True, text=True, env=env, timeout=100
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["expandable"] is True
    assert got["slot_ipc"] and got["slot_ok"] and got["slot_outside_caching_allocator"]
    # what the warning is about: caching-allocator memory under expandable segments has no legacy IPC handle
    assert got["cached_ipc"] is False


@pytest.mark.timeout(300)
@pytest.mark.skipif(not HAVE_UCX, reason="ucxx not installed")
def test_ucx_gpu_link_correct_under_expandable_segments(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    res = run_ranks(every_dtype, transport="ucx", timeout=240)
    assert res[0]["bad"] == [] and res[1]["bad"] == []


# -- chunk-staged TCP path (CUDA specs over a host-only transport) -------------------------------------


@pytest.mark.timeout(420)
@pytest.mark.parametrize("chunk", [1 << 20, None, 0], ids=["chunk-1MiB", "chunk-default", "unchunked"])
def test_staged_tcp_every_dtype_and_size_bit_exact(chunk):
    res = run_ranks(staged_every_dtype_and_size, transport="tcp", chunk=chunk, timeout=360)
    assert res[0]["transport"] == "tcp"
    assert res[0]["bad"] == [] and res[1]["bad"] == []
    from tensorwire.p2p.staging import DEFAULT_CHUNK, chunk_plan

    wire_chunk = DEFAULT_CHUNK if chunk is None else chunk
    want = {
        s.name: None if s.is_dynamic else len(chunk_plan(s.nbytes, wire_chunk))
        for s in _staged_specs(wire_chunk or DEFAULT_CHUNK)
    }
    assert res[0]["plans"] == want
    assert want["dyn"] is None  # dynamic specs keep the whole-message path
    if chunk == 0:
        assert all(v == 1 for v in want.values() if v is not None)
    else:  # the chunked path is really taken, including ragged tails and the 64-chunk cap
        assert want["u8.exact"] == 1 and want["u8.above"] == 2 and want["u8.three_and_a_bit"] == 4
        assert 1 < want["u8.many"] <= 64 and want["d.float64"] > 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["tcp", "ucx"])
def test_send_and_isend_order_after_the_callers_stream_and_serve_other_streams(transport):
    """TCP: the chunk-staged path; UCX: straight from device memory, isend posted in the caller's thread."""
    if transport == "ucx":
        pytest.importorskip("ucxx")
    res = run_ranks(staged_streams_and_isend, transport=transport, timeout=240)
    assert res[1] == [], f"stale or partial data on the receiver: {res[1]}"


@pytest.mark.timeout(300)
def test_staged_tcp_next_recv_waits_for_work_still_reading_the_slot():
    res = run_ranks(staged_receive_war, transport="tcp", timeout=240)
    from tensorwire.p2p.staging import chunk_plan

    r = res[1]
    assert r["chunks"] == len(chunk_plan(((3 << 20) + 4097) * 4)) > 1  # staged_receive_war's spec, in chunks
    assert r["min"] == r["max"] == r["want"], r


@pytest.mark.timeout(300)
def test_staged_tcp_100_steps_allocate_nothing():
    res = run_ranks(staged_no_new_allocations, transport="tcp", timeout=240)
    for rank, r in res.items():
        assert r["wrong"] == 0, (rank, r)
        assert not r["moved"], (rank, r)
        assert r["grew"] == [0, 0, 0, 0], (rank, r)  # cuda allocs, cuda segments, pinned handouts, pinned allocs
    from tensorwire.p2p.staging import chunk_plan

    assert res[0]["chunks"] == len(chunk_plan(((3 << 20) + 5) * 4)) > 1 and res[1]["chunks"] == 1


@pytest.mark.timeout(300)
def test_staged_tcp_slots_from_cudamalloc_under_expandable_segments(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    res = run_ranks(staged_under_expandable_segments, transport="tcp", timeout=240)
    assert res[1]["ok"]
    for r in res.values():
        assert r["source"] == "cudaMalloc" and r["outside"] and r["aligned"], r
    assert res[1]["n_cuda"] == 1  # the device slot the staged bytes land in


@pytest.mark.timeout(120)
def test_staging_engines_with_real_streams_in_one_process():
    """StagedSender -> in-process transport -> StagedReceiver with real CUDA streams and events, slow kernels
    before each send and before each read (bisects Link/socket problems from stream problems)."""
    import threading

    from tensorwire.p2p.staging import StagedReceiver, StagedSender, chunk_plan
    from tensorwire.transport.memory import memory_pair

    n = (5 << 20) + 12345
    plan = chunk_plan(n, 1 << 20)
    assert len(plan) == 6
    tx, rx = memory_pair()
    dev = torch.device("cuda", 0)
    pinned = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for _ in range(3)]
    sender = StagedSender(pinned[0], plan)
    slot = torch.empty(n, dtype=torch.uint8, device=dev)
    receiver = StagedReceiver(pinned[1:], slot, plan)
    receiver.post_all(rx, 0)
    steps = 8
    want = [
        torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(k)) for k in range(steps)
    ]
    errors = []

    def send_all():
        try:
            torch.cuda.set_device(dev)
            src = torch.empty(n, dtype=torch.uint8, device=dev)
            staged = [w.to(dev) for w in want]
            side = torch.cuda.Stream(device=dev)
            step = 0
            for k in range(steps):
                torch.cuda._sleep(20_000_000)
                src.copy_(staged[k])  # queued behind the sleep on this thread's current stream
                step = sender.send(tx, 0, src, step=step, timeout=30, current=torch.cuda.current_stream(dev), side=side)
                src.zero_()  # bytes are out: the tensor may change at once
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    th = threading.Thread(target=send_all, daemon=True)
    th.start()
    side = torch.cuda.Stream(device=dev)
    seen = []
    for _ in range(steps):
        receiver.recv(rx, 0, timeout=30, current=torch.cuda.current_stream(dev), side=side)
        torch.cuda._sleep(20_000_000)
        seen.append(slot.clone())  # on the current stream, behind the sleep
    th.join(60)
    assert not errors, errors
    for k in range(steps):
        assert torch.equal(seen[k].cpu(), want[k]), k
