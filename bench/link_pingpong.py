"""A Link's 4 KiB ping-pong over TCP between two processes: round trip (median) and CPU per round trip.

``--trees A,B`` runs the same ping-pong with ``PYTHONPATH`` set to each source tree in turn (A B A B ...),
so both versions of the code see the same load; each line is one run. Without it, the tree this file
belongs to. The CPU is each process's user + system time over the timed round trips (``os.times``: 10 ms
ticks, so at least a few thousand round trips).

Usage::

    python3 bench/link_pingpong.py --turns 4 --trees /tmp/old,/tmp/new
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pathlib
import subprocess
import sys
import time
from datetime import timedelta

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _rank(rank: int, port: int, n: int, warm: int, size: int, q) -> None:
    import torch
    from torch.distributed import TCPStore

    import tensorwire as tw

    torch.set_num_threads(1)
    store = TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=120))
    data, ack = tw.TensorSpec("d", (size,), "uint8"), tw.TensorSpec("a", (1,), "uint8")
    with tw.Node(rank=rank, world_size=2, store=store, transport="tcp", timeout=120) as node:
        if rank == 0:
            link = node.link(1, send=[data], recv=[ack])
            src = torch.zeros(size, dtype=torch.uint8)
            times = []
            for i in range(warm + n):
                if i == warm:
                    c0 = os.times()
                t0 = time.perf_counter()
                link.send("d", src)
                link.recv("a")
                times.append(time.perf_counter() - t0)
        else:
            link = node.link(0, send=[ack], recv=[data])
            one = torch.ones(1, dtype=torch.uint8)
            for i in range(warm + n):
                if i == warm:
                    c0 = os.times()
                link.recv("d")
                link.send("a", one)
        c1 = os.times()
        cpu = (c1.user - c0.user + c1.system - c0.system) / n
        store.set(f"done{rank}", "1")
        store.wait([f"done{1 - rank}"])  # neither closes while the other still waits for a message
        times = sorted(times[warm:]) if rank == 0 else []
        q.put((rank, cpu, times[len(times) // 2] if times else None))


def one_run(n: int, size: int) -> tuple[float, float]:
    """(median round trip, CPU of both processes per round trip), seconds."""
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=120), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, store.port, n, 300, size, q)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        got = [q.get(timeout=300) for _ in procs]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    rtt = next(m for r, _, m in got if r == 0)
    return rtt, sum(c for _, c, _ in got)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--n", type=int, default=2000, help="timed round trips per run")
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--trees", default="", help="comma-separated source trees, run in turns")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        rtt, cpu = one_run(a.n, a.size)
        print(f"{rtt * 1e6:.1f} {cpu * 1e6:.1f}")
        return 0
    trees = a.trees.split(",") if a.trees else [str(ROOT)]
    print(f"# Link ping-pong, tcp, {a.size} B there, 1 B back, {a.n} round trips per run")
    print(f"# load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| turn | tree | round trip (median) | CPU per round trip, both processes |")
    print("| --- | --- | ---: | ---: |")
    for t in range(a.turns):
        for tree in trees:
            env = dict(os.environ, PYTHONPATH=tree)
            out = subprocess.run(
                [sys.executable, __file__, "--child", "--n", str(a.n), "--size", str(a.size)],
                capture_output=True,
                text=True,
                timeout=600,
                cwd="/",
                env=env,
            )
            if out.returncode:
                print(out.stderr[-2000:], file=sys.stderr)
                return 1
            rtt, cpu = out.stdout.split()
            print(f"| {t + 1} | {tree} | {rtt} µs | {cpu} µs |", flush=True)
    print(f"# load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
