"""Where does a tensorwire UCX message between two GPUs spend its time? (GPU0 -> GPU1, one host)

Each variant runs in a fresh pair of processes and streams N messages of each
size from GPU0 to GPU1 (one send at a time, as ``tensorwire bench``'s
unidirectional pattern), then one 1-byte ack. Printed: µs per message and GB/s.

Variants:
  raw           ucxx core API, context with TAG only, caller polls worker.progress()
  raw-wake      the same context with WAKEUP + blocking progress mode initialised (tensorwire's flags)
  raw-chunkK    raw, each message sent as K equal UCX messages posted at once (intra-message pipelining)
  raw-2post     raw, the receiver keeps two receives posted (double buffer) like tensorwire
  tw-transport  tensorwire's UcxListener/UcxTransport directly: two slots posted, credits
  tw-link       tensorwire Node/Link, as the benchmark uses them; the time in the transport calls is split out
  tw-trace      tw-link with a timeline of Link/transport events on both sides (medians of the gaps)

Usage (on a 2-GPU host): python bench/gpu_ucx_probe.py [--variants ...] [--sizes 1M,16M]
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import statistics
import sys
import time

DEV = "cpu" if os.environ.get("PROBE_CPU") else "cuda"
ITERS = {1 << 20: 300, 4 << 20: 200, 16 << 20: 100, 64 << 20: 40, 256 << 20: 16}


def _parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
    return int(s[:-1] if s[-1] in "KMG" else s) * mult


def _chunks(t, variant: str, Array) -> list:
    """raw-chunkK: the message as K equal UCX messages posted at once (None: one message)."""
    if not variant.startswith("raw-chunk"):
        return []
    k = int(variant[len("raw-chunk"):] or 4)
    n = t.numel() // k
    return [Array(c if c.is_cuda else c.numpy()) for c in (t[i * n:(i + 1) * n] for i in range(k))]


def _raw(rank: int, variant: str, sizes: list[int], q, aq) -> None:
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import torch

    if DEV == "cuda":
        torch.cuda.set_device(rank)
    import ucxx._lib.libucxx as u
    from ucxx._lib.arr import Array

    feats = (u.Feature.TAG, u.Feature.WAKEUP) if variant == "raw-wake" else (u.Feature.TAG,)
    ctx = u.UCXContext(feature_flags=feats)
    w = u.UCXWorker(ctx)
    if variant == "raw-wake":
        w.init_blocking_progress_mode()
    aq[rank].put(w.address.tobytes())
    ep = u.UCXEndpoint.create_from_worker_address(w, u.UCXAddress.create_from_buffer(aq[1 - rank].get()), False)

    def wait(*rs):
        for r in rs:
            while not r.completed:
                w.progress()
            r.check_error()

    ack = Array(torch.zeros(1, dtype=torch.uint8).numpy())
    res = {}
    for n in sizes:
        it = ITERS.get(n, 50)
        if rank == 0:
            src = torch.full((n,), 7, dtype=torch.uint8, device=DEV)
            a = Array(src if DEV == "cuda" else src.numpy())
            chunks = _chunks(src, variant, Array)
            DEV == "cuda" and torch.cuda.synchronize()
            times = []
            for rep in range(4):
                t0 = time.perf_counter()
                for _ in range(it):
                    if chunks:
                        wait(*[ep.tag_send(c, tag=u.UCXXTag(1)) for c in chunks])
                    else:
                        wait(ep.tag_send(a, tag=u.UCXXTag(1)))
                wait(ep.tag_recv(ack, tag=u.UCXXTag(2)))
                if rep:
                    times.append((time.perf_counter() - t0) / it)
            res[n] = min(times)
        else:
            bufs = [torch.empty(n, dtype=torch.uint8, device=DEV) for _ in range(2)]
            arrs = [Array(b if DEV == "cuda" else b.numpy()) for b in bufs]
            two = variant == "raw-2post"
            for rep in range(4):
                if two:
                    posted = collections.deque(ep.tag_recv(arrs[i % 2], tag=u.UCXXTag(1)) for i in range(min(2, it)))
                    for i in range(it):
                        wait(posted.popleft())
                        if i + 2 < it:
                            posted.append(ep.tag_recv(arrs[i % 2], tag=u.UCXXTag(1)))
                elif variant.startswith("raw-chunk"):
                    rch = _chunks(bufs[0], variant, Array)
                    for _ in range(it):
                        wait(*[ep.tag_recv(c, tag=u.UCXXTag(1)) for c in rch])
                else:
                    for _ in range(it):
                        wait(ep.tag_recv(arrs[0], tag=u.UCXXTag(1)))
                wait(ep.tag_send(ack, tag=u.UCXXTag(2)))
            assert int(bufs[0][0]) == 7
    if rank == 0:
        q.put(res)
    time.sleep(0.5)


def _tw(rank: int, variant: str, sizes: list[int], q, aq) -> None:
    import torch

    if DEV == "cuda":
        torch.cuda.set_device(rank)
    from tensorwire.spec import TensorSpec

    res: dict[int, float] = {}
    split: dict[int, dict[str, float]] = {}
    if variant == "tw-transport":
        import secrets

        from tensorwire.transport.ucx import UcxListener

        if rank == 1:
            lst = UcxListener("127.0.0.1")
            nonce = secrets.token_bytes(16)
            lst.expect(nonce)
            aq[1].put((lst.address[1], nonce))
            t = lst.accept(nonce, timeout=60)
        else:
            port, nonce = aq[1].get()
            t = UcxListener.connect("127.0.0.1", port, nonce, timeout=60)
        ack = torch.zeros(1, dtype=torch.uint8)
        for n in sizes:
            it = ITERS.get(n, 50)
            if rank == 0:
                src = torch.full((n,), 7, dtype=torch.uint8, device=DEV)
                DEV == "cuda" and torch.cuda.synchronize()
                t.post_recv(100 + n.bit_length(), ack)
                times = []
                for rep in range(4):
                    t0 = time.perf_counter()
                    for _ in range(it):
                        t.send(n.bit_length(), src, timeout=60)
                    t.wait_recv(100 + n.bit_length(), timeout=60)
                    t.post_recv(100 + n.bit_length(), ack)
                    if rep:
                        times.append((time.perf_counter() - t0) / it)
                res[n] = min(times)
            else:
                slots = [torch.empty(n, dtype=torch.uint8, device=DEV) for _ in range(2)]
                for s in slots:
                    t.post_recv(n.bit_length(), s)
                k = 0
                for rep in range(4):
                    for _ in range(it):
                        t.wait_recv(n.bit_length(), timeout=60)
                        t.post_recv(n.bit_length(), slots[k % 2])
                        k += 1
                    t.send(100 + n.bit_length(), ack, timeout=60)
        time.sleep(0.5)
        t.close()
    else:
        from torch.distributed import TCPStore

        from tensorwire.p2p.node import Node

        tlog = _install_trace(rank) if variant == "tw-trace" else None
        if tlog is not None and rank == 0 and DEV == "cuda":
            dev = torch.device("cuda", 0)
            costs = {}
            for label, fn in (("current_stream(dev)", lambda: torch.cuda.current_stream(dev)),
                              ("current_stream(dev).synchronize()", lambda: torch.cuda.current_stream(dev).synchronize()),
                              ("current_stream(dev).query()", lambda: torch.cuda.current_stream(dev).query()),
                              ("torch.cuda.synchronize()", torch.cuda.synchronize)):
                for _ in range(100):
                    fn()
                t0 = time.perf_counter()
                for _ in range(2000):
                    fn()
                costs[label] = round((time.perf_counter() - t0) / 2000 * 1e6, 2)
            q.put(("cuda-costs-us", costs))

        if rank == 0:
            store = TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
            aq[1].put(store.port)
        else:
            store = TCPStore("127.0.0.1", aq[1].get(), 2, False)
        node = Node(rank=rank, world_size=2, store=store, transport="ucx", timeout=60, device=torch.device("cuda", rank) if DEV == "cuda" else None)
        for n in sizes:
            it = ITERS.get(n, 50)
            data = TensorSpec("data", (n,), "uint8", DEV)
            acks = TensorSpec("ack", (1,), "uint8", "cpu")
            if rank == 0:
                link = node.link(1, send=[data], recv=[acks], name=f"p{n}")
            else:
                link = node.link(0, send=[acks], recv=[data], name=f"p{n}")
            tr = link._t
            acc = {"send": 0.0, "post": 0.0, "wait": 0.0, "call": 0.0}
            orig = {k: getattr(tr, k) for k in ("send", "post_recv", "wait_recv", "repost_and_wait")}

            def timed(key, fn):
                def inner(*a, **kw):
                    t0 = time.perf_counter()
                    try:
                        return fn(*a, **kw)
                    finally:
                        acc[key] += time.perf_counter() - t0
                return inner

            tr.send = timed("send", orig["send"])
            tr.post_recv = timed("post", orig["post_recv"])
            tr.wait_recv = timed("wait", orig["wait_recv"])
            tr.repost_and_wait = timed("wait", orig["repost_and_wait"])
            if rank == 0:
                src = torch.full((n,), 7, dtype=torch.uint8, device=DEV)
                DEV == "cuda" and torch.cuda.synchronize()
                times = []
                for rep in range(4):
                    for k in acc:
                        acc[k] = 0.0
                    if tlog is not None:
                        tlog.clear()
                    t0 = time.perf_counter()
                    for _ in range(it):
                        link.send("data", src)
                    link.recv("ack")
                    if rep:
                        times.append((time.perf_counter() - t0) / it)
                if tlog is not None:
                    q.put(("trace0", n, list(tlog)))
                res[n] = min(times)
                split[n] = {k: v / it * 1e6 for k, v in acc.items()}
                aq[0].put("done")
            else:
                ackt = torch.ones(1, dtype=torch.uint8)
                for rep in range(4):
                    for k in acc:
                        acc[k] = 0.0
                    if tlog is not None:
                        tlog.clear()
                    t0 = time.perf_counter()
                    for _ in range(it):
                        t1 = time.perf_counter()
                        link.recv("data")
                        acc["call"] += time.perf_counter() - t1
                    link.send("ack", ackt)
                if tlog is not None:
                    q.put(("trace1", n, list(tlog)))
                q.put(("rx", n, {k: v / it * 1e6 for k, v in acc.items()}))
                aq[0].get()
            link.close()
        node.close()
    if rank == 0:
        q.put(res)
        if split:
            q.put(("tx", split))
    time.sleep(0.3)


def _install_trace(rank: int) -> list:
    """Record (event, perf_counter) at the hot points of Link and the UCX transport (CLOCK_MONOTONIC: comparable
    between the two processes of one host)."""
    from tensorwire.p2p import node as twnode
    from tensorwire.transport import ucx as twucx

    log: list = []
    pc = time.perf_counter

    def wrap(cls, name, ev_in, ev_out=None):
        fn = getattr(cls, name)

        def inner(*a, **kw):
            log.append((ev_in, pc()))
            try:
                return fn(*a, **kw)
            finally:
                if ev_out:
                    log.append((ev_out, pc()))
        setattr(cls, name, inner)

    wrap(twnode.Link, "send", "S_enter", "S_exit")
    wrap(twnode.Link, "recv", "R_enter", "R_exit")
    wrap(twucx.UcxTransport, "_post_send", "S_post")
    wrap(twucx.UcxTransport, "_post_locked", "R_post", "R_posted")
    wrap(twucx.UcxTransport, "_finish", "R_fin")
    return log


def _trace_report(rank: int, log: list) -> dict:
    return {"rank": rank, "events": log}


def _analyse(tx: list, rx: list) -> str:
    import collections as c

    by = c.defaultdict(list)
    for ev, t in tx:  # the sender's sends (its ack receive is not traced as S_*)
        if ev.startswith("S_"):
            by[ev].append(t)
    for ev, t in rx:  # the receiver's data receives
        if ev.startswith("R_"):
            by[ev].append(t)
    n = min(len(by["S_post"]), len(by["R_fin"]))
    if n < 10:
        return "trace: too few events"
    lines = []
    # steady state: skip the first and last few
    ks = range(3, n - 3)

    def med(xs):
        xs = [x for x in xs if x is not None]
        return statistics.median(xs) * 1e6 if xs else float("nan")

    def after(ev, t0):
        for t in by[ev]:
            if t >= t0:
                return t
        return None

    rows = {
        "S_post -> R_fin (transfer seen done by receiver)": [by["R_fin"][k] - by["S_post"][k] for k in ks],
        "R_fin -> S_exit (sender sees completion, returns)": [(after("S_exit", by["R_fin"][k]) or 0) - by["R_fin"][k] for k in ks],
        "S_exit -> next S_post (sender outside + pre-post)": [(after("S_post", by["S_exit"][k]) or 0) - by["S_exit"][k] for k in ks if k < len(by["S_exit"])],
        "S_enter -> S_post (Link.send until the data is posted)": [by["S_post"][k] - by["S_enter"][k] for k in ks],
        "R_fin -> R_exit (receiver finish)": [(after("R_exit", by["R_fin"][k]) or 0) - by["R_fin"][k] for k in ks],
        "R_exit -> next R_enter (caller)": [(after("R_enter", by["R_exit"][k]) or 0) - by["R_exit"][k] for k in ks if k < len(by["R_exit"])],
        "R_enter -> R_post (sync + wait start)": [(after("R_post", by["R_enter"][k]) or 0) - by["R_enter"][k] for k in ks if k < len(by["R_enter"])],
        "R_post -> R_posted (post cost)": [(after("R_posted", by["R_post"][k]) or 0) - by["R_post"][k] for k in ks if k < len(by["R_post"])],
        "S_post[k+1] - S_post[k] (period)": [by["S_post"][k + 1] - by["S_post"][k] for k in ks],
        "R_enter - S_post same k (receiver ahead if >0? )": [(after("R_enter", by["S_post"][k]) or 0) - by["S_post"][k] for k in ks],
    }
    for k, v in rows.items():
        lines.append(f"      {k:<52} {med(v):8.1f} us")
    return "\n".join(lines)


def _entry(rank: int, variant: str, sizes: list[int], q, aq) -> None:
    try:
        (_raw if variant.startswith("raw") else _tw)(rank, variant, sizes, q, aq)
    except BaseException as exc:  # noqa: BLE001
        import traceback

        traceback.print_exc()
        q.put(("error", rank, repr(exc)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="raw,raw-wake,raw-2post,tw-transport,tw-link,tw-trace")
    ap.add_argument("--sizes", default="1M,16M,64M,256M")
    args = ap.parse_args()
    sizes = [_parse_size(s) for s in args.sizes.split(",")]
    ctx = mp.get_context("spawn")
    for variant in args.variants.split(","):
        q = ctx.Queue()
        aq = [ctx.Queue(), ctx.Queue()]
        ps = [ctx.Process(target=_entry, args=(r, variant, sizes, q, aq)) for r in (0, 1)]
        for p in ps:
            p.start()
        res = None
        extra = []
        deadline = time.monotonic() + 240
        while res is None and time.monotonic() < deadline:
            try:
                item = q.get(timeout=5)
            except Exception:  # noqa: BLE001
                if not any(p.is_alive() for p in ps):
                    break
                continue
            if isinstance(item, dict):
                res = item
            elif item[0] == "error":
                print(f"{variant}: rank {item[1]} failed: {item[2]}", flush=True)
                break
            else:
                extra.append(item)
        try:
            while True:
                extra.append(q.get(timeout=2))
        except Exception:  # noqa: BLE001
            pass
        for p in ps:
            p.join(20)
            if p.is_alive():
                p.kill()
        if res:
            cells = ", ".join(f"{n >> 20} MiB {v * 1e6:7.1f} us {n / v / 1e9:6.1f} GB/s" for n, v in res.items())
            print(f"{variant:<13} {cells}", flush=True)
        traces: dict = {}
        for e in extra:
            if e[0] in ("trace0", "trace1"):
                traces.setdefault(e[1], {})[e[0]] = e[2]
                continue
            print(f"    {variant} {e}", flush=True)
        for n, tr in sorted(traces.items()):
            if len(tr) == 2:
                print(f"    trace {n >> 20} MiB (medians, steady state):", flush=True)
                print(_analyse(tr["trace0"], tr["trace1"]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
