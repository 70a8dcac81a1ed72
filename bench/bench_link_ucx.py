"""tensorwire over UCX against raw ucxx, in turns: the issue-14 hot-path targets.

Runs ``tensorwire bench``'s own backends (fresh process pairs each time) in
turns -- raw, tensorwire, raw, tensorwire, ... -- ``--rounds`` times, and
prints, per size, the median and the spread (min..max over rounds) of each
backend's figure and of the per-round ratio tensorwire / raw:

- round trip: p50 of one-way send + 1-byte ack (µs), target ratio <= 1.5 (host);
- stream: GB/s of a batch of sends then one ack (median of the batches),
  target ratio >= 0.9 (host).

Usage::

    python3 bench/bench_link_ucx.py --rounds 5 --sizes 4K,1M,16M,64M
    python3 bench/bench_link_ucx.py --device cuda --sizes 64K,1M,16M   # targets 2x / 0.8x
    python3 bench/bench_link_ucx.py --cpu                              # CPU per round trip, one thread
    python3 bench/bench_link_ucx.py --trees OLD,NEW --bursts 30        # the same, two source trees interleaved

``--cpu`` measures what a Link round trip costs the CPU, free of scheduling:
two Links over one in-process UCX connection, driven by one thread (send,
recv, send the ack, recv it), ``thread_time`` per round trip, 7 x 4,000.
UCX's ``self`` transport then carries the messages (more expensive than
shared memory), so compare versions of the code with it, not with raw ucxx.

``--trees A,B`` compares versions of the code on a loaded machine: one process per
source tree (``PYTHONPATH`` set to it), each holding the one-thread set-up above
warm, run bursts of round trips in alternation (A B, B A, ...), so both trees see
the same load; the per-burst-pair ratio B / A is the figure to read.

Machines with few cores and other load are noisy: read the spread, not only the median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable

from tensorwire.benchmark.config import BenchConfig, parse_size
from tensorwire.benchmark.runner import run_pair


def _figures(res: dict) -> dict[int, dict[str, float]]:
    """{size: {"rtt_us": p50, "uni_GBps": median of batches}} of one backend run."""
    out: dict[int, dict[str, float]] = {}
    sender = res.get("sender") or {}
    for e in sender.get("sizes", []):
        size = e["size"]
        f: dict[str, float] = {}
        if "rtt" in e and e["rtt"]["seconds"]:
            f["rtt_us"] = statistics.median(e["rtt"]["seconds"]) * 1e6
        if "uni" in e:
            rates = [e["uni"]["batch"] * size / s / 1e9 for s in e["uni"]["seconds"] if s > 0]
            if rates:
                f["uni_GBps"] = statistics.median(rates)
        out[size] = f
    return out


def _spread(xs: list[float], fmt: str) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):{fmt}} ({min(xs):{fmt}}..{max(xs):{fmt}})"


def _one_thread_pair(size: int) -> tuple[Any, Callable[[int], None]]:
    """Two Links over a UCX pair in this process (``size``-byte data, 1-byte ack): a closer and ``loop(k)``,
    which runs ``k`` round trips with both ends in the calling thread."""
    import threading

    import torch

    from tensorwire.p2p.link import Link
    from tensorwire.spec import TensorSpec
    from tensorwire.transport.base import new_nonce
    from tensorwire.transport.ucx import UcxListener

    lst = UcxListener()
    nonce = new_nonce()
    lst.expect(nonce)
    box: list = []
    th = threading.Thread(
        target=lambda: box.append(UcxListener.connect("127.0.0.1", lst.address[1], nonce, timeout=10)), daemon=True
    )
    th.start()
    tb = lst.accept(nonce, timeout=10)
    th.join(10)
    data, ack = TensorSpec("data", (size,), "uint8", "cpu"), TensorSpec("ack", (1,), "uint8", "cpu")
    a = Link(node_rank=0, peer=1, name="cpu", transport=box[0], send=[data], recv=[ack], timeout=30.0, device=None)
    b = Link(node_rank=1, peer=0, name="cpu", transport=tb, send=[ack], recv=[data], timeout=30.0, device=None)
    src, one = torch.ones(size, dtype=torch.uint8), torch.ones(1, dtype=torch.uint8)

    def loop(k: int) -> None:
        for _ in range(k):
            a.send("data", src)
            b.recv("data")
            b.send("ack", one)
            a.recv("ack")

    def close() -> None:
        a.close()
        b.close()
        lst.close()

    return close, loop


def cpu_per_round_trip(size: int, n: int = 4000, reps: int = 7) -> list[float]:
    """Microseconds of CPU per round trip (both ends in this thread), ``reps`` times."""
    close, loop = _one_thread_pair(size)
    out = []
    try:
        for rep in range(reps + 1):
            t0 = time.thread_time_ns()
            loop(n if rep else n // 8)  # the first pass warms up
            if rep:
                out.append((time.thread_time_ns() - t0) / n / 1e3)
    finally:
        close()
    return out


def _burst_worker(size: int) -> None:
    """``--burst-worker``: keep a one-thread Link pair warm; for each line ``n`` on stdin, run ``n`` round
    trips and print the CPU microseconds per round trip."""
    import os

    close, loop = _one_thread_pair(size)
    loop(1000)
    import tensorwire

    print("ready", os.path.dirname(os.path.dirname(os.path.abspath(tensorwire.__file__))), flush=True)
    for line in sys.stdin:
        n = int(line)
        t0 = time.thread_time_ns()
        loop(n)
        print((time.thread_time_ns() - t0) / n / 1e3, flush=True)
    close()


def compare_trees(trees: list[str], size: int, bursts: int, n: int = 2000) -> str:
    """CPU per round trip of each source tree, bursts of ``n`` interleaved across one process per tree."""
    import os
    import subprocess

    procs = {}
    for t in trees:
        env = dict(os.environ, PYTHONPATH=os.path.abspath(t))
        procs[t] = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--burst-worker", str(size)],  # this script, their library
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=t,
        )
        hello = procs[t].stdout.readline().split()  # type: ignore[union-attr]
        if hello[:1] != ["ready"] or os.path.realpath(hello[1]) != os.path.realpath(t):
            raise RuntimeError(f"the worker of {t} did not start with that tree's tensorwire: {hello}")
    res: dict[str, list[float]] = {t: [] for t in trees}
    try:
        for i in range(bursts):
            for t in trees if i % 2 == 0 else trees[::-1]:
                p = procs[t]
                p.stdin.write(f"{n}\n")  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
                res[t].append(float(p.stdout.readline()))  # type: ignore[union-attr]
    finally:
        for p in procs.values():
            p.stdin.close()  # type: ignore[union-attr]
            p.wait(30)
    lines = [f"CPU per {size}-byte Link round trip, one thread, {bursts} interleaved bursts of {n}:"]
    for t in trees:
        lines.append(f"  {t}: {_spread(res[t], '.2f')} us")
    for t in trees[1:]:
        r = [b / a for a, b in zip(res[trees[0]], res[t])]
        lines.append(f"  {t} / {trees[0]}, per burst pair: {_spread(r, '.3f')}")
    return "\n".join(lines)


def raw_cpu_per_round_trip(size: int, n: int = 4000, reps: int = 7) -> list[float]:
    """The same with raw ucxx (its own context, an endpoint to its own worker): tag receive posted,
    tag send, progress until both complete -- for the data, then for the 1-byte ack."""
    import numpy as np
    import ucxx._lib.libucxx as u
    from ucxx._lib.arr import Array

    ctx = u.UCXContext(feature_flags=(u.Feature.TAG,))
    worker = u.UCXWorker(ctx)
    ep = u.UCXEndpoint.create_from_worker_address(
        worker, u.UCXAddress.create_from_buffer(worker.address.tobytes()), False
    )
    src, dst = Array(np.ones(size, np.uint8)), Array(np.zeros(size, np.uint8))
    one, got = Array(np.ones(1, np.uint8)), Array(np.zeros(1, np.uint8))
    t_data, t_ack = u.UCXXTag(1), u.UCXXTag(2)
    progress = worker.progress

    def wait(*reqs: Any) -> None:
        for r in reqs:
            while not r.completed:
                progress()
            r.check_error()

    out = []
    for rep in range(reps + 1):
        t0 = time.thread_time_ns()
        for _ in range(n if rep else n // 8):
            r = ep.tag_recv(dst, tag=t_data)
            wait(ep.tag_send(src, tag=t_data), r)
            r = ep.tag_recv(got, tag=t_ack)
            wait(ep.tag_send(one, tag=t_ack), r)
        if rep:
            out.append((time.thread_time_ns() - t0) / n / 1e3)
    ep.close_blocking()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes", default="4K,1M,16M,64M")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument(
        "--backends", default="raw-ucxx,tensorwire-ucx", help="the reference first, then the ones compared with it"
    )
    ap.add_argument("--iters-scale", type=float, default=1.0)
    ap.add_argument("--markdown", help="also write the table here")
    ap.add_argument("--cpu", action="store_true", help="only the one-thread CPU per round trip (first size)")
    ap.add_argument("--trees", help="comma-separated source trees: their --cpu figures, interleaved bursts")
    ap.add_argument("--bursts", type=int, default=30)
    ap.add_argument("--burst-worker", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.burst_worker:
        _burst_worker(args.burst_worker)
        return 0
    if args.trees:
        trees = [t for t in args.trees.split(",") if t]
        print(compare_trees(trees, parse_size(args.sizes.split(",")[0]), args.bursts))
        return 0
    if args.cpu:
        size = parse_size(args.sizes.split(",")[0])
        tw: list[float] = []
        raw: list[float] = []
        for _ in range(args.rounds):  # in turns
            tw.append(statistics.median(cpu_per_round_trip(size)))
            raw.append(statistics.median(raw_cpu_per_round_trip(size)))
        ratios = [a / b for a, b in zip(tw, raw)]
        print(
            f"CPU per {size}-byte round trip, both ends in one thread, {args.rounds} rounds in turns: "
            f"tensorwire {_spread(tw, '.2f')} us, raw ucxx {_spread(raw, '.2f')} us, "
            f"ratio {_spread(ratios, '.2f')}"
        )
        return 0
    names = [b.strip() for b in args.backends.split(",") if b.strip()]
    sizes = tuple(parse_size(s) for s in args.sizes.split(","))
    cfg = BenchConfig(
        backends=tuple(names), sizes=sizes, device=args.device, iters_scale=args.iters_scale, memcheck=False
    )
    runs: dict[str, list[dict[int, dict[str, float]]]] = {n: [] for n in names}
    t0 = time.monotonic()
    for r in range(args.rounds):
        for n in names:
            res = run_pair(n, cfg.for_backend(n))
            if res["status"] != "ok":
                print(f"round {r + 1}: {n} {res['status']}: {res.get('error', '')[:300]}", file=sys.stderr)
                continue
            runs[n].append(_figures(res))
        print(f"round {r + 1}/{args.rounds} done ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
    ref = names[0]
    lines = [
        f"# {', '.join(names)} in turns, {args.rounds} rounds, device {args.device}",
        f"# median (min..max over rounds); ratio = per-round figure / the same round's {ref} figure",
        "",
    ]
    for key, unit, fmt in (("rtt_us", "round trip p50 µs", ".1f"), ("uni_GBps", "stream GB/s", ".2f")):
        head = ["size"] + [f"{n} {unit}" for n in names] + [f"{n}/{ref}" for n in names[1:]]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + " --- |" * len(head))
        for size in sizes:
            row = [f"{size // 1024} KiB" if size < 1 << 20 else f"{size >> 20} MiB"]
            for n in names:
                row.append(_spread([run[size][key] for run in runs[n] if key in run.get(size, {})], fmt))
            for n in names[1:]:
                ratios = [
                    b[size][key] / a[size][key]
                    for a, b in zip(runs[ref], runs[n])
                    if key in a.get(size, {}) and key in b.get(size, {}) and a[size][key] > 0
                ]
                row.append(_spread(ratios, ".2f"))
            lines.append("| " + " | ".join(row) + " |")
        lines.append("")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
