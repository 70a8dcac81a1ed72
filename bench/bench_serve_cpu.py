"""The ``tensorwire serve`` daemon's CPU time per data-plane operation, and where it goes.

Not a test. One run starts a daemon (``python -m tensorwire serve``) per tree
-- this checkout, and with ``--baseline-rev REV`` also the package as it was at
git revision REV, in a daemon of its own -- and drives, from this process, N
operations of each kind through each data path:

- kinds: ``get`` (into a preallocated ``out``), ``put``, ``get_rows`` and
  ``add_rows``, each of a *small* (4 KiB) and a *medium* (256 KiB) tensor or
  set of rows (sizes: ``SIZES`` below);
- paths: ``tcp`` (data-plane requests and bytes over the session's TCP
  connection) and ``shm`` (the shared-memory path a client on the daemon's host
  gets: requests over the connection, bytes copied by the client), with read
  leases off, so every read is a request to the daemon (with leases a repeated
  read of an unchanged tensor costs the daemon nothing at all).

What it reports per cell is the daemon process's CPU time (user + system, all
its threads) per operation: the sum of ``/proc/<pid>/task/*/schedstat`` run
times (nanoseconds) before and after the cell's calls, divided by the calls.
CPU time moves far less with the machine's load than wall time does, but on a
2-vCPU VM shared with other jobs it still moves (cold caches after every
sleep): compare cells within one run. Cells and daemons are measured in turns
(``--rounds``), so a drifting load weighs on all of them. Each daemon's idle CPU
rate (measured before the calls) is printed beside them; it is not subtracted.
``/proc/<pid>/stat`` (utime + stime, clock ticks) over the whole run is printed
as a cross-check of the schedstat sum. The client's wall time per operation is
printed for context only.

Beside the daemons, in the same turns (``--no-floor`` skips it): a server
process making only the TcpTransport calls the daemon's request thread makes
for one operation -- the transport's own floor. And a plain-socket server answering
the request and reply of a shared-memory operation with ``recv_into`` and
``sendall``, no tensorwire at all: the floor of any Python server on the
machine (its kernel's wake-ups and the interpreter). Then (``--own-rounds``) each
tree's session request loop and handler, in a process of its own, answering
requests from a transport that moves nothing: the daemon's own code alone.

With ``--profile cprofile`` it then starts each tree's daemon again under this
script's launcher, which runs every session's request thread (where the
data-plane requests are validated and answered) under ``cProfile`` timed by the
thread's CPU clock, drives the same calls again, and lists the top functions by
own time per operation (the profiler's overhead inflates small functions: read
rank and call counts). ``--profile py-spy`` samples the whole daemon instead, only
threads holding the GIL (``--gil``: without it py-spy counts a thread blocked in a
socket call as running); that leaves out time in system calls, and a few
hundred samples per run make its figures coarse.

With ``--perf`` (Linux ``perf`` on the PATH, allowed to read the processes), each
small cell is driven once more while ``perf record`` samples its server
process (every daemon, the transport floor, the plain-socket server), and the
report splits that process's CPU per operation by where the samples fell: the
kernel (system calls, wake-ups, the loopback), the Python interpreter, the
compiled hot path, torch, the C library, other extension modules. It answers
what a change of Python code can still win: the kernel's share is the same for
any Python server making the same system calls.

Usage::

    python bench/bench_serve_cpu.py [--baseline-rev REV] [--native build/native] [--calls 2000] [--rounds 5]
        [--paths tcp,shm] [--kinds get,put,get_rows,add_rows] [--sizes small,medium]
        [--profile cprofile|py-spy] [--perf] [--top 25] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import perf_split  # noqa: E402 - this script's folder is on sys.path

#: size -> (whole tensor shape of get/put, (table rows, row width, rows per request) of get_rows/add_rows); float32
SIZES: dict[str, tuple[tuple[int, ...], tuple[int, int, int]]] = {
    "small": ((1024,), (10_000, 64, 16)),  # 4 KiB; 16 rows x 256 B = 4 KiB
    "medium": ((65536,), (100_000, 128, 512)),  # 256 KiB; 512 rows x 512 B = 256 KiB
}
SIZES_BYTES = {"small": 4 << 10, "medium": 256 << 10}
KINDS = ("get", "put", "get_rows", "add_rows")
PATHS = ("tcp", "shm")


# -- CPU time of a process ------------------------------------------------------------------------------------


def cpu_ns(pid: int) -> int:
    """Run time of every thread of ``pid`` now, in nanoseconds (``/proc/<pid>/task/*/schedstat``)."""
    total = 0
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        try:
            with open(f"{base}/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
            continue  # the thread ended meanwhile
    return total


def cpu_ticks_s(pid: int) -> tuple[float, float]:
    """(utime, stime) of ``pid`` (all threads, ended ones included) in seconds, from ``/proc/<pid>/stat``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    hz = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / hz, int(fields[12]) / hz


# -- the profiled daemon (this script, re-run as a launcher) -------------------------------------------------


def profiled_daemon(prefix: str, argv: list[str]) -> int:
    """Run ``tensorwire <argv>`` with every session's request thread under cProfile (stats: ``prefix.<n>``)."""
    from tensorwire.cli import main
    from tensorwire.serve.daemon import session

    orig = session.Session._request_loop
    count = [0]
    lock = threading.Lock()

    def request_loop(self: Any) -> None:
        prof = cProfile.Profile(time.thread_time)  # CPU time: blocking waits cost nothing
        prof.enable()
        try:
            orig(self)
        finally:
            prof.disable()
            with lock:
                count[0] += 1
                n = count[0]
            prof.dump_stats(f"{prefix}.{n}.tmp")
            os.replace(f"{prefix}.{n}.tmp", f"{prefix}.{n}")

    session.Session._request_loop = request_loop  # type: ignore[method-assign]
    return int(main(argv))


# -- the transport floor: a server making only the TcpTransport calls of one operation ------------------------

#: Floor operations: what the daemon's request thread does on its transport for one operation, and nothing else.
FLOOR_OPS = ("get", "put", "request+reply")
_FLOOR_CODE = {"get": 1, "put": 2, "request+reply": 3}


def _accept_one() -> Any:
    """(a server process) Listen on a free loopback port, print it for the parent, accept one connection."""
    import socket

    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(1)
    print(json.dumps({"port": lst.getsockname()[1]}), flush=True)
    conn, _ = lst.accept()
    lst.close()
    return conn


def _start_server(flag: str, what: str, env: "dict[str, str] | None" = None) -> "tuple[subprocess.Popen[str], int]":
    """Run this script with ``flag`` (a server process); its process and the port it listens on."""
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), flag],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    line = proc.stdout.readline() if proc.stdout else ""
    if not line:
        proc.kill()
        raise SystemExit(f"the {what} server did not start")
    return proc, int(json.loads(line)["port"])


def _stop_server(proc: "subprocess.Popen[str]") -> None:
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
    if proc.stdout:
        proc.stdout.close()


def floor_server() -> int:
    """Serve one connection: per request (tag 4: op code, byte count), the transport calls a daemon makes."""
    import struct

    import torch

    from tensorwire.transport._socket import tune_socket
    from tensorwire.transport.tcp import TcpTransport

    conn = _accept_one()
    tune_socket(conn, peer_timeout=30.0)
    t = TcpTransport(conn)
    reqs = [torch.zeros(96, dtype=torch.uint8) for _ in range(2)]
    views = {id(b): memoryview(b.numpy()) for b in reqs}
    reply = memoryview(torch.zeros(512, dtype=torch.uint8).numpy())
    data = torch.zeros(max(SIZES_BYTES.values()), dtype=torch.uint8)
    data_mv = memoryview(data.numpy())
    for b in reqs:
        t.post_recv(4, b, header=True)
    posted = list(reqs)
    while True:
        try:
            t.wait_recv(4, timeout=60)
        except Exception:  # noqa: BLE001 - the bench closed the connection: done
            return 0
        b = posted.pop(0)
        code, n = struct.unpack_from("<BQ", views[id(b)])
        if code == 0:
            return 0
        if code == 1:  # get: reply, then the bytes
            t.send(5, reply, timeout=30)
            t.send(1, data_mv[:n], timeout=30)
        elif code == 2:  # put: post the slot, GO, receive the bytes, OK
            into = data[:n]
            t.post_recv(2, into)
            t.send(5, reply, timeout=30)
            t.wait_recv(2, timeout=30)
            t.forget_buffer(into)
            t.send(5, reply, timeout=30)
        else:  # a shared-memory operation's exchange: request, reply
            # the daemon posts a request's buffer again before its reply (the credit rides on the reply)
            t.post_recv(4, b, header=True)
            posted.append(b)
            t.send(5, reply, timeout=30)
            continue
        t.post_recv(4, b, header=True)
        posted.append(b)


def raw_server() -> int:
    """Serve one connection with a plain socket: per 96-byte request, a 512-byte reply; no tensorwire at all."""
    import socket

    conn = _accept_one()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    view = memoryview(bytearray(96))
    reply = bytes(512)
    while True:
        got = 0
        while got < 96:
            n = conn.recv_into(view[got:], 96 - got)
            if n == 0:
                return 0
            got += n
        conn.sendall(reply)


class RawFloor:
    """A :func:`raw_server` process and a client of it: the request/reply of a shared-memory operation
    through a plain socket, the floor of any Python server on the machine (its kernel and interpreter)."""

    def __init__(self) -> None:
        import socket

        self.label = "plain socket"
        self.proc, port = _start_server("--raw-server", "plain-socket")
        self.pid = self.proc.pid
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.req = bytes(96)
        self.view = memoryview(bytearray(512))
        self.clients: dict[str, Any] = {}

    def _exchange(self) -> None:
        self.sock.sendall(self.req)
        got = 0
        while got < 512:
            n = self.sock.recv_into(self.view[got:], 512 - got)
            if n == 0:
                raise ConnectionError("the plain-socket server closed the connection")
            got += n

    def cells(self, sizes: list[str]) -> list["Cell"]:
        return [Cell("floor", "request+reply, plain socket", sizes[0], self._exchange)]

    def stop(self) -> None:
        self.sock.close()
        _stop_server(self.proc)


class Floor:
    """A :func:`floor_server` process of one tree and a client of it; ``calls`` like make_cells'."""

    def __init__(self, pythonpath: str) -> None:
        import socket

        import torch

        from tensorwire.transport._socket import tune_socket
        from tensorwire.transport.tcp import TcpTransport

        self.label = "transport only"
        self.proc, port = _start_server("--floor-server", "transport-floor", dict(os.environ, PYTHONPATH=pythonpath))
        self.pid = self.proc.pid
        sock = socket.create_connection(("127.0.0.1", port))
        tune_socket(sock, peer_timeout=30.0)
        self.t = TcpTransport(sock)
        self.req = torch.zeros(96, dtype=torch.uint8)
        self.reply = torch.zeros(512, dtype=torch.uint8)
        self.data = torch.zeros(max(SIZES_BYTES.values()), dtype=torch.uint8)
        self.clients: dict[str, Any] = {}

    def _ask(self, code: int, n: int) -> None:
        import struct

        struct.pack_into("<BQ", self.req.numpy(), 0, code, n)
        self.t.send(4, self.req, timeout=30)

    def cells(self, sizes: list[str]) -> list["Cell"]:
        t = self.t

        def get(n: int) -> None:
            t.post_recv(5, self.reply)
            t.post_recv(1, self.data[:n])
            self._ask(1, n)
            t.wait_recv(5, timeout=30)
            t.wait_recv(1, timeout=30)

        def put(n: int) -> None:
            t.post_recv(5, self.reply)
            self._ask(2, n)
            t.wait_recv(5, timeout=30)
            t.post_recv(5, self.reply)
            t.send(2, self.data[:n], timeout=30)
            t.wait_recv(5, timeout=30)

        def exchange(n: int) -> None:
            t.post_recv(5, self.reply)
            self._ask(3, 0)
            t.wait_recv(5, timeout=30)

        fns = {"get": get, "put": put, "request+reply": exchange}
        out = []
        for size in sizes:
            for kind in FLOOR_OPS:
                if kind == "request+reply" and size != sizes[0]:
                    continue
                n = SIZES_BYTES[size]
                out.append(Cell("floor", kind, size, lambda f=fns[kind], n=n: f(n)))
        return out

    def stop(self) -> None:
        try:
            self._ask(0, 0)
        except Exception:  # noqa: BLE001 - gone already
            pass
        self.t.close()
        _stop_server(self.proc)


# -- the daemon's own code: the real request loop and handler over a do-nothing transport ------------------------


def own_code(calls: int) -> dict[str, float]:
    """CPU µs per request of a session's request loop (this tree's Session and DataRequests, in this process)
    answering requests from a transport that moves nothing: what the daemon's own code costs, without the
    transport, the kernel or a client (small tensors over the connection, as the TCP cells)."""
    from tensorwire.errors import ClosedError, TransferTimeout
    from tensorwire.serve.daemon.config import ServeConfig
    from tensorwire.serve.daemon.datapath import DataRequests
    from tensorwire.serve.daemon.server import Server
    from tensorwire.serve.daemon.session import Session
    from tensorwire.serve.protocol import wire
    from tensorwire.spec import DTYPE_CODES, TensorSpec
    from tensorwire.transport.base import Received

    class Null:
        """Hands out the same request again and again; sends nothing (reads a GO's step for the payload)."""

        kind = "tcp"
        async_send = False

        def __init__(self, raw: bytes, n: int, writes: bool) -> None:
            self.raw, self.n, self.i, self.writes = raw, n, 0, writes
            self.posted: list[Any] = []
            self.up = (0, 0)

        def post_recv(self, tag: int, buf: Any, *, header: bool = False) -> None:
            if tag == 4:
                self.posted.append(buf)

        def wait_recv(self, tag: int, *, timeout: float | None) -> Any:
            if tag == 3:
                raise TransferTimeout("nothing")
            if tag == 2:
                return Received(self.up[0], None, self.up[1])
            if self.i >= self.n:
                raise ClosedError("done")
            buf = self.posted.pop(0)
            memoryview(buf.numpy())[: len(self.raw)] = self.raw
            self.i += 1
            return Received(len(self.raw), None, self.i)

        def send(self, tag: int, buf: Any, *, step: Any = None, shape: Any = None, timeout: Any = None) -> None:
            if tag == 5 and self.writes:
                rep = wire.parse_reply(memoryview(buf if isinstance(buf, memoryview) else buf.numpy()))
                if rep.status == wire.GO:
                    self.up = (rep.nbytes, rep.step)

        def forget_buffer(self, buf: Any) -> None:
            pass

        def abort(self) -> None:
            pass

        def describe(self) -> str:
            return "nothing"

    class NoListener:
        kind = "tcp"

        def expect(self, nonce: bytes) -> None:
            pass

        def forget(self, nonce: bytes) -> None:
            pass

        def accept(self, nonce: bytes, *, timeout: Any) -> Any:
            time.sleep(3600)  # the session's worker waits here; the loop below runs in this thread

    def request(op: int, name: str, nindex: int = 0, **kw: Any) -> bytes:
        buf = bytearray(1 << 16)
        end = wire.pack_request(memoryview(buf), op=op, req_id=1, name=name.encode(), nindex=nindex, **kw)
        buf[end : end + 8 * nindex] = b"".join(i.to_bytes(8, "little") for i in range(nindex))
        return bytes(buf[: end + 8 * nindex])

    srv = Server(ServeConfig(port=0, transport="tcp", max_bytes=1 << 30, shm=False)).start()
    try:
        svc = srv.service
        whole, (rows, width, n) = SIZES["small"]
        for name, shape in (("t", whole), ("rows", (rows, width))):
            svc.store.restore(TensorSpec(name, shape, "float32"), 1, lambda raw: raw.zero_())
        f32 = DTYPE_CODES["float32"]
        reqs = {
            "get": request(wire.OP_GET, "t"),
            "put": request(wire.OP_PUT, "t", dtype=f32, shape=whole),
            "get_rows": request(wire.OP_GET_ROWS, "rows", nindex=n),
            "add_rows": request(wire.OP_ADD_ROWS, "rows", nindex=n, dtype=f32, shape=(n, width)),
        }
        out = {}
        for kind, raw in reqs.items():
            s = Session(
                "0" * 32,
                b"0" * 16,
                NoListener(),  # type: ignore[arg-type]
                connect_timeout=1.0,
                metrics=svc.metrics,
                on_close=lambda _s: None,
                handler=DataRequests(svc),
                store=svc.store,
            )
            s.transport = Null(raw, calls, kind in ("put", "add_rows"))  # type: ignore[assignment]
            c0 = time.thread_time()
            s._request_loop()
            c1 = time.thread_time()
            if s.closed:
                raise SystemExit(f"{kind}: the session closed: {s.close_reason}")
            out[kind] = (c1 - c0) / calls * 1e6
        return out
    finally:
        srv.stop(0)


def own_code_of(tree: str, calls: int) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=tree)
    res = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--own-code", str(calls)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        check=True,
        cwd=tempfile.gettempdir(),
    )
    return json.loads(res.stdout.strip().splitlines()[-1])


# -- driving a daemon ------------------------------------------------------------------------------------------


class Daemon:
    """A ``tensorwire serve`` process of one tree (``pythonpath``), with one client per path."""

    def __init__(self, label: str, pythonpath: str, *, profile: str = "") -> None:
        self.label = label
        self.profile = profile
        env = dict(os.environ, PYTHONPATH=pythonpath)
        env.pop("TENSORWIRE_SHM_LEASES", None)
        serve = ["--log-level", "WARNING", "serve", "--port", "0", "--transport", "tcp", "--max-bytes", "4GiB"]
        if profile:
            cmd = [sys.executable, os.path.abspath(__file__), "--profiled-daemon", profile, "--", *serve]
        else:
            cmd = [sys.executable, "-m", "tensorwire", *serve]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=env, cwd=tempfile.gettempdir()
        )
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if not line:
            self.proc.kill()
            raise SystemExit(f"the {label} daemon did not start: {' '.join(cmd)}")
        self.info = json.loads(line)
        self.pid = self.proc.pid
        self.address = f"127.0.0.1:{self.info['port']}"
        self.clients: dict[str, Any] = {}

    def connect(self, paths: list[str]) -> None:
        import tensorwire as tw
        from tensorwire.serve.client.client import LEASES_ENV

        os.environ[LEASES_ENV] = "0"  # every shared-memory read is a request to the daemon
        try:
            for p in paths:
                c = tw.Client(self.address, transport=p, timeout=60)
                if c.data_path != p:
                    raise SystemExit(f"{self.label}: asked for {p}, the client uses {c.data_path}")
                self.clients[p] = c
        finally:
            os.environ.pop(LEASES_ENV, None)

    def close_clients(self) -> None:
        for c in self.clients.values():
            c.close()
        self.clients.clear()

    def stop(self) -> None:
        self.close_clients()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout:
            self.proc.stdout.close()


class Cell:
    """One (path, kind, size): its call, and what was measured."""

    def __init__(self, path: str, kind: str, size: str, call: Callable[[], Any]) -> None:
        self.path, self.kind, self.size, self.call = path, kind, size, call
        self.cpu_ns = 0
        self.sys_s = 0.0  # of it, in the kernel (clock ticks: coarse)
        self.wall_s = 0.0
        self.calls = 0
        self.requests = 0


def make_cells(d: Daemon, paths: list[str], kinds: list[str], sizes: list[str]) -> list[Cell]:
    """Declare and fill each path's tensors in ``d`` and return the calls (one tensor per path, kind and size)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    cells = []
    for p in paths:
        c = d.clients[p]
        for size in sizes:
            whole, (rows, width, n) = SIZES[size]
            for kind in kinds:
                name = f"{p}-{kind}-{size}"
                if kind in ("get", "put"):
                    t = torch.randn(whole, generator=gen)
                    c.put(name, t)
                    out = torch.empty_like(t)
                    if kind == "get":
                        assert torch.equal(c.get(name, out=out), t)
                        call = lambda c=c, name=name, out=out: c.get(name, out=out)  # noqa: E731
                    else:
                        call = lambda c=c, name=name, t=t: c.put(name, t)  # noqa: E731
                else:
                    table = torch.randn(rows, width, generator=gen)
                    c.put(name, table)
                    idxs = [torch.randint(0, rows, (n,), generator=gen) for _ in range(16)]
                    it = iter(range(1 << 62))
                    if kind == "get_rows":
                        out = torch.empty(n, width)
                        assert torch.equal(c.get_rows(name, idxs[0], out=out), table[idxs[0]])
                        call = lambda c=c, name=name, idxs=idxs, it=it, out=out: c.get_rows(  # noqa: E731
                            name, idxs[next(it) % 16], out=out
                        )
                    else:
                        vals = torch.full((n, width), 1e-3)
                        call = lambda c=c, name=name, idxs=idxs, it=it, vals=vals: c.add_rows(  # noqa: E731
                            name, idxs[next(it) % 16], vals
                        )
                cells.append(Cell(p, kind, size, call))
    return cells


def requests_sent(client: Any) -> int:
    """Data-plane requests ``client`` has sent on its session so far (its request counter; 0: none to read)."""
    if client is None:
        return 0
    path = getattr(client, "_path", None)  # the client's path object, which numbers its requests
    n = getattr(path, "req_id", None)
    if n is None:
        n = getattr(client, "_req_id", 0)  # a client of before the path objects
    return int(n)


def measure(daemons: "list[Any]", cells: dict[str, list[Cell]], calls: int, rounds: int, warmup: int) -> None:
    """``calls`` calls of every cell of every daemon, in ``rounds`` turns; accumulates CPU time and wall time."""
    for d in daemons:
        for cell in cells[d.label]:
            for _ in range(warmup):
                cell.call()
    per = [calls // rounds + (1 if r < calls % rounds else 0) for r in range(rounds)]
    for r in range(rounds):
        for d in daemons:
            for cell in cells[d.label]:
                client = d.clients.get(cell.path)
                req0 = requests_sent(client)
                k0 = cpu_ticks_s(d.pid)[1]
                c0 = cpu_ns(d.pid)
                t0 = time.perf_counter()
                for _ in range(per[r]):
                    cell.call()
                t1 = time.perf_counter()
                c1 = cpu_ns(d.pid)
                cell.sys_s += cpu_ticks_s(d.pid)[1] - k0
                cell.cpu_ns += c1 - c0
                cell.wall_s += t1 - t0
                cell.calls += per[r]
                cell.requests += requests_sent(client) - req0 if client is not None else per[r]


def idle_rate(d: Daemon, seconds: float = 1.0) -> float:
    """The daemon's CPU seconds per second while nobody asks it anything."""
    c0, t0 = cpu_ns(d.pid), time.perf_counter()
    time.sleep(seconds)
    return (cpu_ns(d.pid) - c0) / 1e9 / (time.perf_counter() - t0)


def profile_table(prefix: str, ops: int, top: int) -> str:
    """The top ``top`` functions by own time over every stats file ``prefix.*``, in µs per operation."""
    files = sorted(f for f in os.listdir(os.path.dirname(prefix)) if f.startswith(os.path.basename(prefix) + "."))
    files = [os.path.join(os.path.dirname(prefix), f) for f in files if not f.endswith(".tmp")]
    if not files:
        return "(no profile was written)\n"
    st = pstats.Stats(*files, stream=io.StringIO())
    total = sum(v[2] for v in st.stats.values())  # type: ignore[attr-defined]
    rows = sorted(st.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]  # type: ignore[attr-defined]
    out = [
        f"{ops} operations (every kind and size, set-up and warm-up included): the thread's CPU time "
        f"{total / ops * 1e6:.1f} µs per operation under cProfile (its timer: the thread's CPU time)\n",
        "| own µs/op | cum µs/op | calls/op | function |",
        "| ---: | ---: | ---: | --- |",
    ]
    for (fname, line, func), (_cc, nc, tt, ct, _callers) in rows:
        where = fname
        for marker in ("/tensorwire/", "/site-packages/", "/lib/python"):
            if marker in fname:
                where = fname[fname.index(marker) + 1 :]
                break
        if where.startswith("~"):
            where = "(builtin)"
        out.append(f"| {tt / ops * 1e6:.2f} | {ct / ops * 1e6:.2f} | {nc / ops:.2f} | `{func}` {where}:{line} |")
    return "\n".join(out) + "\n"


def pyspy_table(raw: str, ops: int, rate: int, top: int) -> str:
    """The top ``top`` functions of py-spy's raw samples (``stack count`` lines), in µs of CPU per operation."""
    import re

    own: dict[str, int] = {}
    inc: dict[str, int] = {}
    total = 0
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack or not n.isdigit():
            continue
        count = int(n)
        total += count
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        for f in set(frames):
            inc[f] = inc.get(f, 0) + count
        own[frames[-1]] = own.get(frames[-1], 0) + count
    per = 1e6 / rate / max(1, ops)
    out = [
        f"{ops} operations, {total} samples at {rate} Hz of the daemon's threads holding the GIL: "
        f"{total * per:.1f} µs of CPU per operation\n",
        "| own µs/op | incl. µs/op | function |",
        "| ---: | ---: | --- |",
    ]
    for f, n in sorted(own.items(), key=lambda kv: kv[1], reverse=True)[:top]:
        out.append(f"| {n * per:.1f} | {inc[f] * per:.1f} | `{_short(f)}` |")
    return "\n".join(out) + "\n"


def perf_cell(pid: int, cell: "Cell", calls: int, tmp: str) -> "tuple[float, dict[str, float]] | str":
    """Drive ``calls`` calls of ``cell`` while ``perf record`` samples process ``pid``: (CPU µs per call
    under perf, {class: share}), or why there is nothing."""
    rec = perf_split.Recorder(pid, tmp=tmp)
    if not rec.start():
        return rec.error
    c0 = cpu_ns(pid)
    try:
        for _ in range(calls):
            cell.call()
    finally:
        cpu = (cpu_ns(pid) - c0) / 1e3 / calls
        shares = rec.stop()
    return shares if isinstance(shares, str) else (cpu, shares)


def perf_table(rows: "list[tuple[str, tuple[float, dict[str, float]] | str]]") -> str:
    """The ``--perf`` table: per process and cell, CPU µs per call split by class."""
    lines = perf_split.table(
        ["process: cell", "CPU µs/op under perf"],
        1,
        [
            (name, [name, f"{res[0]:.1f}"], res[0], res[1]) if not isinstance(res, str) else (name, [], 0.0, res)
            for name, res in rows
        ],
    )
    return "\n".join(lines) + "\n"


def _short(frame: str) -> str:
    for marker in ("/tensorwire/", "/site-packages/", "/lib/python3"):
        i = frame.find(marker)
        if i >= 0:
            j = frame.rfind("(", 0, i)
            return frame[: j + 1] + frame[i + 1 :]
    return frame


# -- the run -------------------------------------------------------------------------------------------------------


def profile_one(
    args: argparse.Namespace, label: str, tree: str, path: str, kinds: list[str], sizes: list[str], tmp: str
) -> str:
    """Drive every cell of ``path`` through a daemon of ``tree`` under the profiler; its top functions."""
    prefix = os.path.join(tempfile.mkdtemp(dir=tmp), "req")
    d = Daemon(label, tree, profile=prefix if args.profile == "cprofile" else "")
    spy: subprocess.Popen | None = None
    try:
        d.connect([path])
        cells = {label: make_cells(d, [path], kinds, sizes)}
        measure([d], cells, 0, 1, args.warmup)
        if args.profile == "py-spy":
            raw = prefix + ".txt"
            spy = subprocess.Popen(
                [
                    "py-spy",
                    "record",
                    "--pid",
                    str(d.pid),
                    "--rate",
                    str(args.spy_rate),
                    "--format",
                    "raw",
                    "--output",
                    raw,
                    "--nonblocking",
                    "--gil",
                    "--duration",
                    "600",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(1.0)  # attached
        measure([d], cells, args.profile_calls, 1, 0)
        ops = sum(c.calls for c in cells[label])
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes what it has and exits
            spy.wait(60)
            with open(raw) as f:
                return pyspy_table(f.read(), ops, args.spy_rate, args.top)
        ops += len(cells[label]) * args.warmup
        d.close_clients()  # the session closes: its request thread writes its profile
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not os.path.exists(prefix + ".1"):
            time.sleep(0.05)
        return profile_table(prefix, ops, args.top)
    finally:
        if spy is not None and spy.poll() is None:
            spy.kill()
        d.stop()


def machine() -> str:
    import torch

    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{os.cpu_count()} CPUs ({cpu}), {platform.platform()}, Python {platform.python_version()}, "
        f"torch {torch.__version__}; load average at start {os.getloadavg()[0]:.2f}"
    )


def export_rev(rev: str, into: str) -> str:
    """The ``tensorwire`` package at git revision ``rev`` of this checkout, extracted under ``into``."""
    archive = subprocess.run(
        ["git", "-C", ROOT, "archive", rev, "tensorwire"], check=True, stdout=subprocess.PIPE
    ).stdout
    os.makedirs(into, exist_ok=True)
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)
    return into


def run(args: argparse.Namespace) -> str:
    sys.path.insert(0, ROOT)
    paths = [p for p in args.paths.split(",") if p]
    kinds = [k for k in args.kinds.split(",") if k]
    sizes = [s for s in args.sizes.split(",") if s]
    if args.native and not os.path.isdir(os.path.join(args.native, "tensorwire")):
        raise SystemExit(f"--native {args.native}: no tensorwire package there (make native builds build/native)")
    tmp = tempfile.mkdtemp(prefix="tw-servecpu-")
    trees: list[tuple[str, str]] = []
    if args.baseline_rev:
        base = export_rev(args.baseline_rev, os.path.join(tmp, "baseline"))
        trees.append((f"before ({args.baseline_rev})", base))
    trees.append(("this tree", ROOT))
    if args.native:
        trees.append(("this tree, compiled", os.path.abspath(args.native)))
    lines: list[str] = []
    say = lambda s="": (print(s, flush=True), lines.append(s))  # noqa: E731
    say("# `tensorwire serve`: daemon CPU time per data-plane operation")
    say()
    say(f"Command: `python bench/bench_serve_cpu.py {' '.join(args.argv)}`")
    say()
    say(f"Machine: {machine()}")
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if allowed and len(allowed) < (os.cpu_count() or 0):
        say()
        say(f"Every process of the run (the client, daemons and servers inherit it) may run on CPU(s) {allowed} only.")
    say()
    daemons: list[Daemon] = []
    cells: dict[str, list[Cell]] = {}
    try:
        for label, tree in trees:
            d = Daemon(label, tree)
            daemons.append(d)
            d.connect(paths)
            cells[label] = make_cells(d, paths, kinds, sizes)
        if args.floor and "tcp" in paths:
            floor = Floor(ROOT)
            daemons.append(floor)  # type: ignore[arg-type]
            cells[floor.label] = floor.cells(sizes)
            raw = RawFloor()
            daemons.append(raw)  # type: ignore[arg-type]
            cells[raw.label] = raw.cells(sizes)
        idle = {d.label: idle_rate(d) for d in daemons}
        ticks0 = {d.label: cpu_ticks_s(d.pid) for d in daemons}
        ns0 = {d.label: cpu_ns(d.pid) for d in daemons}
        measure(daemons, cells, args.calls, args.rounds, args.warmup)
        check = {
            d.label: (sum(cpu_ticks_s(d.pid)) - sum(ticks0[d.label]), (cpu_ns(d.pid) - ns0[d.label]) / 1e9)
            for d in daemons
        }
        perf_rows: "list[tuple[str, tuple[float, dict[str, float]] | str]]" = []
        if args.perf:
            for d in daemons:
                for cell in cells[d.label]:
                    if cell.size == sizes[0]:
                        name = f"{d.label}: {cell.path} {cell.kind}"
                        perf_rows.append((name, perf_cell(d.pid, cell, args.perf_calls, tmp)))
    finally:
        for d in daemons:
            d.stop()
    say(
        f"{args.calls} calls per cell, in {args.rounds} turns over every cell and daemon, after {args.warmup} "
        "warm-up calls each. Daemon CPU: user + system time of all its threads per call (schedstat); of it "
        "system: kernel time (utime/stime clock ticks of 10 ms: coarse). "
        "Client wall time: per call, for context (moves with the load)."
    )
    say()
    labels = [d.label for d in daemons if d.label not in ("transport only", "plain socket")]
    head = "| path | op | size | requests/op |"
    sep = "| --- | --- | --- | ---: |"
    for lb in labels:
        head += f" daemon CPU µs/op, {lb} | of it system | client wall µs/op, {lb} |"
        sep += " ---: | ---: | ---: |"
    if len(labels) == 2:
        head += " CPU after/before |"
        sep += " ---: |"
    say(head)
    say(sep)
    by_key = {lb: {(c.path, c.kind, c.size): c for c in cells[lb]} for lb in labels}
    for key in by_key[labels[-1]]:
        row = by_key[labels[-1]][key]
        nbytes = 4 << 10 if key[2] == "small" else 256 << 10
        s = f"| {key[0]} | {key[1]} | {key[2]} ({nbytes >> 10} KiB) | {row.requests / max(1, row.calls):.2f} |"
        vals = []
        for lb in labels:
            c = by_key[lb][key]
            cpu = c.cpu_ns / 1e3 / c.calls
            vals.append(cpu)
            s += f" {cpu:.1f} | {c.sys_s * 1e6 / c.calls:.0f} | {c.wall_s / c.calls * 1e6:.1f} |"
        if len(labels) == 2:
            s += f" {vals[1] / vals[0]:.2f} |"
        say(s)
    say()
    if "transport only" in cells:
        say()
        say(
            "The transport's own share: a server process doing only the TcpTransport calls the daemon's request "
            "thread makes for one operation (this tree's transport; request in, reply and bytes out, the request "
            "buffer posted again: before the reply where the daemon does that, so its credit rides on the reply), "
            "driven in the same turns. `request+reply` is the exchange of a shared-memory "
            "operation (no tensor bytes on the connection)."
        )
        say()
        say("| transport calls of | size | server CPU µs/op | of it system | client wall µs/op |")
        say("| --- | --- | ---: | ---: | ---: |")
        for c in cells["transport only"] + cells.get("plain socket", []):
            size = "-" if c.kind.startswith("request+reply") else f"{c.size} ({SIZES_BYTES[c.size] >> 10} KiB)"
            say(
                f"| {c.kind} | {size} | {c.cpu_ns / 1e3 / c.calls:.1f} | {c.sys_s * 1e6 / c.calls:.0f} | "
                f"{c.wall_s / c.calls * 1e6:.1f} |"
            )
        if "plain socket" in cells:
            say()
            say(
                "`request+reply, plain socket`: the same exchange (96 bytes in, 512 out) served by a Python loop "
                "of `recv_into` and `sendall` on a plain socket, no tensorwire: the floor of any Python server on "
                "this machine (the kernel's wake-ups and the interpreter)."
            )
    say()
    for lb in [*labels, *(lb for lb in ("transport only", "plain socket") if lb in cells)]:
        ticks, ns = check[lb]
        say(
            f"- {lb}: idle CPU {idle[lb] * 1e6:.0f} µs per second; over the measured calls utime+stime "
            f"(/proc/<pid>/stat) {ticks:.2f} s vs schedstat {ns:.2f} s"
        )
    if args.perf:
        say()
        say(
            f"Where each process's CPU goes (`--perf`): {args.perf_calls} calls of each {sizes[0]} cell once more, "
            "`perf record -F 2000` on the server process alone; its CPU per call under perf (the sampling adds "
            "some), split by the shared object each sample fell in. The kernel's share is what any Python "
            "server making the same system calls pays too."
        )
        say()
        say(perf_table(perf_rows))
    if args.own_rounds:
        own: dict[str, list[dict[str, float]]] = {label: [] for label, _ in trees}
        for _ in range(args.own_rounds):
            for label, tree in trees:
                own[label].append(own_code_of(tree, args.own_calls))
        say()
        say(
            f"The daemon's own code: a session's request loop and handler (each tree's, in a process of its own) "
            f"answering {args.own_calls} requests of each kind (small) from a transport that moves nothing; "
            f"CPU µs per request, the best of {args.own_rounds} runs in turns. No transport, kernel or client: "
            "what the cuts in the daemon's code are worth without the noise of a loaded machine (put and add_rows "
            "include the null transport's reading of the GO reply, the same in both)."
        )
        say()
        say(
            "| op | "
            + " | ".join(f"own code µs/request, {lb}" for lb, _ in trees)
            + (" | after/before |" if len(trees) == 2 else " |")
        )
        say("| --- | " + " | ".join("---:" for _ in trees) + (" | ---: |" if len(trees) == 2 else " |"))
        for kind in own[trees[0][0]][0]:
            best = [min(r[kind] for r in own[lb]) for lb, _ in trees]
            say(
                f"| {kind} | "
                + " | ".join(f"{b:.1f}" for b in best)
                + (f" | {best[1] / best[0]:.2f} |" if len(trees) == 2 else " |")
            )
    if args.profile:
        for label, tree in trees:
            for path in paths:
                say()
                say(f"## {args.profile} of the daemon, {path}: {label}")
                say()
                say(profile_one(args, label, tree, path, kinds, sizes, tmp))
    shutil.rmtree(tmp, ignore_errors=True)
    return "\n".join(lines) + "\n"


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--own-code":
        print(json.dumps(own_code(int(sys.argv[2]))), flush=True)
        return 0
    if len(sys.argv) == 2 and sys.argv[1] == "--floor-server":
        return floor_server()
    if len(sys.argv) == 2 and sys.argv[1] == "--raw-server":
        return raw_server()
    if len(sys.argv) > 2 and sys.argv[1] == "--profiled-daemon":
        prefix = sys.argv[2]
        rest = sys.argv[3:]
        if rest and rest[0] == "--":
            rest = rest[1:]
        return profiled_daemon(prefix, rest)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline-rev", default="", help="also run a daemon of the package at this git revision")
    ap.add_argument(
        "--native",
        default="",
        metavar="DIR",
        help="also run a daemon of this tree's compiled build (tensorwire.native), installed in DIR (make native)",
    )
    ap.add_argument("--calls", type=int, default=2000, help="calls per cell (default 2000)")
    ap.add_argument("--rounds", type=int, default=5, help="turns the calls are split into (default 5)")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--sizes", default=",".join(SIZES))
    ap.add_argument(
        "--profile",
        choices=("", "cprofile", "py-spy"),
        default="",
        help="then profile each daemon: py-spy (sampling, every thread) or cProfile (the request thread)",
    )
    ap.add_argument(
        "--perf", action="store_true", help="then split each process's CPU by shared object (kernel, interpreter...)"
    )
    ap.add_argument("--perf-calls", type=int, default=2000, help="calls per cell under perf")
    ap.add_argument("--spy-rate", type=int, default=1000, help="py-spy samples per second")
    ap.add_argument("--profile-calls", type=int, default=500, help="calls per cell under the profiler")
    ap.add_argument("--top", type=int, default=25, help="functions listed per profile")
    ap.add_argument("--own-rounds", type=int, default=3, help="runs of the own-code measurement per tree (0: none)")
    ap.add_argument("--own-calls", type=int, default=5000, help="requests per kind in one own-code run")
    ap.add_argument(
        "--no-floor", dest="floor", action="store_false", help="skip the transport-only server (the TCP floor)"
    )
    ap.add_argument("--out", default="", help="also write the report (markdown) here")
    args = ap.parse_args()
    if args.perf and args.perf_calls < 1:
        ap.error("--perf-calls must be at least 1")
    args.argv = sys.argv[1:]
    text = run(args)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
