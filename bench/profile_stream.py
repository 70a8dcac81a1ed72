"""Where a Link's host stream spends its time: both sides of a stream over TCP, timed, then under cProfile (CPU).

Rounds of ``--messages`` messages of ``--bytes`` from one source into a link of default depth, then a 1-byte ack
(``tensorwire bench``'s layout). Each process prints its rate, the wall and caller-thread CPU time per message,
and the functions taking the most time of their own under cProfile (a separate set of rounds).

Usage::

    python3 bench/profile_stream.py --bytes 1M --rounds 50
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import time
from datetime import timedelta

from probe_common import run_pair, size_list

try:  # an installed (or PYTHONPATH's compiled) tensorwire first; else the checkout's own
    import tensorwire  # noqa: F401
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(rank: int, port: int, a: argparse.Namespace) -> str:
    import torch

    import tensorwire as tw
    from tensorwire.benchmark.worker import pair_process_setup
    from torch.distributed import TCPStore

    pair_process_setup()
    size = a.size
    store = TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=120))
    spec = tw.TensorSpec("m", (size,), "uint8")
    ack = tw.TensorSpec("ack", (1,), "uint8")
    m = a.messages
    with tw.Node(rank=rank, world_size=2, store=store, transport="tcp", timeout=120) as node:
        if rank == 0:
            link = node.link(1, send=[spec], recv=[ack])
            src = torch.full((size,), 7, dtype=torch.uint8)

            def rounds(n: int) -> None:
                for _ in range(n):
                    for _ in range(m):
                        link.send("m", src)
                    link.recv("ack")
        else:
            link = node.link(0, send=[ack], recv=[spec])
            one = torch.ones(1, dtype=torch.uint8)

            def rounds(n: int) -> None:
                for _ in range(n):
                    for _ in range(m):
                        link.recv("m")
                    link.send("ack", one)

        rounds(max(2, a.rounds // 5))  # warm-up
        t0, c0 = time.perf_counter(), time.thread_time()
        rounds(a.rounds)
        wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
        prof = cProfile.Profile()
        prof.enable()
        rounds(max(1, a.rounds // 2))
        prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(a.top)
    n = a.rounds * m
    head = (
        f"rank {rank} ({'sender' if rank == 0 else 'receiver'}): {size * n / wall / 1e9:.2f} GB/s, "
        f"{wall / n * 1e6:.1f} us per message, the calling thread's CPU {cpu / n * 1e6:.1f} us per message"
    )
    return head + "\n" + "\n".join(ln for ln in out.getvalue().splitlines() if ln.strip())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bytes", default="1M", help="message size (K/M suffixes)")
    ap.add_argument("--messages", type=int, default=32, help="messages per round")
    ap.add_argument("--rounds", type=int, default=50, help="timed rounds (half as many under the profiler)")
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()
    if a.rounds < 1 or a.messages < 1:
        ap.error("--rounds and --messages must be >= 1")
    sizes = size_list(ap, "--bytes", a.bytes)
    if len(sizes) != 1:
        ap.error(f"--bytes: one size, not {a.bytes!r}")
    a.size = sizes[0]
    from torch.distributed import TCPStore

    from tensorwire import native

    store = TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=120), wait_for_workers=False)
    print(f"# a Link's stream over tcp, {a.bytes} x {a.messages} per round; {os.cpu_count()} cores; {native.summary()}")
    got = run_pair(_run, store.port, a, limit_s=600, what="the profile")
    for rank in sorted(got):
        print(got[rank])
    return 0


if __name__ == "__main__":
    sys.exit(main())
