"""``tensorwire demo`` against ``tensorwire bench``: the same path, the same figure, in turns.

Each turn runs the demo's measurement (:func:`tensorwire.demo.measure`: the three paths in turns in one
pair of processes, every byte checked outside the clocks) and then ``tensorwire bench``'s pairs for the
same paths and sizes (``tensorwire-tcp`` and ``raw-tcp``, one fresh pair of processes each: a 4 KiB round
trip, streams of 1 MiB and 64 MiB messages). It prints, per turn and as the median over turns, each
figure by both commands, their ratio (demo / bench: 1.0 when they agree), and tensorwire against the raw
socket by each command. ``--no-grpc`` leaves gRPC out of the demo (the bench runs no gRPC here).

Usage::

    python3 bench/bench_demo_vs_bench.py --turns 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

PATHS = {"tensorwire": "tensorwire-tcp", "raw socket": "raw-tcp"}
SIZES = {"4 KiB round trip": 4096, "1 MiB stream": 1 << 20, "64 MiB stream": 64 << 20}


def _demo(rounds: int, grpc: bool) -> dict[tuple[str, str], float]:
    from tensorwire import demo

    res = demo.measure(rounds=rounds, transport="tcp", grpc=grpc, timeout=600)
    if sum(res.bad.values()):
        raise SystemExit(f"the demo found corrupted messages: {res.bad}")
    out = {}
    for i, row in enumerate(res.rows):
        for path in PATHS:
            out[(row.label, path)] = res.figure(i, path)
    return out


def _bench(scale: float) -> dict[tuple[str, str], float]:
    from tensorwire.benchmark.config import BenchConfig
    from tensorwire.benchmark.runner import run_pair

    out = {}
    for path, backend in PATHS.items():
        for label, size in SIZES.items():
            rt = "round trip" in label
            cfg = BenchConfig(
                backends=(backend,),
                sizes=(size,),
                patterns=("rtt",) if rt else ("uni",),
                iters_scale=scale,
                memcheck=False,
            )
            res = run_pair(backend, cfg)
            if res["status"] != "ok":
                raise SystemExit(f"{backend} {label}: {res['status']}: {res['error']}")
            (entry,) = res["sender"]["sizes"]
            if rt:
                out[(label, path)] = statistics.median(entry["rtt"]["seconds"])
            else:
                batch = entry["uni"]["batch"]
                out[(label, path)] = size * batch / statistics.median(entry["uni"]["seconds"])
    return out


def _fmt(label: str, v: float) -> str:
    return f"{v * 1e6:.1f} µs" if "round trip" in label else f"{v / 1e9:.2f} GB/s"


def _faster(label: str, tw: float, sock: float) -> float:
    """How many times faster tensorwire is than the socket (>1: faster)."""
    return sock / tw if "round trip" in label else tw / sock


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5, help="the demo's --rounds")
    ap.add_argument("--iters-scale", type=float, default=0.5, help="the bench's --iters-scale")
    ap.add_argument("--no-grpc", action="store_true")
    a = ap.parse_args()
    from tensorwire import native

    print(f"# demo vs bench, tcp transport, {a.turns} turns; hot path {native.summary()}")
    print(f"# load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    turns = []
    for t in range(a.turns):
        t0 = time.monotonic()
        d = _demo(a.rounds, not a.no_grpc)
        b = _bench(a.iters_scale)
        turns.append((d, b))
        print(f"\n## turn {t + 1} ({time.monotonic() - t0:.0f} s, load {os.getloadavg()[0]:.2f})")
        _table(d, b)
    med_d = {k: statistics.median(d[k] for d, _ in turns) for k in turns[0][0]}
    med_b = {k: statistics.median(b[k] for _, b in turns) for k in turns[0][1]}
    print(f"\n## median over {a.turns} turns")
    _table(med_d, med_b)
    print(f"# load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


def _table(d: dict[tuple[str, str], float], b: dict[tuple[str, str], float]) -> None:
    print("| row | path | demo | bench | demo / bench |")
    print("| --- | --- | ---: | ---: | ---: |")
    for label in SIZES:
        for path in PATHS:
            dv, bv = d[(label, path)], b[(label, path)]
            agree = bv / dv if "round trip" in label else dv / bv  # >1: the demo reads faster
            print(f"| {label} | {path} | {_fmt(label, dv)} | {_fmt(label, bv)} | {agree:.2f}x |")
    print()
    print("| row | tensorwire vs raw socket, demo | the same, bench |")
    print("| --- | ---: | ---: |")
    for label in SIZES:
        fd = _faster(label, d[(label, "tensorwire")], d[(label, "raw socket")])
        fb = _faster(label, b[(label, "tensorwire")], b[(label, "raw socket")])
        print(f"| {label} | {fd:.2f}x | {fb:.2f}x |")


if __name__ == "__main__":
    sys.exit(main())
