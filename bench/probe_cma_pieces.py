"""A Link's host stream over TCP by the piece size of its cross-memory copies, against a raw socket (a probe, CPU).

Over TCP between two processes of one host, a Link's message of at least ``TENSORWIRE_CMA_MIN_BYTES`` is one
cross-memory-attach copy (``process_vm_writev``) by the sender straight into the receiver's slot, split into
pieces of at least ``PIECE_MIN`` (1 MiB) copied by up to ``TENSORWIRE_CMA_THREADS`` threads at once. So a 1 MiB
message is one copy on one core, while a raw socket's two copies (into the kernel, out of it) run on two cores
at once. This probe streams rounds of messages (``--messages`` per round, then a 1-byte ack) through a Link and
a raw socket (``tensorwire.benchmark.backends.rawtcp``'s ``tune``/``recv_exact``) in one pair of processes, the
Link with each piece size of ``--pieces`` (the sender's ``PIECE_MIN`` set between rounds), every variant in a
random order per turn. The layout is ``tensorwire bench``'s: one source, a link of default depth, one socket
buffer.

Usage::

    python3 bench/probe_cma_pieces.py --sizes 1M,4M --pieces 1M,512K,256K --turns 20
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import sys
import time
from datetime import timedelta
from typing import Any

from probe_common import run_pair, size_list

try:  # an installed (or PYTHONPATH's compiled) tensorwire first; else the checkout's own
    import tensorwire  # noqa: F401
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _variants(sizes: list[int], pieces: list[int]) -> list[tuple[int, int]]:
    """(size, piece) of a turn; piece 0 is the raw socket."""
    return [(s, p) for s in sizes for p in [0, *pieces]]


def _run(rank: int, port: int, a: argparse.Namespace) -> dict[str, Any]:
    import torch

    import tensorwire as tw
    from tensorwire.benchmark.backends.rawtcp import recv_exact, tune
    from tensorwire.benchmark.worker import pair_process_setup
    from tensorwire.transport.cma import syscalls
    from torch.distributed import TCPStore

    pair_process_setup()
    sizes, pieces = a.size_list, a.piece_list
    store = TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=300))
    specs = [tw.TensorSpec(f"m{s}", (s,), "uint8") for s in sizes]
    ack_spec = tw.TensorSpec("ack", (1,), "uint8")
    order = random.Random(a.seed)
    one = memoryview(bytearray(1))
    times: dict[str, list[float]] = {}
    cma = "?"
    with tw.Node(rank=rank, world_size=2, store=store, transport="tcp", timeout=300) as node:
        if rank == 0:
            link = node.link(1, send=specs, recv=[ack_spec])
            sock = tune(socket.create_connection(("127.0.0.1", int(store.get("probe/port"))), timeout=300), 300)
            srcs = {s: torch.full((s,), 7, dtype=torch.uint8) for s in sizes}
            views = {s: memoryview(t.numpy()) for s, t in srcs.items()}
        else:
            link = node.link(0, send=[ack_spec], recv=specs, depth=a.depth)
            lst = socket.create_server(("127.0.0.1", 0))
            store.set("probe/port", str(lst.getsockname()[1]))
            sock = tune(lst.accept()[0], 300)
            lst.close()
            bufs = {s: memoryview(torch.empty(s, dtype=torch.uint8).numpy()) for s in sizes}
            ack = torch.ones(1, dtype=torch.uint8)
        saved = syscalls.PIECE_MIN
        try:
            for turn in range(a.turns + 1):  # turn 0: warm-up, not kept
                plan = _variants(sizes, pieces)
                order.shuffle(plan)
                for size, piece in plan:
                    name = f"m{size}"
                    if piece:
                        syscalls.PIECE_MIN = piece  # (read by syscalls.copy at each call)
                    if rank == 0:
                        recv_exact(sock, one)  # the receiver is ready
                        t0 = time.perf_counter()
                        if piece:
                            for _ in range(a.messages):
                                link.send(name, srcs[size])
                            link.recv("ack")
                        else:
                            for _ in range(a.messages):
                                sock.sendall(views[size])
                            recv_exact(sock, one)
                        if turn:
                            times.setdefault(f"{size}/{piece}", []).append(time.perf_counter() - t0)
                    else:
                        sock.sendall(b"g")
                        if piece:
                            for _ in range(a.messages):
                                link.recv(name)
                            link.send("ack", ack)
                        else:
                            for _ in range(a.messages):
                                recv_exact(sock, bufs[size])
                            sock.sendall(b"k")
            cma = str(sorted({f.get("path") for f in tw.metrics().get("flows", []) if isinstance(f, dict)}))
        finally:
            syscalls.PIECE_MIN = saved
            sock.close()
    from tensorwire.settings import setting

    return {"times": times, "cma": cma, "threads": setting("cma_threads") or syscalls.default_threads()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1M,4M", help="message sizes (K/M suffixes)")
    ap.add_argument("--pieces", default="1M,512K,256K", help="piece sizes to try; the first is today's")
    ap.add_argument("--messages", type=int, default=32, help="messages per round")
    ap.add_argument("--depth", type=int, default=2, help="the receiver's slots per message size (Node.link's depth)")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if a.turns < 1 or a.messages < 1:
        ap.error("--turns and --messages must be >= 1")
    sizes = a.size_list = size_list(ap, "--sizes", a.sizes)
    pieces = a.piece_list = size_list(ap, "--pieces", a.pieces)
    from torch.distributed import TCPStore

    from tensorwire import native

    store = TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=300), wait_for_workers=False)
    print(
        f"# stream rounds ({a.messages} messages, then an ack), tcp, link depth {a.depth}, {a.turns} turns in random order; "
        f"{os.cpu_count()} cores; hot path {native.summary()}"
    )
    print(f"# load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    got = run_pair(_run, store.port, a)
    times = got[0]["times"]
    print(
        f"# paths the link counted its messages on (tensorwire.metrics): {got[0]['cma']}; copy threads: {got[0]['threads']}"
    )
    head = " | ".join(f"Link, pieces >= {p >> 10} KiB" for p in pieces)
    print(f"| message | raw socket | {head} | best Link / socket |")
    print("| --- | ---: |" + " ---: |" * (len(pieces) + 1))
    for s in sizes:
        rate = {p: s * a.messages / statistics.median(times[f"{s}/{p}"]) for p in [0, *pieces]}
        cells = " | ".join(f"{rate[p] / 1e9:.2f} GB/s" for p in pieces)
        best = max(rate[p] for p in pieces)
        print(f"| {s >> 10} KiB | {rate[0] / 1e9:.2f} GB/s | {cells} | {best / rate[0]:.2f}x |")
    print(f"# load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
