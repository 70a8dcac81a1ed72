"""The floor of a host message between two processes copied by both sides at once (a probe, CPU; no tensorwire path).

Over TCP on one host a Link's large message is one ``process_vm_writev`` by the sender into the receiver's slot:
one copy on one core. A raw socket's two copies (into the kernel, out of it) run on two cores at once, and on a
host with idle cores it streams 1 MiB messages as fast or faster. Splitting the one copy over a pool of threads
costs more than it saves (``bench/probe_cma_pieces.py``). This probe measures the bare mechanisms, with the
threads each side already runs: per message

- ``socket``: ``sendall`` out of the source, ``recv_into`` the destination (``tensorwire.benchmark.backends.
  rawtcp``'s ``tune``/``recv_exact``);
- ``write``: the sender ``process_vm_writev``s the whole message into the destination, then sends one byte
  ("landed"); the receiver waits for it -- what a Link does today;
- ``split``: the sender sends one byte ("go"), ``process_vm_writev``s the first half, sends "landed" and waits
  for "done"; the receiver, on "go", ``process_vm_readv``s the second half out of the source, waits for "landed"
  and sends "done" -- each side copies half, at once.

``--messages`` messages per round, then a 1-byte ack; the variants in a random order per turn, in one pair of
processes. Bytes are checked once per variant after the run.

Usage::

    python3 bench/probe_cma_split.py --sizes 256K,1M,4M --turns 20
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
import time
from typing import Any

from probe_common import run_pair, size_list

try:  # an installed (or PYTHONPATH's) tensorwire first; else the checkout's own
    import tensorwire  # noqa: F401
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = ("socket", "write", "split")


def _run(rank: int, a: argparse.Namespace, ports: Any) -> dict[str, Any]:
    import numpy as np

    from tensorwire.benchmark.backends.rawtcp import recv_exact, tune
    from tensorwire.transport.cma import syscalls

    libc = syscalls.load_libc()
    if libc is None:
        raise OSError("no process_vm_readv/writev here")
    sizes = a.size_list
    if rank == 1:
        lst = socket.create_server(("127.0.0.1", 0))
        ports.put(lst.getsockname()[1])
        sock = tune(lst.accept()[0], 60)
        lst.close()
    else:
        sock = tune(socket.create_connection(("127.0.0.1", ports.get(timeout=60)), timeout=60), 60)
    # the buffers: the sender's sources, the receiver's destinations; addresses and pids swapped once
    bufs = {s: np.full(s, 7 if rank == 0 else 0, dtype=np.uint8) for s in sizes}
    mine = " ".join([str(os.getpid())] + [str(bufs[s].ctypes.data) for s in sizes]).encode().ljust(512)
    sock.sendall(mine)
    theirs_raw = bytearray(512)
    recv_exact(sock, memoryview(theirs_raw))
    words = theirs_raw.decode().split()
    peer = int(words[0])
    remote = {s: int(w) for s, w in zip(sizes, words[1:])}
    why = syscalls.grant_ptrace(peer)
    if why is not None:
        raise OSError(f"cannot let the peer copy: {why}")
    sock.sendall(b"r")  # granted: the peer may copy now
    one = memoryview(bytearray(1))
    recv_exact(sock, one)
    order = random.Random(a.seed)
    times: dict[str, list[float]] = {}
    m = a.messages
    for turn in range(a.turns + 1):  # turn 0: warm-up, not kept
        plan = [(s, v) for s in sizes for v in VARIANTS]
        order.shuffle(plan)
        for size, v in plan:
            buf, far = bufs[size], remote[size]
            view = memoryview(buf)
            half = (size // 2) & ~4095
            if rank == 0:
                recv_exact(sock, one)  # the receiver is ready
                t0 = time.perf_counter()
                for _ in range(m):
                    if v == "socket":
                        sock.sendall(view)
                    elif v == "write":
                        syscalls.copy_piece(libc.writev, peer, buf.ctypes.data, far, size)
                        sock.sendall(b"l")
                    else:
                        sock.sendall(b"g")
                        syscalls.copy_piece(libc.writev, peer, buf.ctypes.data, far, half)
                        sock.sendall(b"l")
                        recv_exact(sock, one)  # "done": the receiver has its half
                recv_exact(sock, one)  # the round's ack
                if turn:
                    times.setdefault(f"{size}/{v}", []).append(time.perf_counter() - t0)
            else:
                buf[:] = 0
                sock.sendall(b"g")
                for _ in range(m):
                    if v == "socket":
                        recv_exact(sock, view)
                    elif v == "write":
                        recv_exact(sock, one)
                    else:
                        recv_exact(sock, one)  # "go"
                        syscalls.copy_piece(libc.readv, peer, buf.ctypes.data + half, far + half, size - half)
                        recv_exact(sock, one)  # "landed": the sender's half is in
                        sock.sendall(b"d")
                sock.sendall(b"k")
                if turn == a.turns and not bool((buf == 7).all()):
                    raise AssertionError(f"{v} {size}: bytes differ")
    sock.close()
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="256K,1M,4M", help="message sizes (K/M suffixes)")
    ap.add_argument("--messages", type=int, default=32, help="messages per round")
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    if a.turns < 1 or a.messages < 1:
        ap.error("--turns and --messages must be >= 1")
    a.size_list = size_list(ap, "--sizes", a.sizes)
    ports = mp.get_context("spawn").Queue()
    print(
        f"# stream rounds ({a.messages} messages, then an ack), {a.turns} turns in random order; {os.cpu_count()} cores"
    )
    print(f"# load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    got = run_pair(_run, a, ports)
    times = got[0]
    print(
        "| message | socket | write (one side copies) | split (each side copies half) | split / write | split / socket |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for s in a.size_list:
        r = {v: s * a.messages / statistics.median(times[f"{s}/{v}"]) for v in VARIANTS}
        print(
            f"| {s >> 10} KiB | {r['socket'] / 1e9:.2f} GB/s | {r['write'] / 1e9:.2f} GB/s | {r['split'] / 1e9:.2f} GB/s "
            f"| {r['split'] / r['write']:.2f}x | {r['split'] / r['socket']:.2f}x |"
        )
    print(f"# load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
