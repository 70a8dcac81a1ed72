#!/usr/bin/env python
"""The copy-engine pair's own host time per message, without CUDA: what is left once the driver costs nothing.

::

    python bench/profile_ce_pair_cpu.py [--messages 20000] [--bytes 4096] [--profile]

Both sides of one :class:`~tensorwire.transport.ce.CePair` live in this process, over one shared region, as the
CPU tests set them up; their driver is a stand-in whose calls take effect at once on host memory (a copy is a
``memmove``, a flag write a store, a flag wait finds its flag reached). A message is ``send`` on one side,
``recv`` on the other and ``order_after`` on both, in the order a ping-pong gives them (the receiver first,
then the sender first). So the time per message is the pair's Python (or mypyc-compiled) code alone: its
lock, the region's entries and flags, the ops -- the part of a CUDA message's host time that is not a driver
call. On a GPU host, ``bench/profile_ce_host.py`` times the driver calls themselves (its "pieces") and the
whole message at every layer (``--levels``); this says how much of the pair's layer is its own code.

Prints which build ran (compiled or Python) and the microseconds per message; ``--profile`` adds the functions
that took the most time under cProfile (Python build: the compiled one shows no functions).
"""

from __future__ import annotations

import argparse
import cProfile
import ctypes
import io
import pstats
import sys
import tempfile
import time
from typing import Any, Callable

import torch

from tensorwire.native import summary as native_summary
from tensorwire.transport.ce import CePair, Region


class ImmediateDriver:
    """The calls :class:`CePair` makes of its driver, done at once on host memory (no streams, no CUDA)."""

    def __init__(self) -> None:
        self._ids = 0
        self._allocs: dict[int, tuple[int, int]] = {}  # base -> (size, id)
        self._keep: list[torch.Tensor] = []

    def alloc(self, nbytes: int) -> torch.Tensor:
        t = torch.zeros(nbytes, dtype=torch.uint8)
        self._ids += 1
        self._allocs[t.data_ptr()] = (nbytes, self._ids)
        self._keep.append(t)
        return t

    def allocation(self, ptr: int) -> tuple[int, int, int]:
        for base, (size, ident) in self._allocs.items():
            if base <= ptr < base + size:
                return base, size, ident
        raise ValueError(f"{ptr:#x} is no allocation of this driver")

    def export(self, base: int) -> bytes:
        return base.to_bytes(8, "little").ljust(64, b"\0")

    def open(self, handle: bytes) -> int:
        return int.from_bytes(handle[:8], "little")

    def device_of(self, ptr: int) -> int:
        return -1

    def close(self, dptr: int) -> None:
        pass

    def register_host(self, addr: int, nbytes: int) -> int:
        return addr

    def unregister_host(self, addr: int) -> None:
        pass

    def context(self, device: Any) -> int:
        return 1

    def new_stream(self) -> int:
        self._ids += 1
        return self._ids

    new_event = new_stream

    def flag_kernels(self, device: Any) -> bool:
        return True

    def capturing(self, stream: int) -> bool:
        return False

    def order(self, after: int, before: int, event: int) -> None:
        pass

    def copy(self, stream: int, dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    def copy_tensor(self, stream: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def write(self, stream: int, addr: int, value: int) -> None:
        ctypes.c_uint32.from_address(addr).value = value & 0xFFFFFFFF

    def wait(self, stream: int, addr: int, value: int) -> None:
        pass  # (every flag a message waits on here was written before: the two sides take turns in one thread)


def build(nbytes: int) -> tuple[Callable[[bool], None], Callable[[], None], Callable[[], None]]:
    """``(message(receiver_first), check(), close())`` for one pair of sides over a fresh region, messages of
    ``nbytes``."""
    drv = ImmediateDriver()
    tmp = tempfile.mkdtemp(prefix="tw-ce-pair-")
    ra = Region.create(tmp)
    rb = Region.attach(ra.path)
    never = lambda mine, theirs, sending: None  # noqa: E731 - signatures always fit here
    a = CePair(ra, rank=0, peer=1, timeout=30.0, driver=drv, mismatch=never)
    b = CePair(rb, rank=1, peer=0, timeout=30.0, driver=drv, mismatch=never)
    src = drv.alloc(nbytes)
    dst = drv.alloc(nbytes)
    src.copy_(torch.arange(nbytes, dtype=torch.int64).to(torch.uint8))
    words = (1 << 16 | 1, nbytes, 0, 0, 0, 0, 0, 0)

    def what() -> str:
        return "message"

    def message(receiver_first: bool) -> None:
        if receiver_first:
            r = b.recv(dst, 1, words, nbytes, 1, 0, what)
            s = a.send(src, 1, words, nbytes, 2, 0, what)
        else:
            s = a.send(src, 1, words, nbytes, 2, 0, what)
            r = b.recv(dst, 1, words, nbytes, 1, 0, what)
        b.order_after(r, 1, 0)
        a.order_after(s, 2, 0)

    def check() -> None:
        dst.zero_()
        message(True)
        if not torch.equal(src, dst):
            raise SystemExit("the bytes that arrived differ from those sent: the stand-in driver is broken")

    def close() -> None:
        import shutil

        from tensorwire.errors import PeerLostError

        a.close(PeerLostError("profile over"))
        b.close(PeerLostError("profile over"))
        shutil.rmtree(tmp, ignore_errors=True)

    return message, check, close


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=20000, help="messages per order (two orders are timed)")
    ap.add_argument("--bytes", type=int, default=4096, help="bytes per message (a memmove here; >= 1)")
    ap.add_argument("--profile", action="store_true", help="also print the top functions under cProfile")
    args = ap.parse_args(argv)
    if args.messages < 1 or args.bytes < 1:
        ap.error("--messages >= 1 and --bytes >= 1")
    message, check, close = build(args.bytes)
    try:
        check()
        print(f"build: {native_summary()}", flush=True)
        for receiver_first in (True, False):
            for _ in range(min(2000, args.messages)):
                message(receiver_first)
            t0 = time.perf_counter_ns()
            for _ in range(args.messages):
                message(receiver_first)
            us = (time.perf_counter_ns() - t0) / args.messages / 2 / 1e3
            order = "receiver first" if receiver_first else "sender first"
            print(f"{order:<15s} {us:6.2f} us per message per side (send or recv + order_after), driver free")
        if args.profile:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(min(args.messages, 5000)):
                message(True)
            pr.disable()
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(15)
            print(buf.getvalue())
        check()
    finally:
        close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
