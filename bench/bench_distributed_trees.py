#!/usr/bin/env python
"""Two source trees of tensorwire, one ``dist.send/recv`` ping-pong, in turns: what a change is worth.

::

    git worktree add /tmp/before <rev>
    python bench/bench_distributed_trees.py --trees /tmp/before,. --labels before,after --turns 2
    python bench/bench_distributed_trees.py --trees /tmp/before,. --sizes 4K,64K,256K,1M --backend gloo

A turn runs one two-rank ``torchrun`` job per tree, the trees alternating (A B,
B A, ...), so a change of load on a shared machine hits both. In each job the
ranks make a ``new_group(backend=...)`` (``tensorwire`` by default; ``gloo``
gives the floor of the same machine) and, per size, time ``--iters`` round
trips of one float32 tensor after 20 warm-up round trips; reported per tree and
size: the median round trip of each turn, and the median of those turns. The
tree is put first on ``PYTHONPATH`` of its job (the script itself runs from
the tree it was started in; the worker imports only ``tensorwire`` from the tree).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench_distributed import _pingpong  # (this script's folder is on sys.path)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import tensorwire  # noqa: F401 - registers the backend

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group = dist.new_group(backend=args.backend)
    out = {}
    for size in [int(s) for s in args.sizes.split(",")]:  # bytes (main passes them parsed)
        x = torch.ones(size // 4)
        y = torch.empty(size // 4)
        dist.barrier()
        _pingpong(dist, torch, group, rank, x, 20, into=y)  # warm-up
        out[size] = statistics.median(_pingpong(dist, torch, group, rank, x, 1, into=y) for _ in range(args.iters))
    if rank == 0:
        print("RESULT " + json.dumps({"tensorwire": tensorwire.__file__, "rtt": out}), flush=True)
    dist.destroy_process_group()


def run_job(tree: Path, args: argparse.Namespace) -> dict:
    here = Path(__file__).resolve()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(here)]
    sizes = ",".join(str(n) for n in args.sizes)
    cmd += ["--worker", "--sizes", sizes, "--iters", str(args.iters), "--backend", args.backend]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout, cwd=str(tree))
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            data = json.loads(line[len("RESULT ") :])
            if not Path(data["tensorwire"]).resolve().is_relative_to(tree.resolve()):
                raise SystemExit(f"the job for {tree} imported tensorwire from {data['tensorwire']}")
            return {int(k): v for k, v in data["rtt"].items()}
    sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
    raise SystemExit(f"the job for {tree} failed (exit {proc.returncode})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--trees", default="", help="comma-separated source trees (repository roots)")
    ap.add_argument("--labels", default="", help="comma-separated names for the trees in the table (default: paths)")
    ap.add_argument("--sizes", default="4K,64K,256K,1M")
    ap.add_argument("--iters", type=int, default=1000, help="timed round trips per size and job (>= 1)")
    ap.add_argument("--turns", type=int, default=2, help="jobs per tree, the trees alternating (>= 1)")
    ap.add_argument("--backend", default="tensorwire", choices=["tensorwire", "gloo"])
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per job")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if args.iters < 1 or args.turns < 1:
        ap.error(f"--iters and --turns must be >= 1, got {args.iters} and {args.turns}")
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's tensorwire, if not installed
    from tensorwire.benchmark.config import format_size, parse_size
    from tensorwire.errors import ConfigError

    try:
        args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    except ConfigError as exc:
        ap.error(f"--sizes: {exc}")
    trees = [Path(os.path.abspath(t)) for t in args.trees.split(",") if t]  # (jobs run in their tree)
    if len(trees) < 2:
        ap.error("--trees needs at least two source trees")
    for t in trees:
        if not (t / "tensorwire" / "__init__.py").is_file():
            ap.error(f"{t} is not a tensorwire source tree (no tensorwire/__init__.py)")
    labels = [x for x in args.labels.split(",") if x] or [str(t) for t in trees]
    if len(labels) != len(trees):
        ap.error(f"--labels names {len(labels)} trees, --trees gives {len(trees)}")
    name = dict(zip(trees, labels))
    got: dict[Path, list[dict]] = {t: [] for t in trees}
    for turn in range(args.turns):
        for t in trees if turn % 2 == 0 else trees[::-1]:
            print(f"turn {turn + 1}/{args.turns}: {name[t]}", file=sys.stderr, flush=True)
            got[t].append(run_job(t, args))
    print(f"# dist.send/recv round trip, backend {args.backend}, median of {args.iters} per job; {args.turns} turns\n")
    head = ["size"] + [f"{name[t]} µs (per turn)" for t in trees] + [f"{name[t]} / {name[trees[0]]}" for t in trees[1:]]
    print("| " + " | ".join(head) + " |")
    print("| --- " * len(head) + "|")
    for s in args.sizes:
        meds = {t: statistics.median(r[s] for r in got[t]) for t in trees}
        cells = [format_size(s)]
        cells += [f"{meds[t] * 1e6:.1f} ({', '.join(f'{r[s] * 1e6:.0f}' for r in got[t])})" for t in trees]
        cells += [f"{meds[t] / meds[trees[0]]:.2f}x" for t in trees[1:]]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
