"""A CPU stand-in for the CUDA calls of backend "tensorwire" (:class:`tensorwire.distributed.streams.CudaOps`).

Host tensors play CUDA tensors; one *lazy* simulated stream plays the caller's current stream of one
process: queued work runs only when something waits for it (an event's ``synchronize``, a stream flush), in
queue order, as late as the recorded dependencies allow. A stream wait on a flag is queued work that, when it
runs, blocks until the flag's word (real ctypes memory, written by the real :class:`Flag`) reaches the
number -- a GPU stalled on ``cuStreamWaitValue32``. A missing event, stream wait or flag release in the
backend then shows up here as stale bytes or a hung stream, as it would on a GPU (the mutants below show the
simulator catches each omission).
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any, Callable

from tensorwire.distributed.streams import FlagPool, seq_reached

#: how long a simulated stream waits on a flag before the test calls it hung
HANG_S = 20.0


class StreamHang(AssertionError):
    """A simulated stream waited on a flag that was never released."""


class SimStream:
    def __init__(self) -> None:
        self.ops: list[Callable[[], None]] = []
        self.done = 0
        self.lock = threading.RLock()  # one runner at a time (a GPU stream runs its work in order)

    def enqueue(self, fn: Callable[[], None]) -> None:
        with self.lock:
            self.ops.append(fn)

    def idle(self) -> bool:
        return self.done >= len(self.ops)

    def run_until(self, n: int) -> None:
        while self.done < n:
            if not self.lock.acquire(timeout=0.001):
                continue  # another thread runs the stream (maybe stalled on a flag further on): watch it progress
            try:
                while self.done < n:
                    self.ops[self.done]()
                    self.done += 1  # after it ran: a stream wait still blocking is not done
            finally:
                self.lock.release()

    def flush(self) -> None:
        self.run_until(len(self.ops))


class SimEvent:
    def __init__(self, stream: SimStream) -> None:
        self.stream = stream
        self.pos = len(stream.ops)

    def query(self) -> bool:
        return self.stream.done >= self.pos

    def synchronize(self) -> None:
        self.stream.run_until(self.pos)


def _ours(thread: threading.Thread) -> bool:
    """Whether ``thread`` is one of the channels' own (a caller's thread is any other)."""
    return thread.name.startswith("tw-dist-")


class SimOps:
    """What :class:`tensorwire.distributed.streams.CudaOps` does, on one simulated stream (every tensor is "CUDA")."""

    def __init__(self, *, stream_wait: bool = True) -> None:
        self.stream = SimStream()
        self.stream_wait = stream_wait
        self._pages: list[Any] = []
        self.pool = FlagPool(self._alloc)
        self.waits: list[int] = []
        self.copies = 0
        #: per copy a thread of tensorwire's made: whether both ends were contiguous
        self.thread_copies: list[bool] = []

    def _alloc(self, n: int) -> tuple[int, int]:
        buf = ctypes.create_string_buffer(n)
        self._pages.append(buf)  # kept alive: "never freed"
        addr = ctypes.addressof(buf)
        return addr, addr

    # -- what the test queues on "the GPU" -------------------------------------------------------------
    def kernel(self, fn: Callable[[], None]) -> None:
        self.stream.enqueue(fn)

    # -- the CudaOps interface ---------------------------------------------------------------------------
    def streamed(self, tensor: Any) -> bool:
        return True

    def mark(self, tensor: Any) -> SimEvent | None:
        return None if self.stream.idle() else SimEvent(self.stream)

    def reached(self, ev: SimEvent | None) -> bool:
        return ev is None or ev.query()

    def wait_reached(self, ev: SimEvent | None, deadline: float) -> bool:
        if ev is not None:
            ev.synchronize()  # lazy: the work before the event runs now, in the waiting thread
        return True

    def recycle(self, ev: Any) -> None:
        pass

    def bind_thread(self, device: Any) -> None:
        pass

    def copy_on_stream(self, dst: Any, src: Any) -> None:
        assert not _ours(threading.current_thread()), "queued on a stream by a thread of tensorwire's"
        self.stream.enqueue(lambda: dst.copy_(src))

    def copy(self, dst: Any, src: Any) -> None:
        self.copies += 1
        thread = threading.current_thread()
        if _ours(thread):
            self.thread_copies.append(dst.is_contiguous() and src.is_contiguous())
        dst.copy_(src)

    def usable(self, device: Any) -> bool:
        return self.stream_wait

    def new_flag(self, device: Any) -> Any:
        return self.pool.take()

    def give_flag(self, flag: Any) -> None:
        self.pool.give(flag)

    def order_after(self, flag: Any, seq: int, tensor: Any) -> bool:
        self.waits.append(seq)
        word = ctypes.c_uint32.from_address(flag.device_addr)

        def stream_wait() -> None:
            deadline = time.monotonic() + HANG_S
            while not seq_reached(int(word.value), seq):
                if time.monotonic() > deadline:
                    raise StreamHang(f"a stream waited {HANG_S} s for flag {seq}; it holds {word.value}")
                time.sleep(0.0005)

        self.stream.enqueue(stream_wait)
        return True


# -- mutants: each leaves out one thing the backend relies on ---------------------------------------------


class NoEventOps(SimOps):
    """Records no event on the caller's stream (as if isend/irecv ignored the work queued before them)."""

    def mark(self, tensor: Any) -> None:
        return None


class NoStreamWaitOps(SimOps):
    """Claims to queue the stream wait but queues nothing (as if wait() returned without ordering the stream)."""

    def order_after(self, flag: Any, seq: int, tensor: Any) -> bool:
        self.waits.append(seq)
        return True
