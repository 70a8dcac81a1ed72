"""Why the demo's streams read slower than ``tensorwire bench``'s: the sender's sources (a probe, CPU).

(The demo now streams in the bench's layout -- :func:`tensorwire.benchmark.worker.recv_slots`; this probe keeps
the layout it had.) The demo sent each message of a round from a tensor of its own (32 sources of 1 MiB, 2 of 64 MiB: every
message carries its own values, so that the receiver can check each one); ``tensorwire bench`` sends every
message of a size from one tensor, which stays in the cache between messages. This probe streams the
demo's rounds (``messages`` messages, then a 1-byte ack) through a tensorwire Link over TCP and a raw socket
(``tensorwire.benchmark.backends.rawtcp``'s ``tune``/``recv_exact``), in one pair of processes, with the
messages of a round taken from one source or from a source each, in a random order per turn. The receiver
keeps the demo's layout in every variant: a buffer per message of a round (the Link: that depth). Nothing is
filled or checked: only the sources differ.

One more variant keeps the bench's layout and, before each round, has each side write a message's worth of
memory (the sender its source, the receiver a scratch tensor): what the demo's fill and check once did between
rounds (an expected copy of a whole message written to compare with), leaving the caches full of dirty lines.

Usage::

    python3 bench/probe_stream_sources.py --turns 20
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

from probe_common import run_pair

try:  # an installed (or PYTHONPATH's compiled) tensorwire first; else the checkout's own
    import tensorwire  # noqa: F401
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIB = 1 << 20
#: (label, bytes per message, messages per round): the demo's two stream rows
ROWS = (("1 MiB stream", MIB, 32), ("64 MiB stream", 64 * MIB, 2))
PATHS = ("tensorwire", "raw socket")


def _variants(rows: tuple[tuple[str, int, int], ...]) -> list[tuple[int, str, int, int, bool]]:
    """(row, path, sources, receive buffers, written) of a turn: one source or one per message of the round; two
    receive buffers (``tensorwire bench``'s) or one per message (the demo's); ``written``: the bench's layout with
    a message's worth written on each side before the round."""
    return [
        (i, p, k, b, False)
        for i, (_l, _s, m) in enumerate(rows)
        for p in PATHS
        for k in sorted({1, m})
        for b in sorted({2, m})
    ] + [(i, p, 1, 2, True) for i in range(len(rows)) for p in PATHS]


def _run(rank: int, port: int, turns: int, seed: int) -> dict[str, Any]:
    import torch

    import tensorwire as tw
    from tensorwire.benchmark.backends.rawtcp import recv_exact, tune
    from tensorwire.benchmark.worker import pair_process_setup
    from torch.distributed import TCPStore

    pair_process_setup()
    store = TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=300))
    # a spec per row and receive layout: row{i}/{b} lands in b slots, in turn
    specs = [tw.TensorSpec(f"row{i}/{b}", (s,), "uint8") for i, (_l, s, m) in enumerate(ROWS) for b in sorted({2, m})]
    ack_spec = tw.TensorSpec("ack", (1,), "uint8")
    variants = _variants(ROWS)
    order = random.Random(seed)
    one = memoryview(bytearray(1))
    times: dict[str, list[float]] = {}
    with tw.Node(rank=rank, world_size=2, store=store, transport="tcp", timeout=300) as node:
        if rank == 0:
            link = node.link(1, send=specs, recv=[ack_spec])
            sock = tune(socket.create_connection(("127.0.0.1", int(store.get("probe/port"))), timeout=300), 300)
            srcs = [[torch.full((s,), 7, dtype=torch.uint8) for _ in range(m)] for _l, s, m in ROWS]
            scratch = srcs
            views = [[memoryview(t.numpy()) for t in row] for row in srcs]
        else:
            link = node.link(0, send=[ack_spec], recv=specs, depth={s.name: int(s.name.split("/")[1]) for s in specs})
            lst = socket.create_server(("127.0.0.1", 0))
            store.set("probe/port", str(lst.getsockname()[1]))
            sock = tune(lst.accept()[0], 300)
            lst.close()
            bufs = [[memoryview(torch.empty(s, dtype=torch.uint8).numpy()) for _ in range(m)] for _l, s, m in ROWS]
            scratch = [[torch.empty(s, dtype=torch.uint8)] for _l, s, _m in ROWS]
            ack = torch.ones(1, dtype=torch.uint8)
        try:
            for turn in range(turns + 1):  # turn 0: warm-up, not kept
                plan = list(variants)
                order.shuffle(plan)
                for i, path, k, b, written in plan:
                    name = f"row{i}/{b}"
                    _label, _size, m = ROWS[i]
                    if written:  # (sender: its source, as the demo's fill; receiver: as the demo's expected copy)
                        scratch[i][0].fill_(turn % 251)
                    if rank == 0:
                        recv_exact(sock, one)  # the receiver is ready
                        t0 = time.perf_counter()
                        if path == "tensorwire":
                            for j in range(m):
                                link.send(name, srcs[i][j % k])
                            link.recv("ack")
                        else:
                            for j in range(m):
                                sock.sendall(views[i][j % k])
                            recv_exact(sock, one)
                        if turn:
                            times.setdefault(f"{i}/{path}/{k}/{b}/{int(written)}", []).append(time.perf_counter() - t0)
                    else:
                        sock.sendall(b"g")
                        if path == "tensorwire":
                            for _ in range(m):
                                link.recv(name)
                            link.send("ack", ack)
                        else:
                            for j in range(m):
                                recv_exact(sock, bufs[i][j % b])
                            sock.sendall(b"k")
        finally:
            sock.close()
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    from torch.distributed import TCPStore

    from tensorwire import native

    store = TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=300), wait_for_workers=False)
    print(f"# stream rounds by source layout, tcp, {a.turns} turns in random order; hot path {native.summary()}")
    print(f"# load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    got = run_pair(_run, store.port, a.turns, a.seed)
    times = got[0]
    print(
        "| row | path | bench's layout: one source, 2 receive buffers | one source, a buffer each "
        "| a source each, 2 buffers | the demo's: a source and a buffer each | demo's / bench's "
        "| bench's, a message's worth written on each side before the round | that / bench's |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for i, (label, size, m) in enumerate(ROWS):
        for path in PATHS:
            rate = {
                (k, b, w): size * m / statistics.median(times[f"{i}/{path}/{k}/{b}/{w}"])
                for k, b, w in [(k, b, 0) for k in (1, m) for b in (2, m)] + [(1, 2, 1)]
            }
            cells = " | ".join(f"{rate[(*v, 0)] / 1e9:.2f} GB/s" for v in ((1, 2), (1, m), (m, 2), (m, m)))
            bench = rate[(1, 2, 0)]
            print(
                f"| {label} | {path} | {cells} | {rate[(m, m, 0)] / bench:.2f}x "
                f"| {rate[(1, 2, 1)] / 1e9:.2f} GB/s | {rate[(1, 2, 1)] / bench:.2f}x |"
            )
    print(f"# load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
