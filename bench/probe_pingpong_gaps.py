#!/usr/bin/env python
"""``dist.send/recv`` ping-pong, tensorwire against gloo: what the receive buffer and an idle gap change.

::

    python bench/probe_pingpong_gaps.py --sizes 4K,1M --iters 200 --rounds 4 --gaps 0,1,5

One two-rank ``torchrun`` job: a gloo default group and a ``new_group(backend="tensorwire")``
over the same processes. Two parts, every variant in turns (one after the other, ``--rounds``
times), each timed per round trip (medians; means where a tail matters):

- **buffers**: the round trip with the message received into the tensor it was sent from
  (``bench/bench_distributed.py``'s layout) and into a second tensor
  (``bench/bench_distributed_trees.py``'s), per round;
- **gaps**: each round trip after ``G`` ms of the host busy in Python (a compute phase of a pipeline
  between two messages): what a message costs after the links sat idle, against gloo's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def _one(dist, group, rank: int, x, y) -> float:
    peer = 1 - rank
    t0 = time.perf_counter()
    if rank == 0:
        dist.send(x, peer, group=group)
        dist.recv(y, peer, group=group)
    else:
        dist.recv(y, peer, group=group)
        dist.send(x, peer, group=group)
    return time.perf_counter() - t0


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import tensorwire  # noqa: F401 - registers the backend

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tw = dist.new_group([0, 1], backend="tensorwire")
    groups = {name: g for name, g in (("gloo", None), ("tensorwire", tw)) if name in args.backends}
    lines = []
    for size in args.sizes:
        x, y = torch.zeros(size // 4), torch.zeros(size // 4)
        for g in groups.values():  # warm-up: connections, signatures, both buffers
            for _ in range(20):
                _one(dist, g, rank, x, y)
                _one(dist, g, rank, x, x)
        per: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for name, g in groups.items():
                for how, into in (("same", x), ("second", y)):
                    dist.barrier()
                    ts = [_one(dist, g, rank, x, into) for _ in range(args.iters)]
                    per.setdefault(f"{name}|{how}", []).append(statistics.median(ts))
        for key, meds in per.items():
            name, how = key.split("|")
            rounds = ", ".join(f"{m * 1e6:.0f}" for m in meds)
            lines.append(f"BUF|{size}|{name}|{how}|{statistics.median(meds) * 1e6:.1f}|{rounds}")
        for gap in args.gaps:
            got: dict[str, list[float]] = {name: [] for name in groups}
            for _ in range(args.rounds):
                for name, g in groups.items():
                    dist.barrier()
                    for _ in range(args.iters):
                        _busy(gap / 1e3)
                        got[name].append(_one(dist, g, rank, x, y))
            for name, ts in got.items():
                med, mean = statistics.median(ts) * 1e6, statistics.mean(ts) * 1e6
                lines.append(f"GAP|{size}|{gap:g}|{name}|{med:.1f}|{mean:.1f}")
    if rank == 0:
        for line in lines:
            print(line, flush=True)
    dist.destroy_process_group()


def report(out: str, args: argparse.Namespace) -> str:
    from tensorwire.benchmark.config import format_size

    buf = [ln.split("|")[1:] for ln in out.splitlines() if ln.startswith("BUF|")]
    gap = [ln.split("|")[1:] for ln in out.splitlines() if ln.startswith("GAP|")]
    if not buf or not gap:
        raise SystemExit("the job printed no figures")
    rows = [
        "# dist.send/recv ping-pong: receive buffer and idle gaps, tensorwire vs gloo",
        "",
        f"{args.iters} round trip(s) per variant and round, {args.rounds} round(s) in turns; medians in µs.",
        "",
        "| size | backend | received into | median | per round |",
        "| --- | --- | --- | ---: | --- |",
    ]
    rows += [f"| {format_size(int(s))} | {b} | {how} | {med} | {per} |" for s, b, how, med, per in buf]
    rows += [
        "",
        "| size | busy gap before each round trip | backend | median | mean |",
        "| --- | ---: | --- | ---: | ---: |",
    ]
    rows += [f"| {format_size(int(s))} | {g} ms | {b} | {med} | {mean} |" for s, g, b, med, mean in gap]
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default="4K,1M")
    ap.add_argument("--iters", type=int, default=200, help="timed round trips per variant and round (>= 1)")
    ap.add_argument("--rounds", type=int, default=4, help="turns of every variant (>= 1)")
    ap.add_argument("--gaps", default="0,1,5", help="comma-separated ms of busy host before each round trip")
    ap.add_argument(
        "--backends",
        default="gloo,tensorwire",
        help="the groups timed, in this order (gloo is the default group either way; tensorwire alone: no gloo "
        "messages between its turns)",
    )
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for the job")
    ap.add_argument("--out", default="", help="also write the markdown here")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tensorwire, if not installed
    from tensorwire.benchmark.config import parse_size
    from tensorwire.errors import ConfigError

    if args.iters < 1 or args.rounds < 1:
        ap.error(f"--iters and --rounds must be >= 1, got {args.iters} and {args.rounds}")
    try:
        args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    except ConfigError as exc:
        ap.error(f"--sizes: {exc}")
    if any(s < 4 or s % 4 for s in args.sizes):
        ap.error("--sizes: each a multiple of 4 bytes (float32 tensors)")
    try:
        args.gaps = [float(g) for g in args.gaps.split(",")]
    except ValueError:
        ap.error(f"--gaps: not a list of numbers: {args.gaps!r}")
    if any(not 0 <= g <= 1000 for g in args.gaps):
        ap.error("--gaps: each between 0 and 1000 ms")
    args.backends = [b for b in args.backends.split(",") if b]
    if not args.backends or any(b not in ("gloo", "tensorwire") for b in args.backends):
        ap.error(f"--backends: a comma-separated choice of gloo and tensorwire, got {','.join(args.backends)!r}")
    if args.worker:
        worker(args)
        return
    here = Path(__file__).resolve()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(here),
        "--worker",
    ]
    cmd += ["--sizes", ",".join(map(str, args.sizes)), "--iters", str(args.iters), "--rounds", str(args.rounds)]
    cmd += ["--gaps", ",".join(f"{g:g}" for g in args.gaps), "--backends", ",".join(args.backends)]
    print(f"one two-rank job: {len(args.sizes)} size(s), {args.rounds} round(s) ...", file=sys.stderr, flush=True)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=dict(os.environ))
    except subprocess.TimeoutExpired:
        raise SystemExit(f"the job did not finish in {args.timeout:g} s") from None
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise SystemExit(f"the job failed (exit {proc.returncode})")
    md = report(proc.stdout, args)
    print(md, end="")
    if args.out:
        Path(args.out).write_text(md, encoding="utf-8")


if __name__ == "__main__":
    main()
