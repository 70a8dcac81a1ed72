"""``tensorwire demo``: the same bytes through tensorwire, a raw socket and gRPC, on this machine.

Two worker processes on loopback (no cluster needed). Rank 0 sends, rank 1
receives; rank 1 also hosts the gRPC server, so the server runs in its own
process, not in the client's. Three rows, each measured for tensorwire and the
raw socket in turns (round by round, so a load change on the machine weighs on
both alike), then for gRPC alone: its server and channel are made only then,
because their threads, running beside the other two paths, took 30-60 µs of a
tensorwire 4 KiB round trip on a 2-core machine:

- **4 KiB round trip**: one 4 KiB message and a 1-byte acknowledgement back,
  50 of them back to back per round, each timed;
- **1 MiB stream** (32 messages) and **64 MiB stream** (2 messages): the
  round's messages sent back to back, then one acknowledgement; the round is timed.

Real training exchanges tensors back to back, so that is what is timed: the
steady state, not the first exchange after an idle pause (a thread waiting on
UCX spins 100 µs, then sleeps, and the exchange that wakes it pays for that;
a socket's reader pays a wake-up too). A round starts when rank 1 says "go"
on a control socket; rank 0 starts its clock when the go arrives, rank 1 when
it has said it; each side reads its clock again after every exchange of the
round (rank 0 once the acknowledgement is in, rank 1 once it is out). Filling
the sent tensors (rank 0, before a row's rounds) and checking the received
bytes against the expected pattern (rank 1, between rounds) happen outside
both clocks. The
layout is ``tensorwire bench``'s (:func:`tensorwire.benchmark.worker.recv_slots`):
rank 0 sends every message of a round out of one tensor (one of three, filled
before the row's rounds: nothing is written between rounds);
rank 1 receives into a link of default depth (two slots) and, for the socket and
gRPC, into one buffer, reused in turn -- as a pipeline stage's activations,
written just before they go into a link, stay in the caches. After each round
rank 1 checks every byte of each receive buffer (the last message into it)
against the round's pattern. Each row starts with warm-up rounds that are
checked but not counted.

The paths:

- *tensorwire*: a ``Link`` (``send``/``recv`` into preallocated slots), the
  transport ``auto`` picks (UCX on one host), or ``--transport``;
- *raw socket*: one TCP socket, ``sendall`` out of the tensor, ``recv_into``
  the receiver's buffer (no framing): the floor a socket gives;
- *gRPC*: raw bytes (no protobuf wrapper, message limits raised); a unary
  call for the round trip, one client-streaming call per round in 1 MiB chunks
  for the streams (the fastest way gRPC has of moving bulk bytes). The server
  copies each message into its preallocated buffer, as receiving a tensor needs.

The table shows medians by rank 0's clock (over every timed round trip, over the
timed rounds of a stream); a footnote gives the ratios by the receiver's clock. Each side also
reads its process's CPU time around the same exchanges: where tensorwire loses to a baseline, one
line says by how much and what each path's exchange cost in CPU (on a machine whose cores are
busy, that CPU is the time). The first line says which build ran (the compiled hot path or pure
Python, :func:`tensorwire.native.summary`) and which transport ``auto`` chose, with the settings
that shape it.

The raw socket path is ``tensorwire bench``'s (:mod:`tensorwire.benchmark.backends.rawtcp`'s
``tune`` and ``recv_exact``), and both commands set up their processes with
:func:`tensorwire.benchmark.worker.pair_process_setup`: one exchange, measured the same way.

The package: this module is the parent (the ``demo`` subcommand, :func:`measure`,
the table); :mod:`~tensorwire.demo.workers` is what the two spawned processes
run, :mod:`~tensorwire.demo.paths` the three paths, one class per side.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
from datetime import timedelta
from typing import Any, Callable, Sequence, TextIO

from tensorwire.demo.workers import DEFAULT_ROWS, PATHS, RunPlan, Row, count_bad, worker

__all__ = [
    "register",
    "run_demo",
    "measure",
    "format_table",
    "DemoResult",
    "Row",
    "DEFAULT_ROWS",
    "PATHS",
    "count_bad",
]


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="the same bytes through tensorwire, a raw socket and gRPC on this machine")
    p.add_argument(
        "--rounds",
        "--steps",
        dest="rounds",
        type=int,
        default=5,
        help="timed rounds per 64 MiB row (default 5; the 1 MiB row runs twice as many, "
        "the round trip row 4 times as many rounds of 50 round trips)",
    )
    p.add_argument("--transport", default="auto", choices=("auto", "ucx", "tcp"))
    p.add_argument("--no-grpc", action="store_true", help="skip gRPC")
    p.add_argument("--timeout", type=float, default=120.0, help="overall timeout in seconds")
    p.set_defaults(
        func=lambda a: run_demo(rounds=a.rounds, transport=a.transport, grpc=not a.no_grpc, timeout=a.timeout)
    )


# -- the parent: run, collect, print ------------------------------------------------------------------


@dataclasses.dataclass
class DemoResult:
    """What a demo run measured. ``sender[row][path]`` / ``receiver[...]``: seconds per timed exchange
    (``rounds * exchanges`` of them; a round's exchanges are consecutive)."""

    rows: tuple[Row, ...]
    paths: tuple[str, ...]
    transport: str
    sender: list[dict[str, list[float]]]
    receiver: list[dict[str, list[float]]]
    bad: dict[str, int]
    checked_bytes: int
    pids: dict[str, int | None]
    #: CPU seconds per timed exchange, both processes together: ``cpu[row][path]`` (empty: not measured)
    cpu: list[dict[str, float]] = dataclasses.field(default_factory=list)
    #: which build of the hot path ran (:func:`tensorwire.native.summary` in the workers)
    build: str = "?"
    #: the settings that shape tensorwire's path, as ``name=value`` words
    settings: str = ""
    #: receive buffers each path used per row: ``slots[row][path]`` (:func:`~tensorwire.benchmark.worker.recv_slots`)
    slots: list[dict[str, int]] = dataclasses.field(default_factory=list)

    def figure(self, row: int, path: str, *, clock: str = "sender") -> float:
        """Median per exchange: seconds for a round trip row, bytes/s for a stream row."""
        secs = statistics.median((self.sender if clock == "sender" else self.receiver)[row][path])
        r = self.rows[row]
        return secs if r.round_trip else r.size * r.messages / secs

    def speedup(self, row: int, other: str, *, clock: str = "sender") -> float:
        """How many times faster tensorwire is than ``other`` on ``row``."""
        tw_, o = self.figure(row, "tensorwire", clock=clock), self.figure(row, other, clock=clock)
        return o / tw_ if self.rows[row].round_trip else tw_ / o


def measure(
    *,
    rows: Sequence[Row] = DEFAULT_ROWS,
    rounds: int = 5,
    transport: str = "auto",
    grpc: bool = True,
    timeout: float = 120.0,
    progress: Callable[[str], None] | None = None,
    check_pause: float = 0.0,
) -> DemoResult:
    """Run the two workers and return what they measured.

    Raises:
        TimeoutError: the run did not finish within ``timeout``.
        RuntimeError: a worker failed or died (its error in the message).
    """
    from torch.distributed import TCPStore

    plan = RunPlan(tuple(rows), rounds, transport, grpc, timeout, check_pause)
    say = progress or (lambda line: None)
    store = TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=timeout), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, store.port, plan, q), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    got: dict[int, dict[str, Any]] = {}
    ready: dict[str, Any] = {}
    grpc_pid: int | None = None
    t_row = time.monotonic()
    deadline = time.monotonic() + timeout
    try:
        while len(got) < 2:
            try:
                kind, rank, payload = q.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the demo did not finish within {timeout:g} s") from None
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in got]
                if dead:
                    raise RuntimeError(f"worker {dead[0]} died (exit code {procs[dead[0]].exitcode})") from None
                continue
            if kind == "error":
                raise RuntimeError(f"worker {rank} failed: {payload}")
            if kind == "ready":
                ready = payload
                say(f"  workers connected: tensorwire over {payload['transport']}")
            elif kind == "grpc":
                grpc_pid = payload["grpc_server_pid"]
                say(
                    f"  then gRPC alone (its server in process {grpc_pid}, client {payload['pid']}; made only now: "
                    "its threads would have run beside the other two paths)"
                )
            elif kind == "start":
                i, phase = payload
                row = plan.rows[i]
                t_row = time.monotonic()
                names = plan.paths()
                say(
                    f"  {row.label} ...  {plan.warmup(row)} warm-up + {plan.timed(row)} timed rounds of "
                    + (f"{row.exchanges} round trips" if row.round_trip else f"{row.messages} messages then an ack")
                    + (f", {len(phase)} paths in turns" if len(phase) > 1 else f", {names[phase[0]]}")
                )
            elif kind == "row":
                i, row_times = payload
                say("  " + _row_line(plan.rows[i], row_times) + f"  ({time.monotonic() - t_row:.1f} s)")
            else:
                got[rank] = payload
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    n = len(plan.rows)
    paths = plan.paths()
    per = [plan.timed(r) * r.exchanges for r in plan.rows]
    cpu = [
        {p: (got[0]["cpu"].get(f"{i}/{p}", 0.0) + got[1]["cpu"].get(f"{i}/{p}", 0.0)) / per[i] for p in paths}
        for i in range(n)
    ]
    return DemoResult(
        rows=plan.rows,
        paths=paths,
        transport=ready.get("transport", "?"),
        sender=[{p: got[0]["times"][f"{i}/{p}"] for p in paths} for i in range(n)],
        receiver=[{p: got[1]["times"][f"{i}/{p}"] for p in paths} for i in range(n)],
        bad=got[1]["bad"],
        checked_bytes=got[1]["checked_bytes"],
        pids={
            "sender": ready.get("pid"),
            "receiver": got[1]["pid"],
            "grpc_server": grpc_pid,
            "parent": os.getpid(),
        },
        cpu=cpu,
        build=ready.get("build", "?"),
        settings=ready.get("settings", ""),
        slots=[{p: got[1]["slots"].get(f"{i}/{p}", 0) for p in paths} for i in range(n)],
    )


def _fmt(row: Row, value: float) -> str:
    if row.round_trip:
        return f"{value * 1e6:.1f} µs" if value < 1e-3 else f"{value * 1e3:.2f} ms"
    return f"{value / 1e9:.2f} GB/s"


def _row_line(row: Row, row_times: dict[str, list[float]]) -> str:
    cells = []
    for path, secs in row_times.items():
        s = statistics.median(secs)
        cells.append(f"{path} {_fmt(row, s if row.round_trip else row.size * row.messages / s)}")
    return f"{row.label}: " + ", ".join(cells)


def _ratio(x: float) -> str:
    """How tensorwire compares, in words that say which way is better."""
    return f"{x:.2f}x faster" if x >= 1 else f"{1 / x:.2f}x slower"


def _cpu(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} µs" if seconds < 1e-2 else f"{seconds * 1e3:.1f} ms"


def _the(path: str) -> str:
    return path if path == "gRPC" else f"the {path}"


def _why(res: DemoResult, row: int, other: str) -> str:
    """Why tensorwire lost ``row`` to ``other``, from the CPU both paths spent (nothing if not measured)."""
    if not res.cpu:
        return ""
    what = "round trip" if res.rows[row].round_trip else "round"
    mine, theirs = res.cpu[row]["tensorwire"], res.cpu[row][other]
    if mine > 1.2 * theirs:
        hint = " (pure Python here: the compiled build spends less)" if "Python" in res.build else ""
        return (
            f": it spends {_cpu(mine)} of CPU per {what} (both processes) against {_cpu(theirs)}; on busy cores "
            f"that CPU is the time{hint}"
        )
    return (
        f", with no more CPU per {what} ({_cpu(mine)} against {_cpu(theirs)}): the rest is waiting -- wake-ups, "
        "or other processes on the cores"
    )


def format_table(res: DemoResult) -> list[str]:
    """The table, tensorwire against each baseline, where it loses and why, and the receiver's clock as a
    footnote, as lines."""
    heads = [f"tensorwire ({res.transport})" if p == "tensorwire" else p for p in res.paths]
    w0 = max(len(r.label) for r in res.rows) + 2
    widths = [max(len(h), 10) + 2 for h in heads]
    lines = ["".ljust(w0) + "".join(h.rjust(w) for h, w in zip(heads, widths))]
    for i, row in enumerate(res.rows):
        cells = [_fmt(row, res.figure(i, p)) for p in res.paths]
        lines.append(row.label.ljust(w0) + "".join(c.rjust(w) for c, w in zip(cells, widths)))
    labels = " / ".join(r.label for r in res.rows)
    others = [p for p in res.paths if p != "tensorwire"]
    lines.append("")
    lines.append(f"tensorwire against each ({labels}; by the sender's clock, medians):")
    w = max(len(o) for o in others) + 2
    for other in others:
        lines.append(
            f"  vs {other + ':':<{w}}" + " / ".join(_ratio(res.speedup(i, other)) for i in range(len(res.rows)))
        )
    for i, row in enumerate(res.rows):
        for other in others:
            x = res.speedup(i, other)
            if x >= 1:
                continue
            lines.append(
                f"  tensorwire loses on the {row.label} to {_the(other)}, {1 / x:.2f}x its time{_why(res, i, other)}"
            )
    rx = "; ".join(
        f"vs {other} " + " / ".join(_ratio(res.speedup(i, other, clock="receiver")) for i in range(len(res.rows)))
        for other in others
    )
    lines.append(f"  (by the receiver's clock: {rx})")
    return lines


def run_demo(
    *,
    rounds: int = 5,
    transport: str = "auto",
    grpc: bool = True,
    timeout: float = 120.0,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """``tensorwire demo``: measure, print the table; exit code 0, or 1 if any message arrived corrupted."""
    out = out or sys.stdout
    err = err or sys.stderr
    if rounds < 1:
        print("tensorwire demo: --rounds must be >= 1", file=err)
        return 2
    print(
        "tensorwire demo: two processes on this machine (loopback), rank 0 -> rank 1; tensorwire and a raw socket in "
        "turns, then gRPC; "
        "exchanges back to back (steady state), laid out as tensorwire bench's; every byte of each receive buffer checked "
        "after each round, outside the clocks",
        file=out,
        flush=True,
    )
    t0 = time.monotonic()
    try:
        res = measure(
            rounds=rounds,
            transport=transport,
            grpc=grpc,
            timeout=timeout,
            progress=lambda line: print(line, file=err, flush=True),
        )
    except (TimeoutError, RuntimeError) as exc:
        print(f"tensorwire demo: {exc}", file=err)
        return 1
    print(
        f"tensorwire: {res.transport} transport ({res.settings}); hot path {res.build}",
        file=out,
    )
    print("", file=out)
    for line in format_table(res):
        print(line, file=out)
    bad = sum(res.bad.values())
    print(
        f"checked {res.checked_bytes / 1e9:.2f} GB (each receive buffer's last message, every round), corrupted: {bad} "
        f"({time.monotonic() - t0:.0f} s; medians by the sender's clock; round trip = 4 KiB there, 1 byte back)",
        file=out,
    )
    return 0 if bad == 0 else 1
