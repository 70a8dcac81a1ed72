"""Host time per 4 KiB message with counting on vs off (issue 32's target), in many short turns of one run.

Counting (``tensorwire.observe``) is read per message from one switch (``observe.set_enabled``; the
``TENSORWIRE_METRICS=0`` setting sets the same switch at start-up), so one process can take turns: every hook
of a message sees the setting of its turn. Each *cycle* runs three turns, in an order drawn anew per cycle
(seeded: the same order on every rank):

- ``off``: counting off;
- ``on``: counting on, no profiler;
- ``off2``: counting off again -- nothing differs from ``off``, so ``off2 / off`` is what the figures move by
  when nothing changes (the noise floor of the same run, under the same load).

In ``on`` the latency histograms time one message in ``TENSORWIRE_METRICS_SAMPLE`` per route (16 unless set;
the header line says which): set it to 1 to measure timing every message.

Measured:

- ``backend``: ``dist.send`` / ``dist.recv`` of a 4 KiB tensor between two spawned ranks of
  ``backend="tensorwire"`` (TCP unless ``--transport``), a ping-pong; both ranks switch at the same message
  counts; host time (``perf_counter_ns``) per call on each rank;
- ``link``: 4 KiB round trips over a TCP :class:`~tensorwire.p2p.link.Link` pair, both ends in this
  process's one thread (``send``, ``recv``, ``send`` of a 1-byte ack, ``recv``): host time per call.

Printed: one line per cycle (host µs per call of each turn and both ratios), then per measurement the median
of the per-cycle ratios with their quartiles and a 95 % bootstrap interval of the median: ``on / off``,
``on / mean(off, off2)`` (both off turns of the cycle: less noise in the denominator) and ``off2 / off``;
the CPU-time ratio, and the load average before and after.

Usage::

    python3 bench/bench_observe_cost.py --cycles 300 --turn 200
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from datetime import timedelta
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_observe import SIZE, tcp_link_pair  # (the same 4 KiB Link pair)
from probe_common import run_pair

CONDITIONS = ("off", "on", "off2")


def orders(cycles: int, seed: int) -> list[tuple[str, ...]]:
    """The order of the three turns in each cycle (every permutation equally likely; seeded)."""
    rng = random.Random(seed)
    out = []
    for _ in range(cycles):
        c = list(CONDITIONS)
        rng.shuffle(c)
        out.append(tuple(c))
    return out


def in_turns(
    run: Callable[[int], tuple[int, int]], set_on: Callable[[bool], None], cycles: int, turn: int, seed: int
) -> list[dict[str, float]]:
    """Per cycle: ``{condition: host ns per call, condition + "_cpu": CPU ns per call}``.

    ``run(k)`` makes ``k`` round trips and returns (host ns, CPU ns) per call.
    """
    for cond in CONDITIONS:  # warm every condition once (first-use paths, caches)
        set_on(cond == "on")
        run(turn)
    out = []
    for order in orders(cycles, seed):
        row: dict[str, float] = {}
        for cond in order:
            set_on(cond == "on")
            host, cpu = run(turn)
            row[cond] = host
            row[cond + "_cpu"] = cpu
        out.append(row)
    set_on(True)
    return out


# -- backend --------------------------------------------------------------------------------------------------
def _backend_rank(rank: int, port: int, args: dict[str, Any]) -> tuple[list[dict[str, float]], dict[str, Any]]:
    os.environ["TENSORWIRE_TRANSPORT"] = args["transport"]
    import torch
    import torch.distributed as dist

    import tensorwire  # noqa: F401 - registers the backend
    from tensorwire import observe

    store = dist.TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=60))
    dist.init_process_group("tensorwire", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    x = torch.ones(SIZE // 4)
    y = torch.empty(SIZE // 4)
    clock, cpu = time.perf_counter_ns, time.thread_time_ns

    def run(k: int) -> tuple[int, int]:
        t0, c0 = clock(), cpu()
        if rank == 0:
            for _ in range(k):
                dist.send(x, 1)
                dist.recv(y, 1)
        else:
            for _ in range(k):
                dist.recv(y, 0)
                dist.send(x, 0)
        return (clock() - t0) // (2 * k), (cpu() - c0) // (2 * k)

    try:
        rows = in_turns(run, observe.set_enabled, args["cycles"], args["turn"], args["seed"])
        return rows, observe.metrics()["totals"]
    finally:
        dist.destroy_process_group()


def backend_turns(cycles: int, turn: int, seed: int, transport: str) -> dict[int, list[dict[str, float]]]:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=60), wait_for_workers=False)
    args = {"cycles": cycles, "turn": turn, "seed": seed, "transport": transport}
    got: dict[int, list[dict[str, float]]] = {}
    for rank, (rows, counted) in run_pair(
        _backend_rank, store.port, args, limit_s=1800, what="the backend turns"
    ).items():
        # (every "on" turn counted its messages: a run where counting never happened would show it here)
        expect = (cycles + 1) * turn
        if counted["send"]["messages"] < expect or counted["recv"]["messages"] < expect:
            raise RuntimeError(f"rank {rank} counted {counted}, expected at least {expect} per direction")
        got[rank] = rows
    return got


# -- link -----------------------------------------------------------------------------------------------------
def link_turns(cycles: int, turn: int, seed: int) -> list[dict[str, float]]:
    import torch

    from tensorwire import observe

    a, b, lst = tcp_link_pair("c")
    src, one = torch.ones(SIZE, dtype=torch.uint8), torch.ones(1, dtype=torch.uint8)
    clock, cpu = time.perf_counter_ns, time.thread_time_ns

    def run(k: int) -> tuple[int, int]:
        t0, c0 = clock(), cpu()
        for _ in range(k):
            a.send("data", src)
            b.recv("data")
            b.send("ack", one)
            a.recv("ack")
        return (clock() - t0) // (4 * k), (cpu() - c0) // (4 * k)

    try:
        return in_turns(run, observe.set_enabled, cycles, turn, seed)
    finally:
        a.close()
        b.close()
        lst.close()


# -- statistics -----------------------------------------------------------------------------------------------
def quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def bootstrap_median(xs: list[float], seed: int, n: int = 2000) -> tuple[float, float]:
    """A 95 % percentile-bootstrap interval of the median of ``xs``."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def summarize(rows: list[dict[str, float]], seed: int) -> dict[str, Any]:
    """Medians of each turn's host µs per call, and per ratio: quartiles, min, max, bootstrap interval."""
    out: dict[str, Any] = {c: statistics.median(r[c] for r in rows) / 1e3 for c in CONDITIONS}
    for name, num, den in (
        ("on/off", "on", "off"),
        ("on/offs", "on", "offs"),
        ("off2/off", "off2", "off"),
        ("on/off cpu", "on_cpu", "off_cpu"),
        ("off2/off cpu", "off2_cpu", "off_cpu"),
    ):
        xs = [r[num] / (r[den] if den != "offs" else (r["off"] + r["off2"]) / 2) for r in rows]
        q1, q2, q3 = quartiles(xs)
        lo, hi = bootstrap_median(xs, seed)
        out[name] = {"median": q2, "q1": q1, "q3": q3, "min": min(xs), "max": max(xs), "ci": (lo, hi)}
    return out


def _ratio_cell(s: dict[str, Any]) -> str:
    return f"{s['median']:.3f} [{s['ci'][0]:.3f}, {s['ci'][1]:.3f}] (IQR {s['q1']:.3f}..{s['q3']:.3f})"


def per_cycle_lines(label: str, rows: list[dict[str, float]], order: list[tuple[str, ...]]) -> list[str]:
    lines = [f"{label}: cycle, order, host us/call off / on / off2, on/off, off2/off"]
    for i, (r, o) in enumerate(zip(rows, order)):
        lines.append(
            f"{i:4d} {'-'.join(o):12s} {r['off'] / 1e3:8.2f} {r['on'] / 1e3:8.2f} {r['off2'] / 1e3:8.2f} "
            f"{r['on'] / r['off']:7.3f} {r['off2'] / r['off']:7.3f}"
        )
    return lines


def load() -> str:
    a, b, c = os.getloadavg()
    return f"{a:.2f} {b:.2f} {c:.2f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=300, help="cycles of three turns (off, on, off2) per measurement")
    ap.add_argument("--turn", type=int, default=200, help="round trips per turn")
    ap.add_argument("--seed", type=int, default=32, help="seed of the turn orders and of the bootstrap")
    ap.add_argument("--what", default="backend,link", help="comma-separated: backend, link")
    ap.add_argument("--transport", default="tcp", choices=("tcp", "ucx"), help="the backend's data plane")
    ap.add_argument("--quiet", action="store_true", help="leave out the per-cycle lines")
    args = ap.parse_args(argv)
    if args.cycles < 1 or args.turn < 1:
        ap.error("--cycles and --turn must be at least 1")
    what = [w.strip() for w in args.what.split(",") if w.strip()]
    unknown = sorted(set(what) - {"backend", "link"})
    if unknown or not what:
        ap.error(f"--what takes backend and/or link, not {','.join(unknown) or 'nothing'}")
    order = orders(args.cycles, args.seed)
    results: list[tuple[str, list[dict[str, float]], str, str]] = []
    for w in what:
        before = load()
        if w == "backend":
            ranks = backend_turns(args.cycles, args.turn, args.seed, args.transport)
            after = load()
            results.append(
                (f"backend tensorwire over {args.transport}, rank 0 (2 calls per round trip)", ranks[0], before, after)
            )
            results.append((f"backend tensorwire over {args.transport}, rank 1", ranks[1], before, after))
        else:
            rows = link_turns(args.cycles, args.turn, args.seed)
            results.append(("Link over TCP, both ends in one thread (4 calls per round trip)", rows, before, load()))
    from tensorwire import observe

    lines = [
        f"{args.cycles} cycles x 3 turns (off, on, off2 in a random order per cycle) x {args.turn} round trips of "
        f"{SIZE} bytes; {os.cpu_count()} cores; counting on times one message in {observe.sample_every()} per route "
        "(TENSORWIRE_METRICS_SAMPLE)",
        "",
        "| what | off: host us/call | on: host us/call | off2: host us/call | on / off host: median [95% CI] "
        "(IQR) | on / mean(off, off2) host | off2 / off host (noise floor) | on / off CPU | load before -> after |",
        "| --- | ---: | ---: | ---: | --- | --- | --- | --- | --- |",
    ]
    for label, rows, before, after in results:
        s = summarize(rows, args.seed)
        lines.append(
            f"| {label} | {s['off']:.2f} | {s['on']:.2f} | {s['off2']:.2f} | {_ratio_cell(s['on/off'])} "
            f"| {_ratio_cell(s['on/offs'])} | {_ratio_cell(s['off2/off'])} | {s['on/off cpu']['median']:.3f} (floor {s['off2/off cpu']['median']:.3f})"
            f" | {before} -> {after} |"
        )
    print("\n".join(lines), flush=True)
    if not args.quiet:
        for label, rows, _, _ in results:
            print()
            print("\n".join(per_cycle_lines(label, rows, order)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
