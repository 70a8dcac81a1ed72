"""``tensorwire demo``: the same bytes through tensorwire, a raw socket and gRPC, on this machine.

Two worker processes on loopback (no cluster needed). Rank 0 sends, rank 1
receives; rank 1 also hosts the gRPC server, so the server runs in its own
process, not in the client's. Three rows, each measured for the three paths in
turns (round by round, so a load change on the machine weighs on all of them
alike):

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
the sent tensors (rank 0) and checking every received byte against the
expected pattern (rank 1) happen outside both clocks, between rounds: the
receiver keeps every message of a round in its own buffer until it has
checked it (tensorwire: ``Node.link(..., depth=messages per round + 1)``, so no
copy; the socket and gRPC receive into as many buffers). Each row starts with
warm-up rounds that are checked but not counted.

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
timed rounds of a stream); the receiver's clock gives the headline ratio a second time.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import time
from datetime import timedelta
from typing import Any, Callable, Sequence, TextIO

__all__ = ["register", "run_demo", "measure", "format_table", "DemoResult", "Row", "DEFAULT_ROWS", "PATHS"]

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
        """Messages per round: all stay in their own receive buffers until the round is checked."""
        return self.messages * self.exchanges


DEFAULT_ROWS: tuple[Row, ...] = (
    Row("4 KiB round trip", 4 * KIB, 1, 4, exchanges=50),  # 20 rounds of 50: 1,000 timed round trips
    Row("1 MiB stream", 1 * MIB, 32, 2),  # 10 rounds of 32 MiB
    Row("64 MiB stream", 64 * MIB, 2, 1),  # 5 rounds of 128 MiB
)
PATHS: tuple[str, ...] = ("tensorwire", "raw socket", "gRPC")
_GRPC_CHUNK = 1 * MIB
_GRPC_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
_GRPC_SERVICE = "twdemo.Exchange"
_ACK = b"k"
_GO = b"g"


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


# -- what is sent and checked -------------------------------------------------------------------------


def _ramp(size: int) -> Any:
    """The byte pattern 0, 1, ..., 255, 0, 1, ... of ``size`` bytes (``size`` a multiple of 256)."""
    import torch

    return torch.arange(256, dtype=torch.uint8).repeat(size // 256)


def _value(row: int, path: int, rnd: int, msg: int, messages: int) -> int:
    """What message ``msg`` of round ``rnd`` (``messages`` per round) adds to the ramp.

    Any 251 consecutive messages of a path differ, so a slot still holding an earlier round's message
    is caught (a slot is reused one round later).
    """
    return (row * 17 + path * 5 + rnd * messages + msg + 1) % 251


def _fill(out: Any, ramp: Any, value: int) -> None:
    import torch

    torch.add(ramp, value, out=out)  # uint8 arithmetic wraps around


def count_bad(received: Sequence[Any], ramp: Any, values: Sequence[int], scratch: Any) -> int:
    """How many of ``received`` differ anywhere from ``ramp + value`` (every byte compared)."""
    import torch

    bad = 0
    for buf, value in zip(received, values):
        _fill(scratch, ramp, value)
        if buf.shape != scratch.shape or not torch.equal(buf, scratch):
            bad += 1
    return bad


# -- the three paths, one class per side --------------------------------------------------------------


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k


def _nodelay(sock: socket.socket, timeout: float) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(timeout)
    return sock


class _TwSender:
    def __init__(self, link: Any) -> None:
        self.link = link

    def exchange(self, row: int, srcs: Sequence[Any], first: int) -> None:
        name = f"row{row}"
        for t in srcs:
            self.link.send(name, t)
        self.link.recv("ack")


class _TwReceiver:
    def __init__(self, link: Any, ack: Any) -> None:
        self.link = link
        self.ack = ack

    def exchange(self, row: int, first: int, n: int) -> list[Any]:
        name = f"row{row}"
        got = [self.link.recv(name) for _ in range(n)]  # depth per round + 1: all stay valid until checked
        self.link.send("ack", self.ack)
        return got


class _SocketSender:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.ack = memoryview(bytearray(1))

    def exchange(self, row: int, srcs: Sequence[Any], first: int) -> None:
        for t in srcs:
            self.sock.sendall(memoryview(t.numpy()))
        _recv_exact(self.sock, self.ack)


class _SocketReceiver:
    def __init__(self, sock: socket.socket, buffers: list[list[Any]]) -> None:
        self.sock = sock
        self.views = [[memoryview(b.numpy()) for b in bufs] for bufs in buffers]
        self.buffers = buffers

    def exchange(self, row: int, first: int, n: int) -> list[Any]:
        for view in self.views[row][first : first + n]:
            _recv_exact(self.sock, view)
        self.sock.sendall(_ACK)
        return self.buffers[row][first : first + n]


class _GrpcSender:
    def __init__(self, address: str, timeout: float) -> None:
        import grpc

        self.timeout = timeout
        self.channel = grpc.insecure_channel(address, options=_GRPC_OPTIONS)
        grpc.channel_ready_future(self.channel).result(timeout=timeout)
        self.unary = self.channel.unary_unary(f"/{_GRPC_SERVICE}/Put")
        self.stream = self.channel.stream_unary(f"/{_GRPC_SERVICE}/Stream")
        hello = self.channel.unary_unary(f"/{_GRPC_SERVICE}/Hello")
        self.server_pid = int(hello(b"", timeout=timeout))
        self.meta: dict[tuple[int, int], tuple[tuple[str, str], ...]] = {}

    def exchange(self, row: int, srcs: Sequence[Any], first: int) -> None:
        meta = self.meta.get((row, first))
        if meta is None:  # where the server puts the messages: its first buffer of the round
            meta = self.meta[(row, first)] = (("tw-row", str(row)), ("tw-first", str(first)))
        if len(srcs) == 1:
            reply = self.unary(srcs[0].numpy().tobytes(), timeout=self.timeout, metadata=meta)
        else:

            def chunks() -> Any:
                for t in srcs:
                    a = t.numpy()
                    for off in range(0, len(a), _GRPC_CHUNK):
                        yield a[off : off + _GRPC_CHUNK].tobytes()

            reply = self.stream(chunks(), timeout=self.timeout, metadata=meta)
        if reply != _ACK:
            raise ConnectionError(f"unexpected gRPC reply {reply[:16]!r}")

    def close(self) -> None:
        self.channel.close()


class _GrpcReceiver:
    """A gRPC server in this process (rank 1's); its handlers hand each finished round to :meth:`exchange`."""

    def __init__(self, buffers: list[list[Any]], timeout: float) -> None:
        import grpc
        from concurrent import futures

        self.buffers = buffers
        self.arrays = [[b.numpy() for b in bufs] for bufs in buffers]
        self.timeout = timeout
        self.done: queue.Queue[BaseException | None] = queue.Queue()
        handlers = grpc.method_handlers_generic_handler(
            _GRPC_SERVICE,
            {
                "Hello": grpc.unary_unary_rpc_method_handler(lambda req, ctx: str(os.getpid()).encode()),
                "Put": grpc.unary_unary_rpc_method_handler(self._put),
                "Stream": grpc.stream_unary_rpc_method_handler(self._stream),
            },
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=_GRPC_OPTIONS)
        self.server.add_generic_rpc_handlers((handlers,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    @staticmethod
    def _where(context: Any) -> tuple[int, int]:
        meta = dict(context.invocation_metadata())
        return int(meta["tw-row"]), int(meta["tw-first"])

    def _put(self, request: bytes, context: Any) -> bytes:
        import numpy as np

        try:
            row, first = self._where(context)
            dst = self.arrays[row][first]
            dst[:] = np.frombuffer(request, dtype=np.uint8)
            self.done.put(None)
        except BaseException as exc:
            self.done.put(exc)
            raise
        return _ACK

    def _stream(self, chunks: Any, context: Any) -> bytes:
        import numpy as np

        try:
            row, first = self._where(context)
            arrays = self.arrays[row]
            msg, off = first, 0
            for chunk in chunks:
                dst = arrays[msg]
                dst[off : off + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
                off += len(chunk)
                if off == len(dst):
                    msg, off = msg + 1, 0
            if off:
                raise ValueError(f"a gRPC stream ended inside message {msg}")
            self.done.put(None)
        except BaseException as exc:
            self.done.put(exc)
            raise
        return _ACK

    def exchange(self, row: int, first: int, n: int) -> list[Any]:
        err = self.done.get(timeout=self.timeout)
        if err is not None:
            raise err
        return self.buffers[row][first : first + n]

    def close(self) -> None:
        self.server.stop(grace=1.0).wait(3.0)


# -- the two worker processes -------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    rows: tuple[Row, ...]
    rounds: int
    transport: str
    grpc: bool
    timeout: float
    check_pause: float

    def paths(self) -> tuple[str, ...]:
        return PATHS if self.grpc else PATHS[:2]

    def timed(self, row: Row) -> int:
        return max(1, self.rounds * row.scale)

    def warmup(self, row: Row) -> int:
        return max(1, self.timed(row) // 10)


def _specs(plan: _Plan) -> tuple[list[Any], Any, dict[str, int]]:
    import tensorwire as tw

    rows = [tw.TensorSpec(f"row{i}", (r.size,), "uint8") for i, r in enumerate(plan.rows)]
    depth = {s.name: r.per_round + 1 for s, r in zip(rows, plan.rows)}
    return rows, tw.TensorSpec("ack", (1,), "uint8"), depth


def _sender(plan: _Plan, store: Any, q: Any) -> None:
    import torch

    import tensorwire as tw

    rows, ack, _ = _specs(plan)
    with tw.Node(rank=0, world_size=2, store=store, transport=plan.transport, timeout=plan.timeout) as node:
        link = node.link(1, send=rows, recv=[ack])
        ports = [int(p) for p in store.get("demo/ports").decode().split(",")]
        ctrl = _nodelay(socket.create_connection(("127.0.0.1", ports[0]), timeout=plan.timeout), plan.timeout)
        data = _nodelay(socket.create_connection(("127.0.0.1", ports[1]), timeout=plan.timeout), plan.timeout)
        paths: list[Any] = [_TwSender(link), _SocketSender(data)]
        grpc_pid = None
        if plan.grpc:
            paths.append(_GrpcSender(f"127.0.0.1:{ports[2]}", plan.timeout))
            grpc_pid = paths[2].server_pid
        q.put(("ready", 0, {"transport": link.transport, "pid": os.getpid(), "grpc_server_pid": grpc_pid}))
        go = memoryview(bytearray(1))
        times: dict[str, list[float]] = {}
        try:
            perf = time.perf_counter
            for i, row in enumerate(plan.rows):
                q.put(("start", 0, i))
                ramp = _ramp(row.size)
                n, m = row.per_round, row.messages
                srcs = [torch.empty(row.size, dtype=torch.uint8) for _ in range(n)]
                parts = [(srcs[e * m : (e + 1) * m], e * m) for e in range(row.exchanges)]
                row_times: dict[str, list[float]] = {p: [] for p in plan.paths()}
                warm = plan.warmup(row)
                for rnd in range(warm + plan.timed(row)):
                    for p, path in enumerate(paths):
                        for k, t in enumerate(srcs):  # the "model" writes its outputs: not timed
                            _fill(t, ramp, _value(i, p, rnd, k, n))
                        _recv_exact(ctrl, go)  # the receiver has checked the last round and is ready
                        stamps = [perf()]
                        for part, first in parts:  # back to back, as training steps are
                            path.exchange(i, part, first)
                            stamps.append(perf())
                        if rnd >= warm:
                            row_times[plan.paths()[p]] += [b - a for a, b in zip(stamps, stamps[1:])]
                for kind in row_times:
                    times[f"{i}/{kind}"] = row_times[kind]
                q.put(("row", 0, (i, row_times)))
        finally:
            if plan.grpc:
                paths[2].close()
            ctrl.close()
            data.close()
    q.put(("done", 0, {"times": times}))


def _receiver(plan: _Plan, store: Any, q: Any) -> None:
    import torch

    import tensorwire as tw

    rows, ack, depth = _specs(plan)
    ctrl_l = socket.create_server(("127.0.0.1", 0))
    data_l = socket.create_server(("127.0.0.1", 0))

    def buffers() -> list[list[Any]]:
        return [[torch.empty(r.size, dtype=torch.uint8) for _ in range(r.per_round)] for r in plan.rows]

    grpc_rx = _GrpcReceiver(buffers(), plan.timeout) if plan.grpc else None
    store.set("demo/ports", f"{ctrl_l.getsockname()[1]},{data_l.getsockname()[1]},{grpc_rx.port if grpc_rx else 0}")
    try:
        with tw.Node(rank=1, world_size=2, store=store, transport=plan.transport, timeout=plan.timeout) as node:
            link = node.link(0, send=[ack], recv=rows, depth=depth)
            ctrl_l.settimeout(plan.timeout)
            data_l.settimeout(plan.timeout)
            ctrl = _nodelay(ctrl_l.accept()[0], plan.timeout)
            data = _nodelay(data_l.accept()[0], plan.timeout)
            paths: list[Any] = [_TwReceiver(link, torch.ones(1, dtype=torch.uint8)), _SocketReceiver(data, buffers())]
            if grpc_rx is not None:
                paths.append(grpc_rx)
            names = plan.paths()
            times: dict[str, list[float]] = {}
            bad = {p: 0 for p in names}
            checked = 0
            perf = time.perf_counter
            for i, row in enumerate(plan.rows):
                ramp = _ramp(row.size)
                scratch = torch.empty(row.size, dtype=torch.uint8)
                warm = plan.warmup(row)
                row_times: dict[str, list[float]] = {p: [] for p in names}
                n, m = row.per_round, row.messages
                for rnd in range(warm + plan.timed(row)):
                    for p, path in enumerate(paths):
                        got: list[Any] = []
                        ctrl.sendall(_GO)
                        stamps = [perf()]
                        for first in range(0, n, m):  # back to back, as training steps are
                            got += path.exchange(i, first, m)
                            stamps.append(perf())
                        if rnd >= warm:
                            row_times[names[p]] += [b - a for a, b in zip(stamps, stamps[1:])]
                        values = [_value(i, p, rnd, k, n) for k in range(n)]
                        bad[names[p]] += count_bad(got, ramp, values, scratch)  # every byte: not timed
                        checked += row.size * len(got)
                        if plan.check_pause:
                            time.sleep(plan.check_pause)  # tests: a slow check must stay off both clocks
                for kind in names:
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
    q.put(("done", 1, {"times": times, "bad": bad, "checked_bytes": checked, "pid": os.getpid()}))


def _worker(rank: int, port: int, plan: _Plan, q: Any) -> None:
    try:
        import torch
        from torch.distributed import TCPStore

        torch.set_num_threads(1)  # two processes share the cores: no intra-op pool fighting the exchange
        store = TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=plan.timeout))
        (_sender if rank == 0 else _receiver)(plan, store, q)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        q.put(("error", rank, f"{type(exc).__name__}: {exc}"))


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

    plan = _Plan(tuple(rows), rounds, transport, grpc, timeout, check_pause)
    say = progress or (lambda line: None)
    store = TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=timeout), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, store.port, plan, q), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    got: dict[int, dict[str, Any]] = {}
    ready: dict[str, Any] = {}
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
                say(
                    f"  workers connected: tensorwire over {payload['transport']}, gRPC server in process "
                    f"{payload['grpc_server_pid']} (client: {payload['pid']})"
                    if grpc
                    else f"  workers connected: tensorwire over {payload['transport']}"
                )
            elif kind == "start":
                row = plan.rows[payload]
                t_row = time.monotonic()
                say(
                    f"  {row.label} ...  {plan.warmup(row)} warm-up + {plan.timed(row)} timed rounds of "
                    + (f"{row.exchanges} round trips" if row.round_trip else f"{row.messages} messages then an ack")
                    + f", {len(plan.paths())} paths in turns"
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
            "grpc_server": ready.get("grpc_server_pid"),
            "parent": os.getpid(),
        },
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


def format_table(res: DemoResult) -> list[str]:
    """The table and its headline, as lines."""
    heads = [f"tensorwire ({res.transport})" if p == "tensorwire" else p for p in res.paths]
    w0 = max(len(r.label) for r in res.rows) + 2
    widths = [max(len(h), 10) + 2 for h in heads]
    lines = ["".ljust(w0) + "".join(h.rjust(w) for h, w in zip(heads, widths))]
    for i, row in enumerate(res.rows):
        cells = [_fmt(row, res.figure(i, p)) for p in res.paths]
        lines.append(row.label.ljust(w0) + "".join(c.rjust(w) for c, w in zip(cells, widths)))
    other = "gRPC" if "gRPC" in res.paths else "raw socket"
    ratios = [f"{res.speedup(i, other):.1f}x" for i in range(len(res.rows))]
    ratios_rx = [f"{res.speedup(i, other, clock='receiver'):.1f}x" for i in range(len(res.rows))]
    labels = " / ".join(r.label for r in res.rows)
    lines.append("")
    lines.append(f"tensorwire vs {other}: {' / '.join(ratios)}  ({labels}; receiver's clock: {' / '.join(ratios_rx)})")
    if other == "gRPC":
        sock = [f"{res.speedup(i, 'raw socket'):.2f}x" for i in range(len(res.rows))]
        lines.append(f"tensorwire vs raw socket: {' / '.join(sock)}")
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
        "tensorwire demo: two processes on this machine (loopback), rank 0 -> rank 1; paths in turns, "
        "exchanges back to back (steady state); every byte checked, outside the clocks",
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
    print("", file=out)
    for line in format_table(res):
        print(line, file=out)
    bad = sum(res.bad.values())
    print(
        f"checked {res.checked_bytes / 1e9:.2f} GB received, corrupted messages: {bad} "
        f"({time.monotonic() - t0:.0f} s; medians by the sender's clock; round trip = 4 KiB there, 1 byte back)",
        file=out,
    )
    return 0 if bad == 0 else 1
