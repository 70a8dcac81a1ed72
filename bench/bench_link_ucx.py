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

Machines with few cores and other load are noisy: read the spread, not only the median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes", default="4K,1M,16M,64M")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--backends", default="raw-ucxx,tensorwire-ucx",
                    help="the reference first, then the ones compared with it")
    ap.add_argument("--iters-scale", type=float, default=1.0)
    ap.add_argument("--markdown", help="also write the table here")
    args = ap.parse_args(argv)
    names = [b.strip() for b in args.backends.split(",") if b.strip()]
    sizes = tuple(parse_size(s) for s in args.sizes.split(","))
    cfg = BenchConfig(backends=tuple(names), sizes=sizes, device=args.device, iters_scale=args.iters_scale,
                      memcheck=False)
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
    lines = [f"# {', '.join(names)} in turns, {args.rounds} rounds, device {args.device}",
             "# median (min..max over rounds); ratio = per-round figure / the same round's "
             f"{ref} figure", ""]
    for key, unit, fmt in (("rtt_us", "round trip p50 µs", ".1f"), ("uni_GBps", "stream GB/s", ".2f")):
        head = ["size"] + [f"{n} {unit}" for n in names] + [f"{n}/{ref}" for n in names[1:]]
        lines.append("| " + " | ".join(head) + " |")
        lines.append("|" + " --- |" * len(head))
        for size in sizes:
            row = [f"{size // 1024} KiB" if size < 1 << 20 else f"{size >> 20} MiB"]
            for n in names:
                row.append(_spread([run[size][key] for run in runs[n] if key in run.get(size, {})], fmt))
            for n in names[1:]:
                ratios = [b[size][key] / a[size][key] for a, b in zip(runs[ref], runs[n])
                          if key in a.get(size, {}) and key in b.get(size, {}) and a[size][key] > 0]
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
