"""Worker bodies for multi-process link tests (importable by spawned children)."""

from __future__ import annotations

import os
import signal
import time

import torch

import tensorwire as tw
from tensorwire.spec import DTYPES


def _node(rank, world, store, transport, **kw):
    return tw.Node(rank=rank, world_size=world, store=store, transport=transport, **kw)


def _pattern(spec: tw.TensorSpec, seed: int) -> torch.Tensor:
    """Deterministic bytes for any dtype (bit patterns, NaNs included)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (spec.nbytes,), dtype=torch.uint8, generator=g)
    if spec.dtype == "bool":
        raw = raw % 2
    return (
        raw.view(spec.torch_dtype).reshape(spec.shape)
        if spec.nbytes
        else torch.empty(spec.shape, dtype=spec.torch_dtype)
    )


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return bool(torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)))


def all_dtypes_and_shapes(rank, world, store, transport):
    """Rank 0 sends one tensor per dtype and per edge-case shape; rank 1 echoes them back."""
    specs = [tw.TensorSpec(f"d.{d}", (3, 5), d) for d in DTYPES]
    specs += [
        tw.TensorSpec("scalar", (), "float64"),
        tw.TensorSpec("empty", (0, 7), "float32"),
        tw.TensorSpec("one", (1,), "int8"),
        tw.TensorSpec("big", (256 << 20,), "uint8"),
    ]
    echo = [s.with_name("echo." + s.name) for s in specs]
    with _node(rank, world, store, transport) as node:
        if rank == 0:
            link = node.link(1, send=specs, recv=echo)
            for i, s in enumerate(specs):
                link.send(s.name, _pattern(s, i))
            bad = []
            for i, s in enumerate(specs):
                got = link.recv("echo." + s.name)
                if not _same_bits(got, _pattern(s, i)):
                    bad.append(s.name)
            return {"transport": link.transport, "bad": bad}
        link = node.link(0, send=echo, recv=specs)
        for s in specs:
            link.send("echo." + s.name, link.recv(s.name))
        return {"transport": link.transport}


def non_contiguous(rank, world, store, transport):
    spec = tw.TensorSpec("t", (4, 6), "float32")
    with _node(rank, world, store, transport) as node:
        if rank == 0:
            link = node.link(1, send=[spec])
            base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
            x = base[1:5, ::1][:, 2:8]  # a strided view, shape (4, 6)
            t = torch.arange(24, dtype=torch.float32).reshape(6, 4).t()  # transposed, shape (4, 6)
            assert not x.is_contiguous() and not t.is_contiguous()
            link.send("t", x)
            link.send("t", t)
            return [x.tolist(), t.tolist()]
        link = node.link(0, recv=[spec])
        return [link.recv("t").tolist(), link.recv("t").clone().tolist()]


def many_steps_both_directions(rank, world, store, transport, steps=1000, nbytes=64 << 10):
    """Both ranks send then receive every step: bit-exact, no deadlock."""
    n = nbytes // 4
    a, b = tw.TensorSpec("a", (n,), "float32"), tw.TensorSpec("b", (n,), "int32")
    with _node(rank, world, store, transport) as node:
        link = node.link(1 - rank, send=[a] if rank == 0 else [b], recv=[b] if rank == 0 else [a])
        mine, theirs = ("a", "b") if rank == 0 else ("b", "a")
        src = torch.arange(n, dtype=torch.float32 if rank == 0 else torch.int32)
        bad = 0
        ptrs = {s.data_ptr for s in link.slots()}
        for k in range(steps):
            src[0] = k
            link.send(mine, src)
            got = link.recv(theirs)
            if int(got[0]) != k or int(got[-1]) != n - 1:
                bad += 1
        assert ptrs == {s.data_ptr for s in link.slots()}, "slots moved"
        return bad


def mismatch(rank, world, store, transport):
    ok = tw.TensorSpec("x", (4, 4), "float32")
    wrong = tw.TensorSpec("x", (4, 5), "float32")
    with _node(rank, world, store, transport, timeout=20) as node:
        if rank == 0:
            node.link(1, send=[ok])
        else:
            node.link(0, recv=[wrong])
    return "no error"


def wrong_tensor_at_send(rank, world, store, transport):
    spec = tw.TensorSpec("x", (2, 2), "float32")
    with _node(rank, world, store, transport) as node:
        if rank == 0:
            link = node.link(1, send=[spec])
            errors = []
            for bad in (torch.zeros(2, 3), torch.zeros(2, 2, dtype=torch.float64), torch.zeros(4)):
                try:
                    link.send("x", bad)
                except tw.ShapeMismatchError as exc:
                    errors.append(str(exc))
            try:
                link.send("nope", torch.zeros(2, 2))
            except tw.ShapeMismatchError as exc:
                errors.append(str(exc))
            link.send("x", torch.full((2, 2), 7.0))
            store.wait(["wrong_tensor_done"])  # keep the link open until the peer has checked
            return errors
        link = node.link(0, recv=[spec])
        first = link.recv("x").tolist()
        try:
            link.recv("x", timeout=1.0)
            extra = "got a second message"
        except tw.TransferTimeout:
            extra = "timeout"
        store.set("wrong_tensor_done", "1")
        return first, extra


def peer_killed(rank, world, store, transport, timeout=10.0):
    spec = tw.TensorSpec("x", (1 << 20,), "uint8")
    with _node(rank, world, store, transport, timeout=timeout, peer_timeout=5.0) as node:
        link = node.link(1 - rank, send=[spec], recv=[spec])
        x = torch.zeros(1 << 20, dtype=torch.uint8)
        for _ in range(5):
            link.send("x", x)
            link.recv("x")
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.monotonic()
        try:
            for _ in range(1000):
                link.send("x", x)
                link.recv("x")
        except tw.PeerLostError as exc:
            return ("PeerLostError", time.monotonic() - t0, str(exc))
        except tw.TensorWireError as exc:
            return (type(exc).__name__, time.monotonic() - t0, str(exc))
        return ("no error", time.monotonic() - t0, "")


def memory_after_first_step(rank, world, store, transport, steps=1000):
    """1,000 steps of a 1 MiB exchange: RSS and Python heap flat after step 1, slots never move."""
    import gc
    import tracemalloc

    spec = tw.TensorSpec("m", (1 << 18,), "float32")  # 1 MiB
    with _node(rank, world, store, transport) as node:
        link = node.link(1 - rank, send=[spec], recv=[spec])
        x = torch.ones(1 << 18)
        link.send("m", x)
        link.recv("m")
        gc.collect()

        def rss() -> int:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

        ptrs = sorted(s.data_ptr for s in link.slots())
        tracemalloc.start()
        rss0 = rss()
        snap0 = tracemalloc.take_snapshot()
        for _ in range(steps):
            link.send("m", x)
            link.recv("m")
        gc.collect()
        snap1 = tracemalloc.take_snapshot()
        rss1 = rss()
        tracemalloc.stop()
        growth = sum(s.size_diff for s in snap1.compare_to(snap0, "filename"))
        return {
            "rss_growth": rss1 - rss0,
            "py_growth": growth,
            "slots_moved": ptrs != sorted(s.data_ptr for s in link.slots()),
        }


def dynamic_shapes(rank, world, store, transport):
    spec = tw.TensorSpec("act", (16, 8), "float32", dynamic=[0])
    with _node(rank, world, store, transport) as node:
        if rank == 0:
            link = node.link(1, send=[spec])
            for b in (16, 3, 1, 0, 9):
                link.send("act", torch.full((b, 8), float(b)))
            try:
                link.send("act", torch.zeros(17, 8))
            except tw.ShapeMismatchError as exc:
                return str(exc)
            return "no error"
        link = node.link(0, recv=[spec])
        out = []
        for _ in range(5):
            t = link.recv("act")
            out.append((tuple(t.shape), float(t.sum()) if t.numel() else 0.0))
        return out


def isend_and_out(rank, world, store, transport):
    spec = tw.TensorSpec("x", (1000,), "int64")
    with _node(rank, world, store, transport) as node:
        if rank == 0:
            link = node.link(1, send=[spec])
            handles = []
            bufs = [torch.arange(1000) * k for k in range(4)]
            for k in range(4):
                handles.append(link.isend("x", bufs[k]))
            for h in handles:
                h.wait(timeout=30)
            return "sent"
        link = node.link(0, recv=[spec])
        out = torch.empty(1000, dtype=torch.int64)
        res = []
        for _ in range(4):
            got = link.recv("x", out=out)
            assert got is out
            res.append(int(out[1]))
        return res


def isend_mixed_paths(rank, world, store, transport):
    """isends posted in the caller's thread (contiguous) and on the link's thread (non-contiguous), and plain
    sends, interleaved on one name: every message arrives whole and in order. Then, with the receiver not
    receiving, isends beyond its two posted slots time out having sent nothing, and the link still works
    (UCX only: TCP holds a re-posted slot's credit back until the receiver's next transport call)."""
    spec = tw.TensorSpec("x", (64, 32), "float32")
    phase2 = transport == "ucx"
    with _node(rank, world, store, transport, timeout=30) as node:
        if rank == 0:
            link = node.link(1, send=[spec])
            msgs = [torch.full((64, 32), float(k)) for k in range(12)]
            handles = []
            for k, m in enumerate(msgs):
                if k % 4 == 1:
                    handles.append(link.isend("x", m.t().contiguous().t()))  # non-contiguous: same values
                elif k % 4 == 3:
                    link.send("x", m)
                else:
                    handles.append(link.isend("x", m))
            for h in handles:
                h.wait(timeout=30)
                assert h.done()
            if not phase2:
                return None
            store.set("isend/phase2", "1")
            store.wait(["isend/ready"])
            # The receiver holds one slot and has one posted: one more message fits, the next has no credit.
            first = link.isend("x", torch.full((64, 32), 100.0))
            first.wait(timeout=10)
            late = None
            try:
                late = link.isend("x", torch.full((64, 32), 101.0), timeout=0.5)
                late.wait(timeout=0.5)
                timed_out = False
            except tw.TransferTimeout:
                timed_out = True
            store.set("isend/recv", "1")
            if late is None:  # refused, nothing sent: the link goes on
                link.send("x", torch.full((64, 32), 102.0))
            return ("timed_out" if timed_out else "no timeout", late is None)
        link = node.link(0, recv=[spec])
        got = [float(link.recv("x")[5, 7]) for _ in range(12)]
        if not phase2:
            return got
        store.wait(["isend/phase2"])
        store.set("isend/ready", "1")
        store.wait(["isend/recv"])
        got.append(float(link.recv("x")[0, 0]))
        got.append(float(link.recv("x")[0, 0]))
        return got


def relink_same_name(rank, world, store, transport, rounds=3):
    """Close and re-negotiate the same (peer, name) several times; the faster side never sees a stale offer."""
    spec = tw.TensorSpec("x", (4,), "int32")
    out = []
    with _node(rank, world, store, transport, timeout=30) as node:
        for r in range(rounds):
            if rank == 1:
                time.sleep(0.3 * (r % 2))  # alternate which side declares first
            link = node.link(1 - rank, send=[spec], recv=[spec])
            link.send("x", torch.full((4,), r + 10 * rank, dtype=torch.int32))
            out.append(int(link.recv("x")[0]))
            store.set(f"relink/{r}/{rank}", "1")
            store.wait([f"relink/{r}/{1 - rank}"])
            link.close()
    return out


def deep_slots(rank, world, store, transport):
    """depth=4 on "a" (2 on "b"): four sends complete before the receiver receives anything, each
    held slot keeps its message through three more recvs, and recv(out=) mixed with held slots keeps
    the order; "b" (default depth, too large to go eagerly over TCP) cannot take a third message ahead."""
    a = tw.TensorSpec("a", (1024,), "float32")
    nb = 32 * 1024  # 128 KiB: above EAGER_MAX_BYTES, so its sends wait for their credits over TCP too
    b = tw.TensorSpec("b", (nb,), "float32")
    steps = 24
    with _node(rank, world, store, transport) as node:
        if rank == 0:
            link = node.link(1, send=[a, b])
            for i in range(4):  # no recv on the other side yet: needs 4 posted slots
                link.send("a", torch.full((1024,), float(i)), timeout=20)
            link.send("b", torch.zeros(nb), timeout=20)
            link.send("b", torch.ones(nb), timeout=20)
            try:
                link.send("b", torch.ones(nb), timeout=1.0)
                third_b = "sent"
            except tw.TransferTimeout:
                third_b = "timeout"
            store.set("deep_sent", "1")
            for i in range(4, steps):
                link.send("a", torch.full((1024,), float(i)), timeout=20)
            store.wait(["deep_done"])
            return third_b
        link = node.link(0, recv=[a, b], depth={"a": 4})
        depth = (link.depth("a"), link.depth("b"))
        # The first "b" comes after the four "a"s: they went out while nothing of "a" was received.
        # (Blocking here in tensorwire also hands TCP's lazily sent credits to the peer.)
        b_vals = [link.recv("b").tolist()[0]]
        store.wait(["deep_sent"])
        bad = []
        held: list[tuple[int, torch.Tensor]] = []
        out = torch.empty(1024)
        for i in range(steps):
            if i % 5 == 3:
                got = link.recv("a", out=out)
                if not bool((got == float(i)).all()):
                    bad.append(("out", i))
            else:
                held.append((i, link.recv("a")))
            # every slot returned by the last depth-1 = 3 recvs still holds its message
            for j, t in held:
                if i - j < 3 and not bool((t == float(j)).all()):
                    bad.append(("held", j, "at", i))
            held = [(j, t) for j, t in held if i - j < 3]
        b_vals.append(link.recv("b").tolist()[0])
        store.set("deep_done", "1")
        return {"depth": depth, "bad": bad, "b": b_vals}


def eager_ahead(rank, world, store, transport):
    """A small message goes before its slot's credit reached the sender (TCP: into one of the link's eager
    buffers): EAGER_SLOTS of them at least (the receiver is not in tensorwire, so its credits may still be
    held back), two more at most (its two posted slots); then a send waits for a credit. All arrive, in order."""
    from tensorwire.p2p.link import EAGER_SLOTS

    spec = tw.TensorSpec("s", (64,), "float32")
    with _node(rank, world, store, transport) as node:
        if rank == 0:
            link = node.link(1, send=[spec])
            sent = 0
            try:
                for i in range(EAGER_SLOTS + 3):
                    link.send("s", torch.full((64,), float(i)), timeout=20 if i < EAGER_SLOTS else 1.0)
                    sent += 1
            except tw.TransferTimeout:
                pass
            store.set("eager_sent", str(sent))
            store.wait(["eager_done"])
            return sent
        link = node.link(0, recv=[spec])
        store.wait(["eager_sent"])
        got = []
        for _ in range(int(store.get("eager_sent"))):
            t = link.recv("s", timeout=20)
            got.append(t[0].item() if bool((t == t[0]).all()) else "mixed")
        store.set("eager_done", "1")
        return got


def bad_depth(rank, world, store, transport):
    spec = tw.TensorSpec("x", (4,), "float32")
    with _node(rank, world, store, transport) as node:
        errors = []
        for depth in (1, 65, 2.5, True, {"nope": 3}):
            try:
                node.link(1 - rank, send=[spec], recv=[spec], depth=depth, name="bad")
                errors.append(f"{depth!r}: accepted")
            except tw.ConfigError as exc:
                errors.append(str(exc))
        return errors
