#!/usr/bin/env python
"""The copy-engine path's own Python per message, on CPU: the protocol with every CUDA call made free.

::

    python bench/ce_python_cpu.py [--iters 20000] [--profile]

Two :class:`~tensorwire.transport.ce.CePair` objects in one process, each with its own mapping of one
region (as two ranks of one host have), play a ``send``/``recv`` ping-pong over one tag: each message is
a first side (writes its ready flag) and a second side (copies, writes ``landed``), then each side's
``order_after`` (what ``wait()`` does). The driver is a stand-in whose calls do nothing but write flags
into host memory, so what is timed is the path's Python alone -- the part of a message's host time that
is tensorwire's own and not CUDA's (the GPU figures are in ``bench/results/ce-host_*.md``). With
``--layers``, the backend's layer above the pair (``tensorwire.distributed.copyengine``: the signature,
the Work) is timed too, with a stand-in peer.

Prints microseconds per call of each part (the median call; best of ``--turns`` turns), and with ``--profile`` the
functions that took the most time under cProfile.
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import io
import pstats
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from tensorwire.errors import PeerLostError
from tensorwire.transport.ce import CePair, Region


class FreeDriver:
    """The CeDriver methods a message calls, each doing only what the protocol above it can observe."""

    def context(self, device: Any) -> int:
        return 1

    def capturing(self, stream: int) -> bool:
        return False

    def allocation(self, ptr: int) -> tuple[int, int, int]:
        return ptr & ~0xFFFFF, 1 << 20, 1

    def device_of(self, ptr: int) -> int:
        return -1  # (not the caller's device: the two-GPU rules)

    def export(self, base: int) -> bytes:
        return base.to_bytes(8, "little").ljust(64, b"\0")

    def open(self, handle: bytes) -> int:
        return int.from_bytes(handle[:8], "little")

    def close(self, dptr: int) -> None:
        pass

    def register_host(self, addr: int, nbytes: int) -> int:
        return addr  # (device addresses of the region are its host addresses)

    def unregister_host(self, addr: int) -> None:
        pass

    def flag_kernels(self, device: Any) -> bool:
        return False  # (no kernels here: captured flags fall back to stream memory operations)

    def new_stream(self) -> int:
        return 1

    def new_event(self) -> int:
        return 1

    def order(self, after: int, before: int, event: int) -> None:
        pass

    def copy(self, stream: int, dst: int, src: int, nbytes: int) -> None:
        pass

    def write(self, stream: int, addr: int, value: int) -> None:
        ctypes.c_uint32.from_address(addr).value = value & 0xFFFFFFFF

    def wait(self, stream: int, addr: int, value: int) -> None:
        pass

    def wait_reset(self, stream: int, addr: int, value: int) -> None:
        self.write(stream, addr, 0)

    def copy_tensor(self, stream: int, dst: Any, src: Any) -> None:
        dst.copy_(src)

    def idle(self, stream: int) -> bool:
        return True


def _words(t: torch.Tensor) -> tuple[int, ...]:
    return (len(t.shape) << 16 | t.element_size(), *t.shape, *([0] * (7 - len(t.shape))))


def _what() -> str:
    return "message"


def pingpong(a: CePair, b: CePair, t: torch.Tensor, iters: int) -> dict[str, float]:
    """Microseconds per call of each part of a ping-pong of ``iters`` round trips (the median call: a loaded
    machine's preemptions land in the slow tail, not in the figure)."""
    words, n = _words(t), t.numel() * t.element_size()
    clock = time.perf_counter_ns
    first: list[int] = []
    second: list[int] = []
    wait: list[int] = []
    for _ in range(iters):
        for x, y in ((a, b), (b, a)):  # x sends first, y receives second
            t0 = clock()
            sop = x.send(t, 1, words, n, 7, 0, _what)
            t1 = clock()
            rop = y.recv(t, 1, words, n, 7, 0, _what)
            t2 = clock()
            y.order_after(rop, 7, 0)
            x.order_after(sop, 7, 0)
            t3 = clock()
            first.append(t1 - t0)
            second.append(t2 - t1)
            wait.append(t3 - t2)
        a.check(time.monotonic())  # (the watchdog's look: drops the completed messages)
        b.check(time.monotonic())
    return {
        "first side": statistics.median(first) / 1000,
        "second side": statistics.median(second) / 1000,
        "two order_after": statistics.median(wait) / 1000,
    }


class _Peer:
    """What ``copyengine._message`` reads of a peer."""

    def __init__(self, rank: int) -> None:
        self.timeout = 60.0
        self.completer = None
        self.peer = rank
        self.error = None


def layers(a: CePair, b: CePair, t: torch.Tensor, iters: int) -> dict[str, float]:
    """Microseconds per call through ``tensorwire.distributed.copyengine`` (signature, Work, pair)."""
    from tensorwire.distributed import copyengine

    # (the path reads tensor.device.index; a CPU tensor says None, which the free driver takes too)
    pa, pb = _Peer(1), _Peer(0)
    clock = time.perf_counter_ns
    send: list[int] = []
    recv: list[int] = []
    stream = copyengine.current_raw_stream
    copyengine.current_raw_stream = lambda device: 7
    try:
        for _ in range(iters):
            for x, px, y, py in ((a, pa, b, pb), (b, pb, a, pa)):
                t0 = clock()
                sw = copyengine.isend(px, x, t, 0)  # type: ignore[arg-type]
                t1 = clock()
                rw = copyengine.irecv(py, y, t, 0)  # type: ignore[arg-type]
                t2 = clock()
                send.append(t1 - t0)
                recv.append(t2 - t1)
                del sw, rw
            a.check(time.monotonic())
            b.check(time.monotonic())
    finally:
        copyengine.current_raw_stream = stream
    return {
        "copyengine.isend (first)": statistics.median(send) / 1000,
        "copyengine.irecv (second)": statistics.median(recv) / 1000,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=20000, help="round trips per turn")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--bytes", type=int, default=1 << 20)
    ap.add_argument("--layers", action="store_true", help="also time the backend's layer above the pair")
    ap.add_argument("--profile", action="store_true", help="then one turn under cProfile")
    args = ap.parse_args()
    if args.iters < 1 or args.turns < 1 or args.bytes < 4:
        ap.error("--iters, --turns >= 1 and --bytes >= 4")
    drv = FreeDriver()
    t = torch.ones(args.bytes // 4)
    with tempfile.TemporaryDirectory(prefix="tw-ce-python-") as tmp:
        ra = Region.create(tmp)
        rb = Region.attach(ra.path)
        kw: dict[str, Any] = {"timeout": 60.0, "driver": drv, "mismatch": lambda m, th, s: None}
        a = CePair(ra, rank=0, peer=1, **kw)
        b = CePair(rb, rank=1, peer=0, **kw)
        try:
            runs: dict[str, list[float]] = {}
            for _turn in range(args.turns):
                got = pingpong(a, b, t, args.iters)
                if args.layers:
                    got.update(layers(a, b, t, args.iters))
                for k, us in got.items():
                    runs.setdefault(k, []).append(us)
            print(f"python {sys.version.split()[0]}, torch {torch.__version__}; {args.turns} turns of {args.iters}")
            for k, v in runs.items():
                print(f"  {k:<28s} {min(v):6.2f} us per call (median {statistics.median(v):.2f})")
            if args.profile:
                prof = cProfile.Profile()
                prof.enable()
                pingpong(a, b, t, args.iters)
                prof.disable()
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
                print(out.getvalue())
        finally:
            done = PeerLostError("benchmark over")
            a.close(done)
            b.close(done)
            ra.close()
            rb.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
