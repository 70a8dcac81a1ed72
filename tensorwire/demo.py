"""``tensorwire demo``: the main job on an embedded default, no cluster needed.

Starts two worker processes on this machine (loopback), negotiates a link
between them from a default pipeline-stage layout (activations forward,
gradients back, plus a weight broadcast), runs a number of steps moving those
tensors through tensorwire, checks every received byte, and then moves the
same bytes through gRPC (unary calls, limits raised) for comparison. Prints
progress, a per-tensor table and the speed-up.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import sys
import time
from datetime import timedelta
from typing import Any

__all__ = ["register", "run_demo"]

#: name -> (shape, dtype, direction) ; "fwd" goes 0 -> 1, "bwd" goes 1 -> 0.
DEFAULT_LAYOUT: dict[str, tuple[tuple[int, ...], str, str]] = {
    "output.0": ((64, 1024), "float32", "fwd"),  # activations of a 1024-wide stage, batch 64 (256 KiB)
    "grad.output.0": ((64, 1024), "float32", "bwd"),
    "param.weight": ((2048, 2048), "float32", "fwd"),  # 16 MiB weight broadcast
}


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="run a two-process exchange on this machine (no cluster) and compare with gRPC")
    p.add_argument("--steps", type=int, default=50, help="steps to run (default 50)")
    p.add_argument("--transport", default="auto", choices=("auto", "ucx", "tcp"))
    p.add_argument("--no-grpc", action="store_true", help="skip the gRPC comparison")
    p.add_argument("--timeout", type=float, default=120.0, help="overall timeout in seconds")
    p.set_defaults(func=lambda a: run_demo(steps=a.steps, transport=a.transport, grpc=not a.no_grpc,
                                           timeout=a.timeout))


def _salt(name: str) -> int:
    import zlib

    return zlib.crc32(name.encode()) % 97  # stable across processes, unlike hash()


def _tensor(shape: tuple[int, ...], dtype: str, step: int, salt: int, out: Any = None) -> Any:
    import torch

    t = torch.empty(shape, dtype=getattr(torch, dtype)) if out is None else out
    t.fill_(float(step * 7 + salt))
    return t


def _worker(rank: int, port: int, steps: int, transport: str, q: Any) -> None:
    try:
        from torch.distributed import TCPStore

        import tensorwire as tw

        store = TCPStore("127.0.0.1", port, 1, False, timedelta(seconds=60))
        specs = {n: tw.TensorSpec(n, s, d) for n, (s, d, _) in DEFAULT_LAYOUT.items()}
        fwd = [specs[n] for n, v in DEFAULT_LAYOUT.items() if v[2] == "fwd"]
        bwd = [specs[n] for n, v in DEFAULT_LAYOUT.items() if v[2] == "bwd"]
        with tw.Node(rank=rank, world_size=2, store=store, transport=transport) as node:
            link = node.link(1 - rank, send=fwd if rank == 0 else bwd, recv=bwd if rank == 0 else fwd)
            mine = fwd if rank == 0 else bwd
            theirs = bwd if rank == 0 else fwd
            bad = 0
            moved = 0
            t_busy = 0.0
            src = {s.name: _tensor(s.shape, s.dtype, 0, 0) for s in mine}
            for step in range(steps):
                for s in mine:  # the "model" writes its outputs (not timed)
                    _tensor(s.shape, s.dtype, step, _salt(s.name), out=src[s.name])
                t0 = time.perf_counter()
                for s in mine:
                    link.send(s.name, src[s.name])
                got = {s.name: link.recv(s.name) for s in theirs}
                t_busy += time.perf_counter() - t0
                for s in theirs:  # check every byte (not timed)
                    if not bool((got[s.name] == float(step * 7 + _salt(s.name))).all()):
                        bad += 1
                moved += sum(s.nbytes for s in mine + theirs)
                if rank == 0:
                    q.put(("progress", step + 1, None))
            q.put(("done", rank, {"transport": link.transport, "bad": bad, "seconds": t_busy, "bytes": moved}))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        q.put(("error", rank, f"{type(exc).__name__}: {exc}"))


def _grpc_baseline(steps: int) -> float:
    """Seconds to move the same bytes as the demo through gRPC unary calls (server in a child)."""
    from concurrent import futures

    import grpc
    import numpy as np

    opts = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]

    def echo_small(req: bytes, ctx: Any) -> bytes:
        # the receiver materialises a tensor from the bytes, as a real gRPC tensor service would
        np.frombuffer(req, dtype=np.uint8).copy()
        return reply

    sizes = {n: _nbytes(s, d) for n, (s, d, _) in DEFAULT_LAYOUT.items()}
    bwd = sum(v for n, v in sizes.items() if DEFAULT_LAYOUT[n][2] == "bwd")
    reply = b"\0" * bwd
    server = grpc.server(futures.ThreadPoolExecutor(2), options=opts)
    handler = grpc.method_handlers_generic_handler("demo.Exchange", {"Step": grpc.unary_unary_rpc_method_handler(echo_small)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=opts) as ch:
            call = ch.unary_unary("/demo.Exchange/Step")
            fwd_tensors = [_tensor(s, d, 0, 1).numpy() for n, (s, d, w) in DEFAULT_LAYOUT.items() if w == "fwd"]
            t0 = time.perf_counter()
            for _ in range(steps):
                payload = b"".join(a.tobytes() for a in fwd_tensors)
                out = call(payload, timeout=60)
                np.frombuffer(out, dtype=np.uint8).copy()
            return time.perf_counter() - t0
    finally:
        server.stop(0)


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    import math

    return math.prod(shape) * {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}.get(dtype, 4)


def run_demo(*, steps: int = 50, transport: str = "auto", grpc: bool = True, timeout: float = 120.0) -> int:
    from torch.distributed import TCPStore

    if steps < 1:
        print("tensorwire demo: --steps must be >= 1", file=sys.stderr)
        return 2
    out = sys.stdout
    print(f"tensorwire demo: 2 workers on loopback, transport={transport}, {steps} steps", file=out)
    for n, (s, d, w) in DEFAULT_LAYOUT.items():
        print(f"  {n:<16} {d}{list(s)}  {'rank 0 -> 1' if w == 'fwd' else 'rank 1 -> 0'}", file=out)
    store = TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=60), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, store.port, steps, transport, q), daemon=True) for r in (0, 1)]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < 2:
            try:
                kind, who, payload = q.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                if time.monotonic() > deadline:
                    print("tensorwire demo: timed out", file=sys.stderr)
                    return 1
                if any(p.exitcode not in (None, 0) for p in procs):
                    print("tensorwire demo: a worker died", file=sys.stderr)
                    return 1
                continue
            if kind == "progress":
                if who == steps or who % max(1, steps // 10) == 0:
                    print(f"  step {who}/{steps}", file=sys.stderr, flush=True)
            elif kind == "error":
                print(f"\ntensorwire demo: rank {who} failed: {payload}", file=sys.stderr)
                return 1
            else:
                results[who] = payload
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    r0 = results[0]
    gbps = r0["bytes"] / r0["seconds"] / 1e9
    bad = r0["bad"] + results[1]["bad"]
    print(f"tensorwire ({r0['transport']}): {r0['bytes'] / 1e6:.1f} MB in {r0['seconds']:.3f} s "
          f"= {gbps:.2f} GB/s, {r0['seconds'] / steps * 1e3:.2f} ms/step, corrupted messages: {bad}", file=out)
    if grpc:
        secs = _grpc_baseline(steps)
        print(f"gRPC (unary bytes): {secs:.3f} s = {r0['bytes'] / secs / 1e9:.2f} GB/s, {secs / steps * 1e3:.2f} ms/step",
              file=out)
        print(f"speed-up of tensorwire over gRPC: {secs / r0['seconds']:.1f}x", file=out)
    return 0 if bad == 0 else 1
