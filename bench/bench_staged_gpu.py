#!/usr/bin/env python
"""TCP-staged GPU->GPU through tensorwire against its two bounds, measured side by side in one run.

When the link cannot reach GPU memory (``transport="tcp"``), a CUDA tensor travels
GPU -> pinned host -> socket -> pinned host -> GPU. The fastest such path can go no
faster than the slower of (a) the pinned copy engine and (b) the socket, so the
target is::

    tensorwire-tcp (staged)  >=  0.8 x min(pinned D2H, pinned H2D, raw TCP socket)

For each size (default 16, 64, 256 MiB) this script measures, on this machine:

- **pinned D2H / H2D**: ``copy_`` between a device buffer and a pinned host buffer
  (``cudaMemcpyAsync``), on the sender's GPU (D2H) and the receiver's GPU (H2D), one
  copy at a time, synchronized;
- **raw TCP socket**: two processes on loopback, ``sendall`` from a pinned host buffer,
  ``recv_into`` (``MSG_WAITALL``) a pinned host buffer, a 1-byte ack per message — no
  framing, no GPU: what any socket-based path is bounded by;
- **tensorwire-tcp (staged)**: two processes, a real :class:`tensorwire.Node` each and a
  :class:`tensorwire.Link` with ``transport="tcp"`` per size: ``link.send`` of a CUDA
  tensor on the sender's GPU, ``link.recv`` into the CUDA slot on the receiver's GPU,
  the receiver synchronizes its current stream (the bytes are in GPU memory) and then
  sends a 1-byte ack. Chunked and overlapped (the default staging chunk, or ``--chunk``);
- **tensorwire-tcp unchunked**: the same with ``TENSORWIRE_STAGING_CHUNK=0`` (one message
  per tensor: copy all, then send all, then copy all — the path before chunking).

The socket and both tensorwire rows run in one process pair, in turns (a tenth of each
row's messages, then the next row's, ten times per size), so a drift in the machine's
speed during the run weighs on the bound and on tensorwire alike; ``--separate`` measures
them one after the other in a process pair each (the method before 2026-11-23).

Every figure is ``size / median(time per message)``; each message of the socket and
tensorwire rows is timed from the start of the send to the arrival of its ack (the
same protocol for both). The first and the last message of every tensorwire size are
checked byte for byte on the receiver.

Usage (a CUDA host; one GPU is enough, two use GPU0 -> GPU1)::

    python3 bench/bench_staged_gpu.py --out bench/results/staged_gpu.md
    python3 bench/bench_staged_gpu.py --sizes 16M,64M,256M,1G --out staged.md --json staged.json

Exit status: 2 when CUDA is not available (nothing is measured), 1 when a measurement
failed (or with ``--strict`` when the 0.8 target is missed at some size), else 0.
``--cpu-dry-run`` runs the same processes with CPU tensors and tiny sizes to check the
script itself; its figures are not measurements of anything staged.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import queue
import socket
import statistics
import sys
import time
import traceback
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # the repository (tensorwire) when not installed

TARGET = 0.8
CHUNK_ENV = "TENSORWIRE_STAGING_CHUNK"
CTX = mp.get_context("spawn")
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


def parse_size(text: str) -> int:
    """``16M`` / ``256MiB`` / ``1G`` / ``4096`` -> bytes."""
    t = text.strip().lower()
    digits = t.rstrip("kmgib")
    unit = t[len(digits) :]
    if not digits.isdigit() or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 16M, 256MiB, 1G)")
    return int(digits) * _UNITS[unit]


def fmt_size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def iterations(size: int, args: argparse.Namespace) -> int:
    return max(args.min_iters, min(args.max_iters, args.budget // max(1, size)))


def content(size: int, device: Any, block: int = 16 << 20) -> Any:
    """Deterministic, position-dependent bytes (cheap to make on either side; a shifted, stale or swapped chunk
    shows). Built in blocks, so a 1 GiB message does not need 8 GiB of int64 indices."""
    import torch

    out = torch.empty(size, dtype=torch.uint8, device=device)
    for off in range(0, size, block):
        i = torch.arange(off, min(off + block, size), dtype=torch.int64, device=device)
        out[off : off + i.numel()] = ((i % 251) ^ ((i >> 8) % 253)).to(torch.uint8)
    return out


# -- 1. pinned copies (this process) ----------------------------------------------------------------


def measure_copies(sizes: list[int], args: argparse.Namespace, send_dev: Any, recv_dev: Any) -> dict[int, dict]:
    """Median GB/s of one pinned D2H copy on the sender's GPU and one pinned H2D copy on the receiver's GPU."""
    import torch

    cuda = send_dev.type == "cuda"
    out: dict[int, dict] = {}
    for size in sizes:
        row: dict[str, float] = {}
        for label, dev in (("d2h", send_dev), ("h2d", recv_dev)):
            d = torch.empty(size, dtype=torch.uint8, device=dev)
            h = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
            d.fill_(1)
            h.fill_(1)
            times = []
            for i in range(args.warmup + iterations(size, args)):
                if cuda:
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                if label == "d2h":
                    h.copy_(d, non_blocking=cuda)
                else:
                    d.copy_(h, non_blocking=cuda)
                if cuda:
                    torch.cuda.synchronize(dev)
                if i >= args.warmup:
                    times.append(time.perf_counter() - t0)
            row[label] = size / statistics.median(times) / 1e9
            del d, h
        out[size] = row
    return out


# -- two-process harness -----------------------------------------------------------------------------


def _child(target: Callable[..., dict], rank: int, port: int, q: Any, kwargs: dict) -> None:
    try:
        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=kwargs["args"]["timeout"]))
        q.put(("ok", rank, target(rank=rank, store=store, **kwargs)))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        q.put(("error", rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_pair(target: Callable[..., dict], args: argparse.Namespace, **kwargs: Any) -> dict[int, dict]:
    """``target(rank=, store=, args=, **kwargs)`` in two fresh processes; their results by rank.

    Raises:
        RuntimeError: a rank raised, died, or the pair ran past ``--timeout``.
    """
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=args.timeout), wait_for_workers=False)
    q = CTX.Queue()
    kw = dict(kwargs, args=vars(args))
    procs = [CTX.Process(target=_child, args=(target, r, store.port, q, kw), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    deadline = time.monotonic() + args.timeout
    try:
        while len(results) < 2:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{target.__name__}: no result within {args.timeout:.0f} s")
            try:
                status, rank, value = q.get(timeout=min(1.0, left))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    time.sleep(1.0)  # its last words may still be in the queue
                    if q.empty():
                        raise RuntimeError(
                            f"{target.__name__}: rank {dead[0]} died (exit code {procs[dead[0]].exitcode})"
                        ) from None
                continue
            if status != "ok":
                raise RuntimeError(f"{target.__name__}: rank {rank} failed: {value}")
            results[rank] = value
        return results
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(5)
        q.close()
        del store


def _device(rank: int, args: dict) -> Any:
    import torch

    dev = torch.device(args["send_device"] if rank == 0 else args["recv_device"])
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


# -- 2. raw TCP socket -------------------------------------------------------------------------------


def _connect(rank: int, store: Any, args: dict) -> socket.socket:
    """A plain TCP connection between the two ranks (rank 1 listens on port 0)."""
    if rank == 1:
        lst = socket.create_server(("127.0.0.1", 0))
        lst.settimeout(args["timeout"])
        store.set("sock/port", str(lst.getsockname()[1]))
        conn, _ = lst.accept()
        lst.close()
    else:
        store.wait(["sock/port"], timedelta(seconds=args["timeout"]))
        conn = socket.create_connection(("127.0.0.1", int(store.get("sock/port").decode())), timeout=args["timeout"])
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.settimeout(args["timeout"])
    return conn


def _socket_message(rank: int, conn: socket.socket, view: memoryview, ack: bytearray) -> None:
    """One message of the socket row: rank 0 sends and waits for the 1-byte ack, rank 1 receives and acks."""
    size = len(view)
    if rank == 0:
        conn.sendall(view)
        if conn.recv_into(ack, 1) != 1:
            raise ConnectionError("receiver closed the connection")
        return
    got = 0
    while got < size:
        k = conn.recv_into(view[got:], size - got, socket.MSG_WAITALL)
        if k == 0:
            raise ConnectionError("sender closed the connection mid-message")
        got += k
    conn.sendall(b"\x01")


# -- 3. tensorwire over a TCP link, and the rows together ---------------------------------------------

#: Turns per size when rows share a process pair: each row sends about 1/ROUNDS of its messages per turn.
ROUNDS = 10
ROWS = ("socket", "staged", "unchunked")


def _set_chunk(chunk: str | None) -> None:
    if chunk is None:
        os.environ.pop(CHUNK_ENV, None)
    else:
        os.environ[CHUNK_ENV] = chunk  # read by each Link when it is made; both ranks set the same value


def rows_pair(
    rank: int, store: Any, args: dict, sizes: list[int], chunk: str | None, rows: tuple[str, ...] = ROWS
) -> dict:
    """The ``rows`` (of :data:`ROWS`) in one process pair; with more than one, taken in turns: a few messages of
    each row, then the next row, ROUNDS times per size, so a host whose socket speed drifts (a shared machine,
    another job) weighs on the bound and on tensorwire alike.

    - socket: rank 0 ``sendall``s from a pinned host buffer, rank 1 ``recv_into``s and acks one byte;
    - staged / unchunked: one Link per size and row (``transport="tcp"``; unchunked with
      ``TENSORWIRE_STAGING_CHUNK=0``): rank 0 sends a CUDA tensor, rank 1 receives into its CUDA slot,
      synchronizes its current stream and acks; the first and the last message are checked byte for byte.

    Returns (rank 0) ``{row: {str(size): {"gbps", "iters", ...}}}``.
    """
    import torch

    ns = argparse.Namespace(**args)
    dev = _device(rank, args)
    cuda = dev.type == "cuda"
    links_wanted = [(row, chunk if row == "staged" else "0") for row in rows if row != "socket"]
    conn = _connect(rank, store, args) if "socket" in rows else None
    node = None
    if links_wanted:
        import tensorwire as tw

        node = tw.Node(
            rank=rank,
            world_size=2,
            store=store,
            transport="tcp",
            timeout=min(120.0, args["timeout"]),
            prefix="bench-staged/",
            device=dev if cuda else None,
        )
    out: dict[str, dict] = {k: {} for k in rows}
    ackbuf = bytearray(1)
    one = torch.ones(1, dtype=torch.uint8)
    try:
        for size in sizes:
            links = {}
            want = None
            if node is not None:
                data = tw.TensorSpec("data", (size,), "uint8", dev.type)
                ack = tw.TensorSpec("ack", (1,), "uint8", "cpu")
                want = content(size, dev)
                for row, ch in links_wanted:
                    _set_chunk(ch)
                    if rank == 0:
                        links[row] = node.link(1, send=[data], recv=[ack], name=f"{row}{size}")
                    else:
                        links[row] = node.link(0, send=[ack], recv=[data], name=f"{row}{size}")
                _set_chunk(chunk)
            view = None
            if conn is not None:
                buf = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
                buf.fill_(7)
                view = memoryview(buf.numpy())
            n = iterations(size, ns)
            times: dict[str, list[float]] = {k: [] for k in rows}
            got: dict[str, Any] = {}
            bad: list[str] = []

            def message(row: str, timed: bool, first: bool) -> None:
                if rank == 0 and cuda:
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                if row == "socket":
                    _socket_message(rank, conn, view, ackbuf)
                elif rank == 0:
                    links[row].send("data", want)
                    links[row].recv("ack")
                else:
                    got[row] = links[row].recv("data")
                    if cuda:
                        torch.cuda.current_stream(dev).synchronize()  # the bytes are in GPU memory
                    if first and not torch.equal(got[row], want):
                        bad.append(f"{row}: first message")
                    links[row].send("ack", one)
                if timed and rank == 0:
                    times[row].append(time.perf_counter() - t0)

            for row in rows:
                for i in range(args["warmup"]):
                    message(row, False, i == 0)
            per = max(1, -(-n // ROUNDS)) if len(rows) > 1 else n
            done = 0
            while done < n:
                k = min(per, n - done)
                for row in rows:
                    for _ in range(k):
                        message(row, True, False)
                done += k
            if links:
                if rank == 1:
                    for row in links:
                        if not torch.equal(got[row], want):  # the last message (its slot stays valid: no recv after it)
                            bad.append(f"{row}: last message")
                    store.wait([f"rows/done/{size}"], timedelta(seconds=args["timeout"]))
                else:
                    store.set(f"rows/done/{size}", "1")  # the receiver closes the links after we are done
            for row, link in links.items():
                if rank == 0:
                    plan = link.staging_plan("data")
                    out[row][str(size)] = {
                        "gbps": size / statistics.median(times[row]) / 1e9,
                        "iters": len(times[row]),
                        "chunks": len(plan) if plan else None,
                        "transport": link.transport,
                    }
                link.close()
            if rank == 0 and conn is not None:
                out["socket"][str(size)] = {
                    "gbps": size / statistics.median(times["socket"]) / 1e9,
                    "iters": len(times["socket"]),
                }
            if bad:
                raise AssertionError(f"{fmt_size(size)}: wrong bytes in {', '.join(bad)}")
    finally:
        if node is not None:
            node.close()
        if conn is not None:
            conn.close()
    return out


# -- report -----------------------------------------------------------------------------------------


def environment(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpus": os.cpu_count(),
        "host": platform.node(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if not args.cpu_dry_run:
        env["send_gpu"] = torch.cuda.get_device_name(torch.device(args.send_device))
        env["recv_gpu"] = torch.cuda.get_device_name(torch.device(args.recv_device))
    try:
        env["loadavg"] = os.getloadavg()[0]
    except OSError:
        pass
    return env


def report(res: dict[str, Any], args: argparse.Namespace) -> tuple[str, bool]:
    """The markdown page, and whether every size met the target."""
    from tensorwire.p2p.staging import DEFAULT_CHUNK, MAX_STAGING_CHUNKS

    env = res["environment"]
    chunk_label = args.chunk or f"default ({DEFAULT_CHUNK >> 20} MiB, at most {MAX_STAGING_CHUNKS} chunks)"
    title = "TCP-staged GPU->GPU: tensorwire vs. pinned copies and a raw socket"
    if args.cpu_dry_run:
        title += " (CPU DRY RUN: not a measurement)"
    lines = [
        f"# {title}",
        "",
        f"{env.get('send_gpu', 'cpu')} ({args.send_device}) -> {env.get('recv_gpu', 'cpu')} ({args.recv_device}), "
        f"two processes on loopback; torch {env['torch']}, CUDA {env['cuda']}, Python {env['python']}, "
        f"{env['cpus']} CPUs, load {env.get('loadavg', '?')}, {env['date']}. Staging chunk: {chunk_label}. "
        f"Medians of up to {args.max_iters} messages per size after {args.warmup} warm-up, 1-byte ack per "
        f"message (socket and tensorwire alike); the tensorwire receiver synchronizes its stream before "
        f"acking. "
        + (
            "Socket, staged and unchunked rows each in their own process pair, one after the other. "
            if args.separate
            else f"Socket, staged and unchunked rows measured in one process pair, in turns ({ROUNDS} turns per "
            f"size, a tenth of each row's messages per turn): drift in the machine's speed weighs on all "
            f"three alike. "
        )
        + f"Command: `{' '.join([os.path.basename(sys.executable)] + sys.argv)}`.",
        "",
        "| size | pinned D2H | pinned H2D | raw TCP socket | bound = min | tensorwire-tcp staged (chunks) "
        "| staged / bound | unchunked | unchunked / bound | target >= 0.8 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |",
    ]
    met_all = True
    for size in args.sizes:
        k = str(size)
        cp = res["copies"].get(k, {})
        sock = res["socket"].get(k, {}).get("gbps")
        st = res["staged"].get(k, {})
        un = res["unchunked"].get(k, {}).get("gbps")
        parts = [cp.get("d2h"), cp.get("h2d"), sock]
        bound = min(parts) if all(p is not None for p in parts) else None
        ratio = st.get("gbps") / bound if bound and st.get("gbps") else None
        uratio = un / bound if bound and un else None
        met = ratio is not None and ratio >= TARGET
        met_all &= met

        def f(x: float | None, unit: str = " GB/s") -> str:
            return "–" if x is None else f"{x:.2f}{unit}"

        chunks = st.get("chunks")
        lines.append(
            f"| {fmt_size(size)} | {f(cp.get('d2h'))} | {f(cp.get('h2d'))} | {f(sock)} | {f(bound)} | "
            f"{f(st.get('gbps'))} ({chunks if chunks else '–'}) | {f(ratio, 'x')} | {f(un)} | "
            f"{f(uratio, 'x')} | {'met' if met else 'MISSED'} |"
        )
    lines += [
        "",
        f"staged / min(pinned copy, socket) against the {TARGET}x target: "
        f"{'met at every size' if met_all else 'missed at some size'}.",
    ]
    if res.get("errors"):
        lines += ["", "Failures:", ""] + [f"- {e}" for e in res["errors"]]
    return "\n".join(lines) + "\n", met_all


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="16M,64M,256M", help="comma-separated sizes (default 16M,64M,256M)")
    p.add_argument("--chunk", default=None, help="staging chunk for the chunked row (default: tensorwire's)")
    p.add_argument("--send-device", default=None, help="sender GPU (default cuda:0)")
    p.add_argument("--recv-device", default=None, help="receiver GPU (default cuda:1 if there are two, else cuda:0)")
    p.add_argument(
        "--budget",
        type=parse_size,
        default=parse_size("2G"),
        help="bytes per size and row: sets the message count (default 2G)",
    )
    p.add_argument("--min-iters", type=int, default=5)
    p.add_argument("--max-iters", type=int, default=100)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per process pair (default 300)")
    p.add_argument("--out", default=None, help="write the markdown table here")
    p.add_argument("--json", default=None, help="write every figure here (JSON)")
    p.add_argument("--strict", action="store_true", help="exit 1 when the target is missed")
    p.add_argument(
        "--separate",
        action="store_true",
        help="measure the socket, staged and unchunked rows one after the other, each in its own "
        "process pair (default: in turns, in one pair)",
    )
    p.add_argument("--cpu-dry-run", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if args.chunk is not None:
        from tensorwire.errors import ConfigError
        from tensorwire.p2p.staging import staging_chunk

        try:
            staging_chunk({CHUNK_ENV: args.chunk})  # validate here, not in the child processes
        except ConfigError as exc:
            p.error(f"--chunk: {exc}")
    try:
        import torch
    except ImportError as exc:
        print(
            f"bench_staged_gpu: torch is not importable ({exc}); this benchmark needs PyTorch with CUDA",
            file=sys.stderr,
        )
        return 2
    if args.cpu_dry_run:
        args.send_device = args.recv_device = "cpu"
    else:
        if not torch.cuda.is_available():
            print(
                f"bench_staged_gpu: CUDA is not available (torch {torch.__version__}, built for CUDA "
                f"{torch.version.cuda}): this benchmark measures GPU memory staged through pinned host "
                f"memory and needs a CUDA GPU. Nothing was measured.",
                file=sys.stderr,
            )
            return 2
        n = torch.cuda.device_count()
        args.send_device = args.send_device or "cuda:0"
        args.recv_device = args.recv_device or ("cuda:1" if n > 1 else "cuda:0")
    res: dict[str, Any] = {
        "environment": environment(args),
        "copies": {},
        "socket": {},
        "staged": {},
        "unchunked": {},
        "errors": [],
    }
    steps: list[tuple[str, Callable[[], Any]]] = [
        (
            "copies",
            lambda: {
                str(k): v
                for k, v in measure_copies(
                    args.sizes, args, torch.device(args.send_device), torch.device(args.recv_device)
                ).items()
            },
        ),
    ]
    groups = [(row,) for row in ROWS] if args.separate else [ROWS]
    for rows in groups:
        steps.append(
            (
                "+".join(rows),
                lambda rows=rows: run_pair(rows_pair, args, sizes=args.sizes, chunk=args.chunk, rows=rows)[0],
            )
        )
    for key, step in steps:
        print(f"bench_staged_gpu: {key} ...", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        try:
            got = step()
            res.update(got if key != "copies" else {"copies": got})
        except Exception as exc:  # noqa: BLE001 - one failed row must not lose the others
            res["errors"].append(f"{key}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")
            print(f"bench_staged_gpu: {key} FAILED: {exc}", file=sys.stderr, flush=True)
        print(f"bench_staged_gpu: {key} done in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    text, met = report(res, args)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {k: v for k, v in vars(args).items()}, **res}, indent=2))
    if res["errors"]:
        return 1
    return 1 if (args.strict and not met) else 0


if __name__ == "__main__":
    sys.exit(main())
