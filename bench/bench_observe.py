"""What counting and profiler ranges cost a message: tensorwire.observe on and off, in turns.

Four measurements, each in one process run, in turns (ABBA bursts: off on, on off, ...), so
that both settings see the same load:

1. **link**: 4 KiB round trips over a TCP Link pair in this process (both ends in one
   thread: ``send``, ``recv``, ``send`` of a 1-byte ack, ``recv``), host time
   (``perf_counter``) and CPU time (``thread_time``) per call, counting on vs off;
2. **backend**: ``dist.send``/``dist.recv`` of 4 KiB between two spawned ranks of
   ``backend="tensorwire"`` (TCP), host time per round trip on rank 0, both ranks
   switching counting at the same message counts;
   and the same with counting off in both turns (the bench's noise floor);
3. **hook**: the hooks alone around an operation that does nothing: ns per call,
   counting off, counting on (what a message pays for its counts);
4. **ranges**: ``torch.profiler.record_function`` entered and left with no profiler
   recording, against the check the hooks make instead (torch's profiler flag).

The issue-32 target: host time per 4 KiB message with counting on and no profiler
<= 1.02x counting off (the ``on / off`` medians of 1 and 2, over the burst pairs).

Usage::

    python3 bench/bench_observe.py --pairs 30 --burst 1000
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
import timeit
from datetime import timedelta
from typing import Any, Callable

SIZE = 4096


def _spread(xs: list[float], fmt: str) -> str:
    return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}..{max(xs):{fmt}})"


def _in_turns(
    run: Callable[[int], tuple[float, float]], set_on: Callable[[bool], None], pairs: int, burst: int
) -> dict:
    """ABBA bursts of ``run(burst)`` -> (wall s, cpu s); per pair the on/off ratio of each."""
    out: dict[str, list[float]] = {"off": [], "on": [], "off_cpu": [], "on_cpu": [], "ratio": [], "ratio_cpu": []}
    run(burst)  # warm
    for i in range(pairs):
        got: dict[bool, tuple[float, float]] = {}
        for on in (False, True) if i % 2 == 0 else (True, False):
            set_on(on)
            got[on] = run(burst)
        out["off"].append(got[False][0])
        out["on"].append(got[True][0])
        out["off_cpu"].append(got[False][1])
        out["on_cpu"].append(got[True][1])
        out["ratio"].append(got[True][0] / got[False][0])
        out["ratio_cpu"].append(got[True][1] / got[False][1])
    set_on(True)
    return out


def tcp_link_pair(name: str) -> tuple[Any, Any, Any]:
    """``(a, b, listener)``: the two ends of a Link over loopback TCP in this process (``a`` sends ``data``,
    ``SIZE`` bytes; ``b`` sends ``ack``, one byte). Close both ends and the listener after."""
    from tensorwire.p2p.link import Link
    from tensorwire.spec import TensorSpec
    from tensorwire.transport.base import new_nonce
    from tensorwire.transport.tcp import TcpListener

    lst = TcpListener("127.0.0.1", port=0)
    nonce = new_nonce()
    lst.expect(nonce)
    box: list[Any] = []
    th = threading.Thread(
        target=lambda: box.append(TcpListener.connect("127.0.0.1", lst.address[1], nonce, timeout=10))
    )
    th.start()
    tb = lst.accept(nonce, timeout=10)
    th.join(10)
    data, ack = TensorSpec("data", (SIZE,), "uint8", "cpu"), TensorSpec("ack", (1,), "uint8", "cpu")
    a = Link(node_rank=0, peer=1, name=name, transport=box[0], send=[data], recv=[ack], timeout=30.0, device=None)
    b = Link(node_rank=1, peer=0, name=name, transport=tb, send=[ack], recv=[data], timeout=30.0, device=None)
    return a, b, lst


# -- 1. Link ---------------------------------------------------------------------------------------------------
def link_turns(pairs: int, burst: int, *, null: bool = False) -> dict:
    """``null``: both turns with counting off (what the figures move by with nothing changed)."""
    import torch

    from tensorwire import observe

    a, b, lst = tcp_link_pair("b")
    src, one = torch.ones(SIZE, dtype=torch.uint8), torch.ones(1, dtype=torch.uint8)

    def run(k: int) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(k):
            a.send("data", src)
            b.recv("data")
            b.send("ack", one)
            a.recv("ack")
        return (time.perf_counter() - t0) / (4 * k), (time.thread_time() - c0) / (4 * k)  # per call

    try:
        return _in_turns(run, (lambda on: observe.set_enabled(False)) if null else observe.set_enabled, pairs, burst)
    finally:
        a.close()
        b.close()
        lst.close()


# -- 2. backend ------------------------------------------------------------------------------------------------
def _backend_rank(rank: int, port: int, pairs: int, burst: int, q: Any) -> None:
    os.environ["TENSORWIRE_TRANSPORT"] = "tcp"
    import torch
    import torch.distributed as dist

    import tensorwire  # noqa: F401 - registers the backend
    from tensorwire import observe

    store = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=60))
    dist.init_process_group("tensorwire", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    x = torch.ones(SIZE // 4)
    y = torch.empty(SIZE // 4)

    def run(k: int) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.thread_time()
        for _ in range(k):
            if rank == 0:
                dist.send(x, 1)
                dist.recv(y, 1)
            else:
                dist.recv(y, 0)
                dist.send(x, 0)
        return (time.perf_counter() - t0) / (2 * k), (time.thread_time() - c0) / (2 * k)  # per call

    try:
        res = _in_turns(run, observe.set_enabled, pairs, burst)
        q.put((rank, res))
    finally:
        dist.destroy_process_group()


def backend_turns(pairs: int, burst: int) -> dict:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=60), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_backend_rank, args=(r, store.port, pairs, burst, q), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = dict(q.get(timeout=600) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return results[0]


# -- 3. the hooks alone ------------------------------------------------------------------------------------------
def hook_cost(n: int = 200_000) -> dict[str, float]:
    import torch

    from tensorwire import observe
    from tensorwire.observe.hooks import GroupWatch, LinkWatch
    from tensorwire.spec import TensorSpec

    class _T:
        kind = "tcp"
        cma = None

    class _Work:  # a work complete when made (a host send the socket took at once): what the hooks read
        _is_done = True
        _exc = None

    spec = TensorSpec("data", (SIZE,), "uint8", "cpu")
    work = _Work()
    lw = LinkWatch(
        1,
        _T(),  # type: ignore[arg-type]
        send={"data": spec},
        recv={},
        do_send=lambda n, t, to: None,
        do_recv=lambda n, o, to: None,
        do_isend=lambda n, t, to: None,
    )
    gw = GroupWatch({1: _T()}, do_send=lambda ts, p, tag: work, do_recv=lambda ts, p, tag: work)  # type: ignore[dict-item]
    src = torch.ones(SIZE, dtype=torch.uint8)
    ts = [src]
    out: dict[str, float] = {}

    def best(fn: Callable[[], Any]) -> float:
        return min(timeit.repeat(fn, number=n, repeat=5)) / n * 1e9

    out["bare call"] = best(lambda: None)
    for on in (False, True):
        observe.set_enabled(on)
        out[f"Link.send hook, counting {'on' if on else 'off'}"] = best(lambda: lw.send("data", src, None))
        out[f"backend send hook, counting {'on' if on else 'off'}"] = best(lambda: gw.send(ts, 1, 0))
    observe.reset()
    return out


# -- 4. ranges with no profiler ----------------------------------------------------------------------------------
def range_cost(n: int = 20_000) -> dict[str, float]:
    import torch
    from torch.autograd.profiler import record_function

    def rf() -> None:
        with record_function("tensorwire.send peer=1 tag=0 bytes=4096 path=tcp"):
            pass

    flag = torch._C._autograd._profiler_enabled
    return {
        "record_function, no profiler": min(timeit.repeat(rf, number=n, repeat=5)) / n * 1e9,
        "profiler flag check (what the hooks do)": min(timeit.repeat(flag, number=n * 10, repeat=5)) / (n * 10) * 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=30, help="ABBA burst pairs per measurement")
    ap.add_argument("--burst", type=int, default=1000, help="round trips per burst")
    ap.add_argument("--skip-backend", action="store_true")
    args = ap.parse_args(argv)
    lines = [
        f"# observe: counting on vs off, 4 KiB messages ({args.pairs} ABBA burst pairs x {args.burst} round trips)",
        "",
        f"`python3 bench/bench_observe.py --pairs {args.pairs} --burst {args.burst}`; {os.cpu_count()} cores; "
        "median (min..max) over burst pairs.",
        "",
        "| what | off: host us/call | on: host us/call | on / off host | on / off CPU |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    parts: list[tuple[str, Callable[[int, int], dict]]] = [
        ("Link over TCP, one thread (4 calls per round trip)", link_turns),
        ("the same, off vs off (the noise floor: nothing differs)", lambda p, b: link_turns(p, b, null=True)),
    ]
    if not args.skip_backend:
        parts.append(("backend tensorwire over TCP, 2 ranks (rank 0, 2 calls per round trip)", backend_turns))
    for label, fn in parts:
        r = fn(args.pairs, args.burst)
        lines.append(
            f"| {label} | {_spread([x * 1e6 for x in r['off']], '.2f')} | {_spread([x * 1e6 for x in r['on']], '.2f')} "
            f"| {_spread(r['ratio'], '.3f')} | {_spread(r['ratio_cpu'], '.3f')} |"
        )
    lines += ["", "| the hooks alone (no transport) | ns per call |", "| --- | ---: |"]
    for k, v in {**hook_cost(), **range_cost()}.items():
        lines.append(f"| {k} | {v:.0f} |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
