"""A CPU stand-in for :class:`tensorwire.transport.ce.CeDriver`: streams are worker threads, memory is host memory.

Each simulated stream runs its queued work in order on a thread of its own: a copy is a ``memmove``, a
flag write an aligned 32-bit store, a flag wait blocks that stream's thread until the word reaches the
number (cyclic ``>=``) -- a GPU stalled on ``cuStreamWaitValue32``. A wait still blocked after
``HANG_S`` marks the stream hung (the tests assert no stream ever is). "Device" addresses are host
addresses, and an "IPC handle" names an allocation registered with :meth:`SimDriver.alloc`, so two
:class:`~tensorwire.transport.ce.CePair` objects in one process, each with its own mapping of the region,
run the whole protocol (arrivals, copies, flags, staging, failures) as two processes would.
"""

from __future__ import annotations

import ctypes
import itertools
import queue
import struct
import threading
import time
from typing import Any, Callable

import torch

from tensorwire.transport.ce import DriverError, NotExportable
from tensorwire.transport.ce.region import reached

HANG_S = 10.0


class SimStream:
    def __init__(self, name: str) -> None:
        self.recording: list[Callable[[], None]] | None = None  # a CUDA graph being captured on this stream
        self.q: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self.hung = False
        self.queued = 0
        self.ran = 0
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def put(self, fn: Callable[[], None]) -> None:
        if self.recording is not None:
            self.recording.append(fn)
            return
        self.queued += 1
        self.q.put(fn)

    def _run(self) -> None:
        while True:
            fn = self.q.get()
            if fn is None:
                return
            fn()
            self.ran += 1

    def drain(self, timeout: float = HANG_S) -> bool:
        deadline = time.monotonic() + timeout
        while self.ran < self.queued:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0005)
        return True

    def stop(self) -> None:
        self.q.put(None)


class SimDriver:
    """The methods of CeDriver that CePair calls, on host memory (see the module docstring)."""

    def __init__(self) -> None:
        self.streams: dict[int, SimStream] = {}
        self._ids = itertools.count(1)
        self.allocs: list[tuple[int, int, int, bool, torch.Tensor]] = []  # base, size, id, exportable, owner
        self.opened: list[bytes] = []
        self.copies = 0
        self.kernel_ops = 0  # flag kernels queued (captured messages with TENSORWIRE_CE_GRAPH_FLAGS kernel)
        self.peer_device: Any = -1

    # memory
    def alloc(self, nbytes: int, *, exportable: bool = True) -> torch.Tensor:
        t = torch.zeros(max(nbytes, 1), dtype=torch.uint8)
        self.allocs.append((t.data_ptr(), t.numel(), next(self._ids), exportable, t))
        return t[:nbytes]

    def allocation(self, ptr: int) -> tuple[int, int, int]:
        for base, size, ident, _e, _t in self.allocs:
            if base <= ptr < base + size:
                return base, size, ident
        raise DriverError(f"cuPointerGetAttributes: {ptr:#x} is no allocation of the simulator")

    def device_of(self, ptr: int) -> Any:
        """The device of a mapped peer export: ``peer_device`` (-1, unknown, unless a test says otherwise)."""
        self.allocation(ptr)
        return self.peer_device

    def export(self, base: int) -> bytes:
        for b, _size, ident, exportable, _t in self.allocs:
            if b == base:
                if not exportable:
                    raise NotExportable("cuIpcGetMemHandle: CUDA_ERROR_INVALID_VALUE (simulated cuMem* memory)")
                return struct.pack("<QQ", base, ident).ljust(64, b"\0")
        raise DriverError("cuIpcGetMemHandle: not an allocation base")

    def open(self, handle: bytes) -> int:
        if len(handle) != 64:
            raise DriverError(f"an IPC handle is 64 bytes, got {len(handle)}")
        base, ident = struct.unpack_from("<QQ", handle)
        for b, _size, i, _e, _t in self.allocs:
            if b == base and i == ident:
                self.opened.append(handle)
                return base
        raise DriverError("cuIpcOpenMemHandle: CUDA_ERROR_INVALID_VALUE (no such export)")

    def close(self, dptr: int) -> None:
        pass

    def register_host(self, addr: int, nbytes: int) -> int:
        return addr

    def context(self, device: Any) -> int:
        return 1

    # streams
    def new_stream(self) -> int:
        ident = next(self._ids)
        self.streams[ident] = SimStream(f"sim-stream-{ident}")
        return ident

    def new_event(self) -> int:
        return next(self._ids)

    def order(self, after: int, before: int, event: int) -> None:
        reached_ = threading.Event()
        self.streams[before].put(reached_.set)
        self.streams[after].put(lambda: self._wait_event(after, reached_))

    def _wait_event(self, stream: int, ev: threading.Event) -> None:
        if not ev.wait(HANG_S):
            self.streams[stream].hung = True

    def copy(self, stream: int, dst: int, src: int, nbytes: int) -> None:
        def run() -> None:
            ctypes.memmove(dst, src, nbytes)
            self.copies += 1

        self.streams[stream].put(run)

    def write(self, stream: int, addr: int, value: int) -> None:
        def run() -> None:
            ctypes.c_uint32.from_address(addr).value = value & 0xFFFFFFFF

        self.streams[stream].put(run)

    def wait(self, stream: int, addr: int, value: int) -> None:
        def run() -> None:
            deadline = time.monotonic() + HANG_S
            while not reached(ctypes.c_uint32.from_address(addr).value, value):
                if time.monotonic() > deadline:
                    self.streams[stream].hung = True
                    return
                time.sleep(0.0002)

        self.streams[stream].put(run)

    def write_wait(self, stream: int, waddr: int, wvalue: int, addr: int, value: int) -> None:
        self.write(stream, waddr, wvalue)
        self.wait(stream, addr, value)

    def wait_reset(self, stream: int, addr: int, value: int) -> None:
        self.wait(stream, addr, value)
        self.write(stream, addr, 0)

    # the flag kernels of captured messages: the same effects as the memory operations, counted apart
    def flag_kernels(self, device: Any) -> bool:
        return True

    def kernel_wait_reset(self, device: Any, stream: int, addr: int, value: int) -> None:
        self.kernel_ops += 1
        self.wait_reset(stream, addr, value)

    def kernel_write(self, device: Any, stream: int, addr: int, value: int) -> None:
        self.kernel_ops += 1
        self.write(stream, addr, value)

    def copy_tensor(self, stream: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.streams[stream].put(lambda: dst.copy_(src))

    def capturing(self, stream: int) -> bool:
        return self.streams[stream].recording is not None

    # graphs: capture records a stream's work; a replay queues the recorded work again
    def capture_begin(self, stream: int) -> None:
        assert stream != 0, "CUDA cannot capture the legacy default stream"
        self.streams[stream].recording = []

    def capture_end(self, stream: int) -> list[Callable[[], None]]:
        graph, self.streams[stream].recording = self.streams[stream].recording, None
        assert graph is not None
        return graph

    def replay(self, stream: int, graph: list[Callable[[], None]]) -> None:
        for fn in graph:
            self.streams[stream].put(fn)

    def stop(self) -> None:
        for s in self.streams.values():
            s.stop()
