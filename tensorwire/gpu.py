"""GPU data-path pieces: allocator check, IPC-safe CUDA slots, stream ordering, overlapped staging.

**expandable_segments.** With ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``
(or ``PYTORCH_ALLOC_CONF``) PyTorch's caching allocator maps device memory
with the CUDA virtual-memory API (``cuMemCreate``/``cuMemMap``). Legacy CUDA
IPC handles (``cuIpcGetMemHandle``), which UCX's ``cuda_ipc`` transport uses
between processes on one host, cannot be made for such memory: UCX then
silently falls back to a slower path (staging through host memory), and
GPU->GPU over NVLink loses an order of magnitude. :func:`expandable_segments`
detects the setting; :func:`check_allocator` warns once; :func:`alloc_cuda`
allocates slot memory with plain ``cudaMalloc`` (outside the caching
allocator, so no allocator setting can change how it is mapped).

**Stream semantics** (what :meth:`tensorwire.Link.send` / ``recv`` promise):

- a send of a CUDA tensor is ordered after the work already queued on the
  *current* stream of the tensor's device (an event recorded there is waited
  on by the copy stream, or synchronized: it waits only for the writes queued
  on that stream, not for the whole device);
- a received CUDA slot is safe to use on the receiver's current stream: UCX
  completes a receive only after its copies into device memory finished, and
  the TCP-staged path makes the current stream wait on the event that ends its
  host->device copies.

**Chunked, overlapped staging** for transports that cannot reach GPU memory
(TCP), wired into :class:`tensorwire.Link` for static CUDA specs:

- :func:`chunk_plan` cuts a tensor's bytes into chunks (``DEFAULT_CHUNK`` =
  2 MiB, at most ``MAX_STAGING_CHUNKS``; the whole tensor when small). Both
  sides compute it from the negotiated spec alone (and the
  ``TENSORWIRE_STAGING_CHUNK`` knob, :func:`staging_chunk`), so the wire carries
  one ordinary header-less message per chunk on the spec's tag: nothing new in
  the transport, and two processes running this code always agree.
- :class:`StagedSender`: all device->host copies are queued at once on a copy
  stream that first waits for the caller's current stream, one event per chunk;
  chunk *i* is handed to ``transport.send`` as soon as its event completes,
  while the copy engine moves chunk *i+1*.
- :class:`StagedReceiver`: each chunk of two pinned host slots is posted as its
  own receive (the transport fills posted buffers per tag in FIFO order). Each
  chunk's host->device copy is queued the moment it lands, so it overlaps the
  socket; the caller's current stream then waits on the copies' event. A host
  slot is re-posted only after the copies out of it completed.

All CUDA calls of the two engines go through a :class:`CudaOps` object, so the
chunk/credit/stream protocol can be checked on a machine without a GPU with a
simulated, deliberately lazy stream model (``tests/test_staging.py``).

Nothing here initializes CUDA at import.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Mapping

from .transport.base import remaining

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "expandable_segments",
    "check_allocator",
    "AllocatorReport",
    "alloc_cuda",
    "CudaBuffer",
    "DEFAULT_CHUNK",
    "MAX_STAGING_CHUNKS",
    "STAGING_CHUNK_ENV",
    "chunk_plan",
    "staging_chunk",
    "CudaOps",
    "sync_current_stream",
    "StagedSender",
    "StagedReceiver",
]

log = logging.getLogger(__name__)

#: Chunk of the overlapped device->host staging (large enough to keep PCIe/NVLink busy, small enough to overlap).
#: 2 MiB: the sweep on 2 x H200 (bench/results/staged_chunks_h200x2.md) put it first at 16 MiB (0.91x the
#: bound, vs 0.69-0.81x for 1, 4, 8 and 16 MiB chunks) and at 1.06x at 64 MiB.
DEFAULT_CHUNK = 2 << 20
#: Most chunks one staged message is cut into: bigger tensors get bigger chunks (bounds per-chunk Python work
#: and the number of posted receive buffers; the pipeline's fill/drain stays below 1/64 of the transfer).
MAX_STAGING_CHUNKS = 64
#: Chunks enlarged to respect MAX_STAGING_CHUNKS are rounded up to this (keeps chunk offsets page-aligned).
STAGING_CHUNK_ALIGN = 64 << 10
#: Environment knob: staging chunk in bytes (suffixes K/M/G, KiB/MiB/GiB); 0 = one message per tensor.
STAGING_CHUNK_ENV = "TENSORWIRE_STAGING_CHUNK"
_ALLOC_ENV = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def _parse_alloc_conf(text: str) -> dict[str, str]:
    out = {}
    for item in text.replace(";", ",").split(","):
        if ":" in item:
            k, v = item.split(":", 1)
            out[k.strip().lower()] = v.strip()
    return out


class AllocatorReport:
    """What the caching allocator is configured with, and where that came from."""

    __slots__ = ("expandable", "source", "backend")

    def __init__(self, expandable: bool, source: str, backend: str | None) -> None:
        self.expandable = expandable
        self.source = source
        self.backend = backend

    def __repr__(self) -> str:
        return f"AllocatorReport(expandable={self.expandable}, source={self.source!r}, backend={self.backend!r})"


def expandable_segments(env: Mapping[str, str] | None = None, *, runtime: bool = True) -> AllocatorReport:
    """Whether PyTorch's CUDA allocator uses expandable segments.

    Looks at the allocator environment variables, then (``runtime=True`` and
    torch already imported) at the settings the running allocator reports,
    which also catch ``torch.cuda.memory._set_allocator_settings`` calls.
    """
    env = os.environ if env is None else env
    for name in _ALLOC_ENV:
        conf = _parse_alloc_conf(env.get(name, ""))
        if conf.get("expandable_segments", "").lower() in ("true", "1"):
            return AllocatorReport(True, f"{name}={env[name]}", conf.get("backend"))
    if runtime and "torch" in __import__("sys").modules:
        import torch

        try:
            settings = torch._C._accelerator_getAllocatorSettings()  # type: ignore[attr-defined]
        except (AttributeError, RuntimeError):
            settings = ""
        conf = _parse_alloc_conf(settings or "")
        if conf.get("expandable_segments", "").lower() in ("true", "1"):
            return AllocatorReport(True, f"allocator settings: {settings}", conf.get("backend"))
    return AllocatorReport(False, "", None)


_warned = False
_warn_lock = threading.Lock()


def check_allocator(*, env: Mapping[str, str] | None = None, warn: bool = True) -> AllocatorReport:
    """Warn (once per process) when expandable segments would defeat CUDA IPC for caching-allocator memory."""
    global _warned
    rep = expandable_segments(env)
    if rep.expandable and warn:
        with _warn_lock:
            if not _warned:
                _warned = True
                log.warning(
                    "tensorwire: %s: PyTorch maps CUDA memory with expandable segments, for which CUDA IPC "
                    "handles cannot be made; UCX cuda_ipc would silently fall back to staging through host "
                    "memory. tensorwire allocates its CUDA slots with cudaMalloc (tensorwire.gpu.alloc_cuda), "
                    "but tensors you send from the caching allocator cross over the slower path "
                    "(unset expandable_segments to avoid that)", rep.source)
    return rep


# -- IPC-safe device memory ------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _cudart() -> Any:
    """The CUDA runtime library torch itself loaded (or any libcudart found)."""
    import torch

    candidates = []
    base = os.path.dirname(torch.__file__)
    for pat in (os.path.join(base, "lib", "libcudart.so*"),
                os.path.join(os.path.dirname(base), "nvidia", "cuda_runtime", "lib", "libcudart.so*"),
                os.path.join(os.path.dirname(base), "nvidia", "cu*", "lib", "libcudart.so*")):
        candidates.extend(sorted(glob.glob(pat), reverse=True))
    found = ctypes.util.find_library("cudart")
    if found:
        candidates.append(found)
    candidates += ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    for cand in candidates:
        try:
            lib = ctypes.CDLL(cand)
        except OSError:
            continue
        lib.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        lib.cudaMalloc.restype = ctypes.c_int
        lib.cudaFree.argtypes = [ctypes.c_void_p]
        lib.cudaFree.restype = ctypes.c_int
        lib.cudaSetDevice.argtypes = [ctypes.c_int]
        lib.cudaGetDevice.argtypes = [ctypes.POINTER(ctypes.c_int)]
        lib.cudaGetLastError.restype = ctypes.c_int
        return lib
    raise OSError("libcudart not found")


@functools.lru_cache(maxsize=None)
def _memcpy_async() -> Any:
    """``f(dst_ptr, src_ptr, nbytes, stream) -> bool``: ``cudaMemcpyAsync(..., cudaMemcpyDefault, raw stream)``
    with ``stream``'s device current; False when it failed (the error is cleared: the caller takes torch's way).
    None when the runtime or torch lacks what this needs."""
    try:
        lib = _cudart()
        fn = lib.cudaMemcpyAsync
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        getdev, setdev = lib.cudaGetDevice, lib.cudaSetDevice
    except (OSError, AttributeError):
        return None

    def call(dst: int, src: int, nbytes: int, stream: Any) -> bool:
        idx = stream.device.index
        cur = ctypes.c_int(-1)
        if getdev(ctypes.byref(cur)) != 0:
            lib.cudaGetLastError()
            return False
        if cur.value != idx and setdev(idx) != 0:
            lib.cudaGetLastError()
            return False
        try:
            err = fn(dst, src, nbytes, 4, stream.cuda_stream)  # 4: cudaMemcpyDefault (unified addressing)
        finally:
            if cur.value != idx:
                setdev(cur.value)
        if err != 0:
            lib.cudaGetLastError()
            return False
        return True

    return call


@functools.lru_cache(maxsize=None)
def _on_current_stream(fn_name: str, expected: tuple[int, ...]) -> Any:
    """``f(device) -> int | None``: the CUDA runtime's ``fn_name(cudaStream_t)`` on ``device``'s current stream.

    ``torch.cuda.current_stream(device)`` builds a Stream object each time:
    measured 8.1 us per ``synchronize()`` on an H200 host (5.5 of them to get
    the stream), where a link sending a 16 MiB tensor spends ~60 us moving it.
    This asks torch for the raw ``cudaStream_t`` of the current stream and calls
    the runtime torch itself loaded (the same call torch makes) -- only when
    ``device`` is the current device (the legacy default stream, handle 0,
    means "the current device's"). ``f`` returns the call's result code when it
    is one of ``expected``; None when the caller must take torch's way: the
    device is not current, torch or the runtime lacks what this needs, or the
    call failed (the error is cleared first, so torch raises its own for the
    same stream).
    """
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    getdev = getattr(torch._C, "_cuda_getDevice", None)
    try:
        lib = _cudart()
        fn = getattr(lib, fn_name)
        fn.argtypes = [ctypes.c_void_p]
        fn.restype = ctypes.c_int
    except (OSError, AttributeError):
        fn = None
    if fn is None or raw is None or getdev is None:
        return lambda device: None

    def call(device: "torch.device") -> int | None:
        idx = device.index
        if idx is None or idx != getdev():
            return None
        err = fn(raw(idx))
        if err in expected:
            return err
        lib.cudaGetLastError()
        return None

    return call


_CUDA_ERROR_NOT_READY = 600


def current_stream_idle(device: "torch.device") -> bool:
    """Whether the work queued so far on ``device``'s current stream is all done (does not wait)."""
    err = _on_current_stream("cudaStreamQuery", (0, _CUDA_ERROR_NOT_READY))(device)
    if err is None:
        import torch

        return bool(torch.cuda.current_stream(device).query())
    return err == 0


def sync_current_stream(device: "torch.device") -> None:
    """Block until the work queued so far on ``device``'s current stream is done (see :func:`_on_current_stream`)."""
    if _on_current_stream("cudaStreamSynchronize", (0,))(device) is None:
        import torch

        torch.cuda.current_stream(device).synchronize()


class CudaBuffer:
    """Owner of one ``cudaMalloc`` allocation, exposed through ``__cuda_array_interface__`` (uint8, flat)."""

    def __init__(self, nbytes: int, device: int) -> None:
        lib = _cudart()
        self.nbytes = nbytes
        self.device = device
        self._lib = lib
        self.ptr = 0
        prev = ctypes.c_int()
        lib.cudaGetDevice(ctypes.byref(prev))
        lib.cudaSetDevice(device)
        try:
            p = ctypes.c_void_p()
            err = lib.cudaMalloc(ctypes.byref(p), max(1, nbytes))
            if err != 0:
                lib.cudaGetLastError()  # the runtime keeps the error as "last error": torch would raise it later
                raise MemoryError(f"cudaMalloc({nbytes}) on cuda:{device} failed with error {err}")
            self.ptr = int(p.value or 0)
        finally:
            lib.cudaSetDevice(prev.value)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3, "strides": None}

    def __del__(self) -> None:
        if self.ptr:
            try:
                self._lib.cudaFree(ctypes.c_void_p(self.ptr))
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass
            self.ptr = 0


def alloc_cuda(nbytes: int, device: "torch.device | int | None" = None, *, align: int = 256) -> "torch.Tensor":
    """A flat uint8 CUDA tensor of ``nbytes`` from plain ``cudaMalloc`` (CUDA-IPC-able whatever the allocator conf).

    The tensor keeps its :class:`CudaBuffer` alive (freed with the last tensor
    viewing it). Its data pointer is a multiple of ``align`` (a power of two;
    ``cudaMalloc`` itself guarantees 256 bytes, a larger ``align`` over-allocates
    by ``align`` bytes and starts the tensor at the first aligned address — an
    interior pointer, which CUDA IPC and UCX handle through the allocation's
    base). Falls back to CuPy, then to ``torch.empty`` with a warning if the
    CUDA runtime cannot be loaded.
    """
    import torch

    if align <= 0 or align & (align - 1):
        raise ValueError(f"align must be a power of two, got {align}")
    extra = align if align > 256 else 0
    if isinstance(device, int):
        index = device
    else:
        dev = torch.device(device) if device is not None else None
        index = dev.index if dev is not None and dev.index is not None else torch.cuda.current_device()
    total = nbytes + extra
    try:
        owner: Any = CudaBuffer(total, index)
    except OSError:
        try:
            import cupy  # type: ignore[import-not-found]

            with cupy.cuda.Device(index):
                mem = cupy.cuda.Memory(max(1, total))
                owner = cupy.ndarray((total,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        except ImportError:
            log.warning("tensorwire: neither libcudart nor CuPy available: CUDA slot from the caching allocator")
            check_allocator()
            t = torch.empty(total, dtype=torch.uint8, device=torch.device("cuda", index))
            return _aligned(t, nbytes, align)
    t = torch.as_tensor(owner, device=torch.device("cuda", index))
    if t.data_ptr() != int(owner.__cuda_array_interface__["data"][0]) and total:
        raise RuntimeError("torch copied the cudaMalloc buffer instead of wrapping it")
    return _aligned(t, nbytes, align)


def _aligned(t: "torch.Tensor", nbytes: int, align: int) -> "torch.Tensor":
    """The ``nbytes`` of flat ``t`` starting at its first ``align``-aligned address."""
    off = (-t.data_ptr()) % align if nbytes else 0
    if off + nbytes > t.numel():
        raise RuntimeError(f"allocation at {t.data_ptr():#x} leaves no {align}-aligned room for {nbytes} bytes")
    return t[off : off + nbytes] if (off or t.numel() != nbytes) else t


# -- chunked staging wired into Link ---------------------------------------------------------------


def chunk_plan(nbytes: int, chunk: int = DEFAULT_CHUNK, *,
               max_chunks: int = MAX_STAGING_CHUNKS) -> tuple[tuple[int, int], ...]:
    """How a staged message of ``nbytes`` is cut into wire messages: ``((offset, length), ...)``.

    Pure and deterministic: sender and receiver each compute it from the
    negotiated spec's byte size, so the chunk boundaries never travel.

    - ``nbytes <= chunk`` or ``chunk == 0``: one chunk, the whole tensor (a
      zero-byte tensor is still one, empty, message: one send = one receive);
    - otherwise chunks of ``chunk`` bytes and a shorter tail; if that would
      make more than ``max_chunks`` chunks, the chunk grows to
      ``ceil(nbytes / max_chunks)`` rounded up to ``STAGING_CHUNK_ALIGN``.

    Raises:
        ValueError: negative sizes, ``max_chunks < 1``.
    """
    if nbytes < 0 or chunk < 0 or max_chunks < 1:
        raise ValueError(f"chunk_plan({nbytes}, chunk={chunk}, max_chunks={max_chunks}): bad arguments")
    if chunk == 0 or nbytes <= chunk:
        return ((0, nbytes),)
    if -(-nbytes // chunk) > max_chunks:
        chunk = -(-nbytes // max_chunks)
        chunk = -(-chunk // STAGING_CHUNK_ALIGN) * STAGING_CHUNK_ALIGN
    return tuple((off, min(chunk, nbytes - off)) for off in range(0, nbytes, chunk))


_SUFFIX = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20,
           "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def staging_chunk(env: Mapping[str, str] | None = None) -> int:
    """The staging chunk in bytes: ``TENSORWIRE_STAGING_CHUNK`` or :data:`DEFAULT_CHUNK`; 0 means unchunked.

    Part of the wire format of staged CUDA specs: both ends of a link must use
    the same value (a difference is detected as a ``ProtocolError`` on the
    first message, never as wrong data).

    Raises:
        ConfigError: not a size (``4194304``, ``4M``, ``512KiB``, ``0``).
    """
    from .errors import ConfigError

    env = os.environ if env is None else env
    raw = env.get(STAGING_CHUNK_ENV, "").strip()
    if not raw:
        return DEFAULT_CHUNK
    text = raw.lower()
    digits = text.rstrip("kmgib")
    mult = _SUFFIX.get(text[len(digits):].strip())
    try:
        value = int(digits.strip())
    except ValueError:
        value = -1
    if mult is None or value < 0:
        raise ConfigError(f"{STAGING_CHUNK_ENV}={raw!r} is not a size in bytes (e.g. 4M, 1048576, or 0 for no chunking)")
    return value * mult


class CudaOps:
    """The CUDA calls the staging engines make, in one place.

    The engines only ever: create events, record/synchronize them, make a
    stream wait on an event, and queue a copy on a given stream. Tests without
    a GPU substitute an object with the same methods that simulates streams.
    """

    def current_stream(self, device: "torch.device") -> Any:
        import torch

        return torch.cuda.current_stream(device)

    def new_stream(self, device: "torch.device") -> Any:
        import torch

        return torch.cuda.Stream(device=device)

    def new_event(self) -> Any:
        import torch

        # Created once per slot and re-recorded every step (no allocation on the hot path). Timing off: cheaper.
        return torch.cuda.Event()

    def copy(self, dst: "torch.Tensor", src: "torch.Tensor", stream: Any) -> None:
        """Queue ``dst.copy_(src)`` on ``stream`` (asynchronous: one side is pinned host memory).

        Contiguous byte-for-byte copies (what the staging engines queue) go to ``cudaMemcpyAsync``
        of the runtime torch loaded, on the stream's raw handle: measured on an H200 host, the
        ``torch.cuda.stream(...)`` + ``copy_`` way costs ~42 us of the calling thread per copy --
        8 copies of 2 MiB chunks put 0.34 ms of host time on a 16 MiB message's receive path.
        Anything else, or a runtime call that fails, takes torch's way.
        """
        memcpy = _memcpy_async()
        if (memcpy is not None and dst.dtype == src.dtype and dst.numel() == src.numel()
                and dst.is_contiguous() and src.is_contiguous()):
            if memcpy(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size(), stream):
                return
        import torch

        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)


_DEFAULT_OPS = CudaOps()


def _break(transport: Any, why: str) -> None:
    """The chunk stream of a tag can no longer be framed: close the link so both sides see an error, not wrong data."""
    log.warning("tensorwire: %s; closing the link (the chunk stream on this tag lost its framing)", why)
    try:
        transport.close()
    except Exception:  # noqa: BLE001 - best effort, the original error is what the caller sees
        pass


class StagedSender:
    """Sends one static CUDA tensor over a host-only transport as ``len(plan)`` messages, D2H overlapped with the socket.

    Owns views of the pinned host send slot, cut by the plan, and one event
    per chunk (per device), created once. :meth:`send`:

    1. records an event on the caller's current stream and makes the copy
       stream wait on it (the copies see every write queued before ``send``);
    2. queues all device->host copies on the copy stream, recording chunk *i*'s
       event after its copy;
    3. for each chunk: wait for its event, then ``transport.send`` it (the socket
       sends chunk *i* while the copy engine moves chunk *i+1*).

    Returns after the last chunk is out: every queued copy has completed, so
    the source tensor may be overwritten or freed right away.
    """

    def __init__(self, host: "torch.Tensor", plan: tuple[tuple[int, int], ...], *, ops: Any = None) -> None:
        if not plan or sum(n for _, n in plan) != host.numel():
            raise ValueError(f"plan {plan[:3]}... does not cover the {host.numel()}-byte host slot")
        self.plan = plan
        self.ops = ops or _DEFAULT_OPS
        self.chunks = [host[off : off + n] for off, n in plan]
        # (ordered-after-current event, per-chunk events) per device the tensors come from
        self._events: dict[Any, tuple[Any, list[Any]]] = {}

    def _events_for(self, device: Any) -> tuple[Any, list[Any]]:
        ev = self._events.get(device)
        if ev is None:
            ev = self._events[device] = (self.ops.new_event(), [self.ops.new_event() for _ in self.plan])
        return ev

    def send(self, transport: Any, tag: int, src: "torch.Tensor", *, step: int, timeout: float | None,
             current: Any, side: Any) -> int:
        """Send the flat uint8 device tensor ``src``; messages carry steps ``step+1 ...``; returns the last step.

        ``current``: the stream the caller's writes to ``src`` were queued on;
        ``side``: the copy stream. ``timeout`` bounds each chunk's wait (for
        the receiver's credit, then for its bytes to go out), not the whole
        message: a deadline running out half-way would break the message.

        Raises:
            whatever ``transport.send`` raises. If that happens after the first
            chunk went out, the transport is closed first (the peer sees the
            link lost, never a message mixed from two tensors).
        """
        ordered, events = self._events_for(src.device)
        ops = self.ops
        ordered.record(current)
        side.wait_event(ordered)
        for (off, n), chunk, ev in zip(self.plan, self.chunks, events):
            ops.copy(chunk, src[off : off + n], side)
            ev.record(side)
        sent = 0
        try:
            for chunk, ev in zip(self.chunks, events):
                ev.synchronize()
                transport.send(tag, chunk, step=step + sent + 1, timeout=timeout)
                sent += 1
        except BaseException as exc:
            events[-1].synchronize()  # no copy may still read src once we return, even with an error
            if sent:
                _break(transport, f"staged send on tag {tag} failed after {sent}/{len(self.plan)} chunks ({exc!r})")
            raise
        return step + sent


class StagedReceiver:
    """Receives one static CUDA spec over a host-only transport into a device slot, H2D overlapped with the socket.

    Two pinned host slots, each cut by the plan; every chunk is posted as its
    own receive, so the peer may send the next message while this one is
    being copied (Link's receive double-buffering). :meth:`recv`:

    1. re-posts the host slot of the previous message, after waiting for the
       event that ends the copies out of it;
    2. records an event on the caller's current stream and makes the copy
       stream wait on it (work already queued that still reads the device slot
       — the previous message — runs before it is overwritten);
    3. waits for each chunk in turn and queues its host->device copy at once;
    4. records the end of the copies and makes the current stream wait on it,
       so the device slot is ready for any later work on the current stream.

    A :class:`~tensorwire.TransferTimeout` in step 3 loses nothing: the next
    call resumes at the chunk it was waiting for.
    """

    def __init__(self, hosts: "list[torch.Tensor]", device_buf: "torch.Tensor", plan: tuple[tuple[int, int], ...],
                 *, ops: Any = None) -> None:
        if len(hosts) != 2 or not plan or any(sum(n for _, n in plan) != h.numel() for h in (*hosts, device_buf)):
            raise ValueError("StagedReceiver needs two host slots and a device slot, all covered by the plan")
        self.plan = plan
        self.ops = ops or _DEFAULT_OPS
        self.chunks = [[h[off : off + n] for off, n in plan] for h in hosts]
        self.dev_chunks = [device_buf[off : off + n] for off, n in plan]
        self.copied = [self.ops.new_event(), self.ops.new_event()]  # end of the H2D copies out of host slot i
        self.ordered = self.ops.new_event()  # the current stream's position when a recv started
        self.next = 0  # host slot the next message lands in
        self.pos = 0  # chunks of that message already waited for and copied
        self.pending: int | None = None  # host slot to re-post once its copies are done

    def post(self, transport: Any, tag: int, index: int) -> None:
        """Post every chunk of host slot ``index`` (in plan order: the transport fills them FIFO)."""
        for chunk in self.chunks[index]:
            transport.post_recv(tag, chunk, header=False)

    def post_all(self, transport: Any, tag: int) -> None:
        self.post(transport, tag, 0)
        self.post(transport, tag, 1)

    def recv(self, transport: Any, tag: int, *, timeout: float | None, current: Any, side: Any) -> int:
        """Receive the next message into the device slot; returns its byte count. See the class docstring.

        Raises:
            TransferTimeout: a chunk did not arrive in time (resumable).
            ProtocolError: a chunk's size differs from the plan (the peer cuts
                differently: ``TENSORWIRE_STAGING_CHUNK`` differs); the link is closed.
            PeerLostError, ClosedError.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        ops = self.ops
        if self.pending is not None:
            self.copied[self.pending].synchronize()
            self.post(transport, tag, self.pending)
            self.pending = None
        idx = self.next
        self.ordered.record(current)
        side.wait_event(self.ordered)
        host = self.chunks[idx]
        for i in range(self.pos, len(self.plan)):
            left = remaining(deadline)
            got = transport.wait_recv(tag, timeout=left if left is None else max(0.0, left))
            n = self.plan[i][1]
            if got.nbytes != n:
                from .errors import ProtocolError

                msg = (f"staged receive on tag {tag}: chunk {i} of {len(self.plan)} carried {got.nbytes} bytes, "
                       f"expected {n} (is {STAGING_CHUNK_ENV} the same on both sides?)")
                _break(transport, msg)
                raise ProtocolError(msg)
            ops.copy(self.dev_chunks[i], host[i], side)
            self.pos = i + 1
        self.copied[idx].record(side)
        current.wait_event(self.copied[idx])
        self.pending = idx
        self.next = idx ^ 1
        self.pos = 0
        return self.plan[-1][0] + self.plan[-1][1]
