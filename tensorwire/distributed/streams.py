"""CUDA stream semantics of ``backend="tensorwire"``, as NCCL has them.

- ``isend`` of a CUDA tensor: the bytes are read only after the work queued on
  the caller's current stream before the call. An event is recorded there
  (:meth:`CudaOps.mark`); the sending thread waits for that event, never for the
  whole device, and copies (staging, non-contiguous tensors) run on a private
  stream of tensorwire's, so they never queue behind the caller's work.
- ``irecv`` of a CUDA tensor returns at once: the tensor is posted to the
  transport once the caller's stream has reached the ``irecv`` (an event; right
  away when that stream is idle), so the bytes never land while earlier work
  still reads the tensor.
- ``wait()`` of a CUDA ``irecv`` (and ``isend``) without a timeout makes the
  caller's current stream wait for the operation **without blocking the host**:
  a ``cuStreamWaitValue32(GEQ)`` on a :class:`Flag` -- a word of device-mapped
  pinned host memory -- for the operation's sequence number. The completion
  path (a thread of the channel) writes that number into the flag once the
  bytes are in the tensor (received, and copied out of a staging slot). On
  failure (peer lost, mismatch, timeout) it writes it too, so a stream never
  waits forever; the error goes to the Work (``is_completed()`` True,
  ``exception()``) and to the group (its next call raises), as NCCL reports
  asynchronous errors. ``wait(timeout)`` blocks the host, as NCCL's does.

tensorwire's threads queue no GPU work and allocate nothing for an operation a
stream may wait on: GPU work queued by the thread that releases a flag, while a
stream waits on that flag, may never run (measured on an H100: a copy kernel
never did, a pinned-memory copy on a stream of its own now and then not), and an
allocation of pinned or device memory synchronizes with the device. So slots are
taken in the caller's thread, a send's copy into its slot goes on the caller's
stream at ``isend`` (:meth:`CudaOps.copy_on_stream`), and a receive through a
slot (TCP's pinned one, a non-contiguous tensor's) has no flag: its ``wait()``
blocks the host. UCX's own GPU work for a transfer is out of tensorwire's hands:
the mode stays off by default.

Where a device cannot (no driver entry point, v1 operations disabled, the probe
failed) or ``TENSORWIRE_CUDA_STREAM_WAIT=0``, ``wait()`` blocks the host until
the bytes are in the tensor -- the result is the same, only later; one log line
says so.

Flags: one per channel (peer, direction, tag), taken from a process-wide pool
the first time a CUDA message goes over the channel and reused for every later
message of any signature on it: no allocation per message. A flag is never
reset: its value only grows (modulo 2**32), and the driver's GEQ is a cyclic
comparison made for sequence numbers (``(int32_t)(*addr - value) >= 0``), so
wrap-around needs nothing as long as fewer than 2**31 operations of one channel
are in flight. Flag memory is never freed (a stream may still poll a word after
its group is gone); a closed channel's flag goes back to the pool with every
number it issued released.

The CUDA calls the point-to-point path makes are all in :class:`CudaOps`; tests
without a GPU substitute a simulator with the same methods.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from ..cuda import StreamMemOps, current_raw_stream, current_stream_idle, stream_mem_ops
from ..settings import setting

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["Flag", "FlagPool", "CudaOps", "seq_reached", "SEQ_MASK"]

log = logging.getLogger(__name__)

SEQ_MASK = 0xFFFFFFFF
_HALF = 1 << 31
#: bytes between two flags (one cache line each: the host writes one while the GPU polls another)
FLAG_STRIDE = 64
FLAG_PAGE = 4096


def seq_reached(value: int, seq: int) -> bool:
    """Whether a flag holding ``value`` lets a wait for ``seq`` go on: ``(int32_t)(value - seq) >= 0``."""
    return ((value - seq) & SEQ_MASK) < _HALF


class Flag:
    """A 32-bit word in device-mapped pinned host memory that streams wait on (see the module docstring).

    ``issue()`` hands out the next sequence number (the caller serializes it with
    the channel's queue, so numbers follow the channel's order); ``release(n)``
    lets every wait for a number up to ``n`` go on. Releases only move the word
    forward: a late release of an older number never takes it back.
    """

    __slots__ = ("host_addr", "device_addr", "_word", "_value", "_issued", "_lock")

    def __init__(self, host_addr: int, device_addr: int) -> None:
        self.host_addr = host_addr
        self.device_addr = device_addr
        self._word = ctypes.c_uint32.from_address(host_addr)
        self._value = int(self._word.value)
        self._issued = self._value
        self._lock = threading.Lock()

    @property
    def value(self) -> int:
        """What the word holds (every number up to it is released)."""
        return int(self._word.value)

    @property
    def issued(self) -> int:
        return self._issued

    def issue(self) -> int:
        self._issued = (self._issued + 1) & SEQ_MASK
        return self._issued

    def release(self, seq: int) -> None:
        with self._lock:
            if seq != self._value and seq_reached(seq, self._value):
                self._value = seq
                self._word.value = seq  # one aligned 32-bit store: the GPU sees the old or the new word

    def release_all(self) -> None:
        self.release(self._issued)


class FlagPool:
    """Flags carved out of pages from ``alloc(nbytes) -> (host address, device address)``; never freed.

    A flag given back keeps its value and goes on from there with its next owner.
    """

    def __init__(self, alloc: Callable[[int], tuple[int, int]]) -> None:
        self._alloc = alloc
        self._free: list[Flag] = []
        self._lock = threading.Lock()
        self.pages = 0

    def take(self) -> Flag:
        with self._lock:
            if not self._free:
                host, dev = self._alloc(FLAG_PAGE)
                self.pages += 1
                # reversed: take() pops from the end, so flags go out in address order
                self._free.extend(Flag(host + off, dev + off) for off in reversed(range(0, FLAG_PAGE, FLAG_STRIDE)))
            return self._free.pop()

    def give(self, flag: Flag) -> None:
        flag.release_all()
        with self._lock:
            self._free.append(flag)


_POOL: FlagPool | None = None
_POOL_LOCK = threading.Lock()
_WARNED: set[int] = set()  # devices whose fallback to host waits was logged (once per process)


def _warn_once(index: int, msg: str, *args: Any) -> None:
    with _POOL_LOCK:
        if index in _WARNED:
            return
        _WARNED.add(index)
    log.warning(msg, *args)


def _flag_pool(mem: StreamMemOps, device: int) -> FlagPool:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = FlagPool(lambda n: mem.alloc_words(n, device))
        return _POOL


class _Mark:
    """An event of :meth:`CudaOps.mark` and the device whose pool it goes back to."""

    __slots__ = ("event", "device")

    def __init__(self, event: Any, device: int) -> None:
        self.event = event
        self.device = device


class CudaOps:
    """Every CUDA call of the point-to-point path for CUDA tensors (one per group).

    Args:
        stream_wait: make streams wait on flags (``TENSORWIRE_CUDA_STREAM_WAIT``, default off: experimental); False: ``wait()``
            blocks the host.
        mem: the driver's stream memory operations (default: :func:`tensorwire.cuda.stream_mem_ops`).
    """

    #: how long :meth:`wait_reached` sleeps between two looks at an event, at most
    POLL_MAX_S = 0.0005
    #: how long it looks without sleeping first
    SPIN_S = 0.0002

    def __init__(self, *, stream_wait: bool | None = None, mem: StreamMemOps | None = None) -> None:
        self._stream_wait = setting("cuda_stream_wait") if stream_wait is None else stream_wait
        self._mem = mem
        self._usable: dict[int, bool] = {}
        self._events: dict[int, list[Any]] = {}
        self._copy_streams: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._bound = threading.local()

    # -- which tensors ------------------------------------------------------------------------------------
    def streamed(self, tensor: "torch.Tensor") -> bool:
        """Whether ``tensor`` follows stream semantics (CUDA tensors)."""
        return bool(tensor.is_cuda)

    # -- the caller's stream: events ------------------------------------------------------------------------
    def mark(self, tensor: "torch.Tensor") -> _Mark | None:
        """An event recorded on the current stream of ``tensor``'s device (None: that stream is idle).

        Events are reused (:meth:`recycle`): none is made per message once a few exist.
        """
        import torch

        device = tensor.device
        if current_stream_idle(device):
            return None
        index = device.index or 0
        free = self._events.get(index)
        try:
            ev = free.pop() if free else torch.cuda.Event()
        except IndexError:  # taken by another thread meanwhile
            ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        return _Mark(ev, index)

    def reached(self, mark: _Mark | None) -> bool:
        """Whether the stream has reached ``mark`` (None: nothing to wait for). Never blocks."""
        return mark is None or bool(mark.event.query())

    def wait_reached(self, mark: _Mark | None, deadline: float) -> bool:
        """Wait (this thread, not the device) until the stream reached ``mark``; False when ``deadline`` passed first."""
        if mark is None:
            return True
        ev = mark.event
        if ev.query():
            return True
        # Kernels that end within SPIN_S are seen at once (a sleep lasts ~60 us or more on Linux); the core is
        # given away between two looks, the GIL too.
        spin_end = time.monotonic() + min(self.SPIN_S, max(0.0, deadline - time.monotonic()))
        while time.monotonic() < spin_end:
            os.sched_yield()
            if ev.query():
                return True
        pause = 0.00002
        while True:
            if time.monotonic() >= deadline:
                return bool(ev.query())
            time.sleep(pause)
            if ev.query():
                return True
            pause = min(pause * 2, self.POLL_MAX_S)

    def recycle(self, mark: _Mark | None) -> None:
        """Give the event of a :meth:`mark` back once nothing waits for it any more."""
        if mark is not None:
            self._events.setdefault(mark.device, []).append(mark.event)

    def bind_thread(self, device: "torch.device") -> None:
        """Make ``device`` (its primary context) current in one of tensorwire's own threads, once.

        The channels' threads drive UCX transfers of CUDA memory; UCX's CUDA transports expect the calling
        thread to have a context. Never called in a caller's thread (it would change the caller's device).
        """
        import torch

        index = device.index or 0
        if getattr(self._bound, "index", None) != index:
            torch.cuda.set_device(index)
            self._bound.index = index

    # -- tensorwire's own copies ----------------------------------------------------------------------------
    def copy(self, dst: "torch.Tensor", src: "torch.Tensor") -> None:
        """``dst.copy_(src)`` on a private stream of the CUDA side's device, finished when this returns.

        Never on the caller's stream, which may be waiting on a flag that only this copy's completion releases.
        """
        import torch

        device = dst.device if dst.is_cuda else src.device
        stream = self._copy_streams.get(device.index or 0) or self._copy_stream(device)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        stream.synchronize()

    def copy_on_stream(self, dst: "torch.Tensor", src: "torch.Tensor") -> None:
        """``dst.copy_(src)`` queued on the current stream of the CUDA side's device (a caller's thread only)."""
        dst.copy_(src, non_blocking=True)

    def _copy_stream(self, device: "torch.device") -> Any:
        import torch

        with self._lock:
            stream = self._copy_streams.get(device.index or 0)
            if stream is None:
                stream = self._copy_streams[device.index or 0] = torch.cuda.Stream(device=device)
        return stream

    # -- stream waits on flags -------------------------------------------------------------------------------
    def usable(self, device: "torch.device") -> bool:
        """Whether streams of ``device`` can wait on flags (decided once per device; one log line when not)."""
        index = device.index or 0
        ok = self._usable.get(index)
        if ok is None:
            with self._lock:
                ok = self._usable.get(index)
                if ok is None:
                    ok = self._usable[index] = self._decide(index)
            # made here, in a caller's thread, before any stream waits on a flag: no CUDA call that may
            # synchronize with the device runs later in tensorwire's threads on this account
            if ok and device.type == "cuda" and index not in self._copy_streams:
                self._copy_stream(device)
        return ok

    def _decide(self, index: int) -> bool:
        if not self._stream_wait:
            log.info("tensorwire.distributed: TENSORWIRE_CUDA_STREAM_WAIT=0: wait() of CUDA operations blocks the host")
            return False
        if self._mem is None:
            self._mem = stream_mem_ops()
        why = "the CUDA driver has no stream memory operations" if self._mem is None else self._mem.unusable(index)
        if why is not None:
            _warn_once(
                index,
                "tensorwire.distributed: cuda:%d: streams cannot wait on host flags (%s); wait() of CUDA "
                "operations blocks the host until the bytes are in place",
                index,
                why,
            )
            return False
        return True

    def new_flag(self, device: "torch.device") -> Flag | None:
        """A flag from the process's pool (after :meth:`usable` said yes for ``device``); None if none can be had."""
        mem = self._mem
        if mem is None:
            return None
        try:
            return _flag_pool(mem, device.index or 0).take()
        except OSError as exc:
            _warn_once(
                device.index or 0,
                "tensorwire.distributed: no mapped host memory for stream flags (%s); wait() of CUDA operations "
                "blocks the host",
                exc,
            )
            self._usable[device.index or 0] = False
            return None

    def give_flag(self, flag: Flag) -> None:
        assert _POOL is not None
        _POOL.give(flag)

    def order_after(self, flag: Flag, seq: int, tensor: "torch.Tensor") -> bool:
        """Queue on the current stream of ``tensor``'s device a wait until ``flag`` reaches ``seq``.

        False when the driver refused (then this device blocks the host from now on, one log line).
        """
        mem = self._mem
        index = tensor.device.index or 0
        if mem is None:
            return False
        err = mem.wait_geq(index, current_raw_stream(index), flag.device_addr, seq)
        if err == 0:
            return True
        _warn_once(
            index,
            "tensorwire.distributed: cuda:%d: cuStreamWaitValue32 failed (%s); wait() of CUDA operations blocks "
            "the host from now on",
            index,
            mem.error_text(err) if err > 0 else "no context",
        )
        self._usable[index] = False
        return False
