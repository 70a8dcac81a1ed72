"""The two worker processes of ``tensorwire demo``: what they exchange, time and check.

:class:`Row` is one row of the table and :class:`RunPlan` one run; :func:`worker`
is what each spawned process runs (rank 0 sends and times, rank 1 receives,
times and checks every byte of each receive buffer after each round, outside both clocks). Results go back to the
parent on a queue. torch and tensorwire are imported in the worker, not here.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import socket
import time
from datetime import timedelta
from typing import Any, Sequence

from tensorwire import native
from tensorwire.benchmark.worker import pair_process_setup, recv_slots
from tensorwire.demo.paths import (
    GrpcReceiver,
    GrpcSender,
    SocketReceiver,
    SocketSender,
    TwReceiver,
    TwSender,
    recv_exact,
    tune,
)

__all__ = [
    "Row",
    "DEFAULT_ROWS",
    "PATHS",
    "RunPlan",
    "worker",
    "make_ramp",
    "message_value",
    "fill",
    "count_bad",
    "SOURCES",
    "CHECK_CHUNK",
    "last_in_each",
]

KIB = 1024
MIB = 1024 * KIB


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of the table: ``exchanges`` exchanges back to back per round, each ``messages`` messages
    of ``size`` bytes then one ack; every exchange is timed (a stream row: one exchange per round)."""

    label: str
    size: int
    messages: int
    #: timed rounds per unit of ``--rounds``
    scale: int
    #: exchanges per round, back to back (each timed)
    exchanges: int = 1

    @property
    def round_trip(self) -> bool:
        return self.messages == 1

    @property
    def per_round(self) -> int:
        """Messages per round."""
        return self.messages * self.exchanges


DEFAULT_ROWS: tuple[Row, ...] = (
    Row("4 KiB round trip", 4 * KIB, 1, 4, exchanges=50),  # 20 rounds of 50: 1,000 timed round trips
    Row("1 MiB stream", 1 * MIB, 32, 2),  # 10 rounds of 32 MiB
    Row("64 MiB stream", 64 * MIB, 2, 1),  # 5 rounds of 128 MiB
)
PATHS: tuple[str, ...] = ("tensorwire", "raw socket", "gRPC")
_GO = b"g"


# -- what is sent and checked -------------------------------------------------------------------------


def make_ramp(size: int) -> Any:
    """The byte pattern 0, 1, ..., 255, 0, 1, ... of ``size`` bytes (``size`` a multiple of 256)."""
    import torch

    return torch.arange(256, dtype=torch.uint8).repeat(size // 256)


#: Source tensors per row, filled before its rounds; round ``r`` sends every message out of source
#: ``r % SOURCES``, so nothing is written between rounds (as ``tensorwire bench`` writes nothing between its
#: messages) and any ``SOURCES`` consecutive rounds expect different bytes.
SOURCES = 3
#: The receiver compares what it got with the expected bytes this many at a time: the check writes no more
#: than this (a 64 MiB expected copy written between rounds left the caches full of dirty lines that the next
#: round's copies had to write back first).
CHECK_CHUNK = 1 << 20


def message_value(row: int, rnd: int) -> int:
    """What every message of round ``rnd`` of row ``row`` adds to the ramp: the value of source
    ``rnd % SOURCES`` (a receive buffer left with a message of any of the last ``SOURCES - 1`` rounds is caught)."""
    return (row * 17 + rnd % SOURCES + 1) % 251


def fill(out: Any, ramp: Any, value: int) -> None:
    import torch

    torch.add(ramp, value, out=out)  # uint8 arithmetic wraps around


def last_in_each(received: Sequence[Any]) -> list[Any]:
    """The distinct buffers among ``received`` (tensors: a round's receive buffers, message by message; a buffer
    reused holds the last message received into it), by address, in order of first use."""
    seen: dict[int, Any] = {}
    for buf in received:
        seen.setdefault(buf.data_ptr(), buf)
    return list(seen.values())


def count_bad(received: Sequence[Any], ramp: Any, values: Sequence[int], scratch: Any) -> int:
    """How many of ``received`` differ anywhere from ``ramp + value`` (every byte compared, ``scratch`` bytes at a
    time: ``scratch`` holds the expected bytes of one piece, a multiple of the ramp's 256-byte period long)."""
    import torch

    bad = 0
    c = scratch.numel()
    n = ramp.numel()
    for buf, value in zip(received, values):
        fill(scratch, ramp[:c], value)
        if buf.shape != ramp.shape or not all(
            torch.equal(buf[o : o + c], scratch[: min(c, n - o)]) for o in range(0, n, c)
        ):
            bad += 1
    return bad


# -- the two worker processes -------------------------------------------------------------------------


def path_settings(transport: str) -> str:
    """The settings that shape tensorwire's path over ``transport``, as ``name=value`` words."""
    from tensorwire.p2p.link import EAGER_MAX_BYTES
    from tensorwire.settings import setting

    if transport == "tcp":
        cma = setting("cma")
        return (
            f"eager sends up to {EAGER_MAX_BYTES // 1024} KiB, "
            + (f"cross-memory attach from {setting('cma_min_bytes') // 1024} KiB" if cma == "auto" else "cma off")
            + f", reader polls {setting('tcp_spin_us'):g} µs before sleeping"
        )
    return f"UCX error handling {setting('ucx_error_handling')}, polls {setting('ucx_spin_us'):g} µs before sleeping"


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads (a gRPC server's included)."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


@dataclasses.dataclass(frozen=True)
class RunPlan:
    rows: tuple[Row, ...]
    rounds: int
    transport: str
    grpc: bool
    timeout: float
    check_pause: float

    def paths(self) -> tuple[str, ...]:
        return PATHS if self.grpc else PATHS[:2]

    def phases(self) -> tuple[tuple[int, ...], ...]:
        """The paths measured together, by index into :meth:`paths`: tensorwire and the raw socket in turns
        (each row, round after round), then gRPC alone. Its server and channel are made only for its phase: a
        live gRPC server and channel keep threads of their own in both processes, which took 30-60 µs of a
        tensorwire 4 KiB round trip on a 2-core machine (132-161 µs without gRPC there, 188-196 with)."""
        return ((0, 1), (2,)) if self.grpc else ((0, 1),)

    def timed(self, row: Row) -> int:
        return max(1, self.rounds * row.scale)

    def warmup(self, row: Row) -> int:
        """Rounds before the timed ones: at least one per source (:data:`SOURCES`), so that every source and every
        receive buffer has been through the path before the clocks run. The first time a buffer goes through a
        path costs more (on the 2-core VM the first round out of a source never sent read 5.1 GB/s at 64 MiB
        against 6.2-8.8 for the rounds after it; the first out of a receive slot never written, 2.2-3.4 against
        4-8), and with a few timed rounds that one moved the median."""
        return max(SOURCES, self.timed(row) // 10)


def _specs(plan: RunPlan) -> tuple[list[Any], Any, dict[str, int]]:
    import tensorwire as tw

    rows = [tw.TensorSpec(f"row{i}", (r.size,), "uint8") for i, r in enumerate(plan.rows)]
    depth = {s.name: recv_slots("tensorwire") for s in rows}  # (the receive slots tensorwire bench's link has)
    return rows, tw.TensorSpec("ack", (1,), "uint8"), depth


def _sender(plan: RunPlan, store: Any, q: Any) -> None:
    import torch

    import tensorwire as tw

    rows, ack, _ = _specs(plan)
    with tw.Node(rank=0, world_size=2, store=store, transport=plan.transport, timeout=plan.timeout) as node:
        link = node.link(1, send=rows, recv=[ack])
        ports = [int(p) for p in store.get("demo/ports").decode().split(",")]
        ctrl = tune(socket.create_connection(("127.0.0.1", ports[0]), timeout=plan.timeout), plan.timeout)
        data = tune(socket.create_connection(("127.0.0.1", ports[1]), timeout=plan.timeout), plan.timeout)
        paths: list[Any] = [TwSender(link), SocketSender(data)]
        ready = {
            "transport": link.transport,
            "pid": os.getpid(),
            "build": native.summary(),
            "settings": path_settings(link.transport),
        }
        q.put(("ready", 0, ready))
        go = memoryview(bytearray(1))
        times: dict[str, list[float]] = {}
        cpu: dict[str, float] = {}
        names = plan.paths()
        try:
            perf = time.perf_counter
            for phase in plan.phases():
                if phase == (2,):  # gRPC: its channel made only now (see RunPlan.phases)
                    port = int(store.get("demo/grpc_port").decode())
                    paths.append(GrpcSender(f"127.0.0.1:{port}", plan.timeout))
                    q.put(("grpc", 0, {"grpc_server_pid": paths[2].server_pid, "pid": os.getpid()}))
                for i, row in enumerate(plan.rows):
                    q.put(("start", 0, (i, phase)))
                    ramp = make_ramp(row.size)
                    m = row.messages
                    srcs = [torch.empty(row.size, dtype=torch.uint8) for _ in range(SOURCES)]
                    for k, t in enumerate(srcs):  # the "model" wrote its outputs (see SOURCES)
                        fill(t, ramp, message_value(i, k))
                    row_times: dict[str, list[float]] = {names[p]: [] for p in phase}
                    row_cpu = {names[p]: 0.0 for p in phase}
                    warm = plan.warmup(row)
                    for rnd in range(warm + plan.timed(row)):
                        for p in phase:
                            path = paths[p]
                            src = srcs[rnd % SOURCES]  # every message of the round: tensorwire bench's layout
                            parts = [([src] * m, e * m) for e in range(row.exchanges)]
                            recv_exact(ctrl, go)  # the receiver has checked the last round and is ready
                            c0 = cpu_seconds()
                            stamps = [perf()]
                            for part, first in parts:  # back to back, as training steps are
                                path.exchange(i, part, first)
                                stamps.append(perf())
                            if rnd >= warm:
                                row_cpu[names[p]] += cpu_seconds() - c0
                                row_times[names[p]] += [b - a for a, b in zip(stamps, stamps[1:])]
                    for kind in row_times:
                        times[f"{i}/{kind}"] = row_times[kind]
                        cpu[f"{i}/{kind}"] = row_cpu[kind]
                    q.put(("row", 0, (i, row_times)))
        finally:
            if len(paths) > 2:
                paths[2].close()
            ctrl.close()
            data.close()
    q.put(("done", 0, {"times": times, "cpu": cpu}))


def _receiver(plan: RunPlan, store: Any, q: Any) -> None:
    import torch

    import tensorwire as tw

    rows, ack, depth = _specs(plan)
    ctrl_l = socket.create_server(("127.0.0.1", 0))
    data_l = socket.create_server(("127.0.0.1", 0))

    def buffers(path: str) -> list[list[Any]]:
        return [[torch.empty(r.size, dtype=torch.uint8) for _ in range(recv_slots(path))] for r in plan.rows]

    grpc_rx: GrpcReceiver | None = None
    store.set("demo/ports", f"{ctrl_l.getsockname()[1]},{data_l.getsockname()[1]}")
    try:
        with tw.Node(rank=1, world_size=2, store=store, transport=plan.transport, timeout=plan.timeout) as node:
            link = node.link(0, send=[ack], recv=rows, depth=depth)
            ctrl_l.settimeout(plan.timeout)
            data_l.settimeout(plan.timeout)
            ctrl = tune(ctrl_l.accept()[0], plan.timeout)
            data = tune(data_l.accept()[0], plan.timeout)
            paths: list[Any] = [
                TwReceiver(link, torch.ones(1, dtype=torch.uint8)),
                SocketReceiver(data, buffers("raw socket")),
            ]
            names = plan.paths()
            times: dict[str, list[float]] = {}
            cpu: dict[str, float] = {}
            bad = {p: 0 for p in names}
            checked = 0
            slots: dict[str, int] = {}  # receive buffers seen per row and path
            perf = time.perf_counter
            for phase in plan.phases():
                if phase == (2,):  # gRPC: its server made only now (see RunPlan.phases)
                    grpc_rx = GrpcReceiver(buffers("gRPC"), plan.timeout)
                    paths.append(grpc_rx)
                    store.set("demo/grpc_port", str(grpc_rx.port))
                for i, row in enumerate(plan.rows):
                    ramp = make_ramp(row.size)
                    scratch = torch.empty(min(row.size, CHECK_CHUNK), dtype=torch.uint8)
                    warm = plan.warmup(row)
                    row_times: dict[str, list[float]] = {names[p]: [] for p in phase}
                    n, m = row.per_round, row.messages
                    for rnd in range(warm + plan.timed(row)):
                        for p in phase:
                            path = paths[p]
                            got: list[Any] = []
                            ctrl.sendall(_GO)
                            c0 = cpu_seconds()
                            stamps = [perf()]
                            for first in range(0, n, m):  # back to back, as training steps are
                                got += path.exchange(i, first, m)
                                stamps.append(perf())
                            if rnd >= warm:
                                cpu[f"{i}/{names[p]}"] = cpu.get(f"{i}/{names[p]}", 0.0) + cpu_seconds() - c0
                                row_times[names[p]] += [b - a for a, b in zip(stamps, stamps[1:])]
                            # every byte of each receive buffer, which holds the last message into it: not timed
                            last = last_in_each(got)
                            bad[names[p]] += count_bad(last, ramp, [message_value(i, rnd)] * len(last), scratch)
                            checked += row.size * len(last)
                            slots[f"{i}/{names[p]}"] = max(slots.get(f"{i}/{names[p]}", 0), len(last))
                            if plan.check_pause:
                                time.sleep(plan.check_pause)  # tests: a slow check must stay off both clocks
                    for kind in row_times:
                        times[f"{i}/{kind}"] = row_times[kind]
            # wait for the sender to hang up before tearing the gRPC server and the link down
            ctrl.settimeout(plan.timeout)
            ctrl.recv(1)
            ctrl.close()
            data.close()
    finally:
        if grpc_rx is not None:
            grpc_rx.close()
        ctrl_l.close()
        data_l.close()
    done = {"times": times, "cpu": cpu, "bad": bad, "checked_bytes": checked, "slots": slots, "pid": os.getpid()}
    q.put(("done", 1, done))


def worker(rank: int, port: int, plan: RunPlan, q: Any) -> None:
    try:
        from torch.distributed import TCPStore

        pair_process_setup()  # as tensorwire bench's pair processes: one torch thread
        store = TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=plan.timeout))
        (_sender if rank == 0 else _receiver)(plan, store, q)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        q.put(("error", rank, f"{type(exc).__name__}: {exc}"))
