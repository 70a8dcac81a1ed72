"""Benchmark a table sharded by rows over 3 ``tensorwire serve`` daemons against the same table on 1 daemon.

Not a test. One host, four daemons (three for the sharded table, one for the
whole table), every client on shared memory (the default path on the
daemons' host). One run measures, in turns (rounds of ``--calls`` back-to-back
calls of each variant, alternating, so a drifting load weighs on both):

- ``get_rows`` of 4,096 random rows x 128 float32 out of a 1,000,000-row table
  (no writes in between: reads served by read leases);
- ``put_rows`` of 4,096 distinct random rows;
- ``add_rows`` of 4,096 random rows (duplicates allowed) into it;
- ``step``: a ``get_rows`` then an ``add_rows`` of the same rows (an embedding
  training step: every read follows a write, so it pins each daemon's version
  with a request instead of reading through a lease).

Prints p50 / p10 per call and the ratio sharded / single (target: get_rows
<= 1.3x), and writes a markdown result with the machine and the command.

Usage::

    python bench/bench_sharded.py [--rounds 15] [--calls 20] [--out bench/results/sharded_cpu2_YYYY-MM-DD.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import torch

    import tensorwire as tw
    from serve_common import Daemon

    torch.set_num_threads(1)
    daemons = [Daemon("--max-bytes", "2GiB", transport="tcp") for _ in range(4)]
    try:
        sharded = tw.Client([d.address for d in daemons[:3]])
        single = tw.Client(daemons[3].address)
        table = torch.randn(args.rows, args.dim)
        sharded.put("emb", table, shard="rows")
        single.put("emb", table)
        paths = {"sharded": sharded.data_path, "single": single.data_path}
        g = torch.Generator().manual_seed(0)
        idxs = [torch.randint(0, args.rows, (args.batch,), generator=g) for _ in range(8)]
        uniq = [torch.randperm(args.rows, generator=g)[: args.batch] for _ in range(8)]
        vals = torch.randn(args.batch, args.dim, generator=g) * 1e-3
        ref = table[idxs[0]]
        assert torch.equal(sharded.get_rows("emb", idxs[0]), ref) and torch.equal(single.get_rows("emb", idxs[0]), ref)

        ops = {
            "get_rows": {
                "sharded": lambda i: sharded.get_rows("emb", idxs[i % 8]),
                "single": lambda i: single.get_rows("emb", idxs[i % 8]),
            },
            "put_rows": {
                "sharded": lambda i: sharded.put_rows("emb", uniq[i % 8], vals),
                "single": lambda i: single.put_rows("emb", uniq[i % 8], vals),
            },
            "add_rows": {
                "sharded": lambda i: sharded.add_rows("emb", idxs[i % 8], vals),
                "single": lambda i: single.add_rows("emb", idxs[i % 8], vals),
            },
            "step": {
                "sharded": lambda i: (sharded.get_rows("emb", idxs[i % 8]), sharded.add_rows("emb", idxs[i % 8], vals)),
                "single": lambda i: (single.get_rows("emb", idxs[i % 8]), single.add_rows("emb", idxs[i % 8], vals)),
            },
        }
        times: dict[tuple[str, str], list[float]] = {(op, v): [] for op in ops for v in ("sharded", "single")}
        for op, variants in ops.items():
            for v in variants.values():  # warm up
                for i in range(10):
                    v(i)
            for r in range(args.rounds):
                order = ("sharded", "single") if r % 2 == 0 else ("single", "sharded")
                for v in order:
                    fn = variants[v]
                    for i in range(args.calls):
                        t0 = time.perf_counter()
                        fn(i)
                        times[(op, v)].append(time.perf_counter() - t0)
        sharded.close()
        single.close()
    finally:
        for d in daemons:
            d.close()

    def q(xs: list[float], p: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(p * len(xs)))] * 1e3

    lines = [
        "| operation | 3 daemons p50 (ms) | 1 daemon p50 (ms) | ratio p50 | 3 daemons p10 | 1 daemon p10 | ratio p10 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for op in ops:
        s, o = times[(op, "sharded")], times[(op, "single")]
        s50, o50, s10, o10 = statistics.median(s) * 1e3, statistics.median(o) * 1e3, q(s, 0.1), q(o, 0.1)
        what = "get_rows + add_rows" if op == "step" else op
        lines.append(
            f"| {what} {args.batch} x {args.dim} f32 | {s50:.3f} | {o50:.3f} | {s50 / o50:.2f}x | "
            f"{s10:.3f} | {o10:.3f} | {s10 / o10:.2f}x |"
        )
    table_md = "\n".join(lines)
    print(table_md)
    print(f"data paths: {paths}")
    if args.out:
        cmd = "python bench/bench_sharded.py " + " ".join(sys.argv[1:])
        with open(args.out, "w") as f:
            f.write(
                f"# Sharded table (3 daemons) vs one daemon, one host, shared memory\n\n{table_md}\n\n"
                f"- table: {args.rows:,} x {args.dim} float32; {args.batch:,} random rows per call; "
                f"{args.rounds} rounds x {args.calls} calls per variant, in turns\n"
                f"- data paths: {paths}\n"
                f"- machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
                f"torch {torch.__version__}\n"
                f"- command: `{cmd}`\n"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
