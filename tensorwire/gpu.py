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
  *current* stream of the tensor's device (:class:`StreamFence` records an
  event there and waits on it: it blocks only until the writes to this tensor's
  stream are done, not the whole device);
- a received CUDA slot is safe to use on the receiver's current stream: UCX
  completes a receive only after its copies into device memory finished, and
  the TCP-staged path queues its host->device copy on the current stream.

**Overlapped staging** for transports that cannot reach GPU memory (TCP):
:func:`staged_chunks` copies a CUDA tensor into a pinned host slot chunk by
chunk on a side stream and yields each chunk as soon as its copy is done, so
the socket sends chunk *i* while the GPU copies chunk *i+1*.
:func:`staged_send` uses it when the transport can take a payload in chunks
(``send_chunks``), and otherwise copies the whole tensor then sends.

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
from typing import TYPE_CHECKING, Any, Iterator, Mapping

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "expandable_segments",
    "check_allocator",
    "AllocatorReport",
    "alloc_cuda",
    "CudaBuffer",
    "StreamFence",
    "staged_chunks",
    "staged_send",
    "DEFAULT_CHUNK",
]

log = logging.getLogger(__name__)

#: Chunk of the overlapped device->host staging (large enough to keep PCIe/NVLink busy, small enough to overlap).
DEFAULT_CHUNK = 4 << 20
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


def alloc_cuda(nbytes: int, device: "torch.device | int | None" = None) -> "torch.Tensor":
    """A flat uint8 CUDA tensor of ``nbytes`` from plain ``cudaMalloc`` (CUDA-IPC-able whatever the allocator conf).

    The tensor keeps its :class:`CudaBuffer` alive (freed with the last tensor
    viewing it). Falls back to CuPy, then to ``torch.empty`` with a warning if
    the CUDA runtime cannot be loaded.
    """
    import torch

    if isinstance(device, int):
        index = device
    else:
        dev = torch.device(device) if device is not None else None
        index = dev.index if dev is not None and dev.index is not None else torch.cuda.current_device()
    try:
        owner: Any = CudaBuffer(nbytes, index)
    except OSError:
        try:
            import cupy  # type: ignore[import-not-found]

            with cupy.cuda.Device(index):
                mem = cupy.cuda.Memory(max(1, nbytes))
                owner = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
        except ImportError:
            log.warning("tensorwire: neither libcudart nor CuPy available: CUDA slot from the caching allocator")
            check_allocator()
            return torch.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", index))
    t = torch.as_tensor(owner, device=torch.device("cuda", index))
    if t.data_ptr() != int(owner.__cuda_array_interface__["data"][0]) and nbytes:
        raise RuntimeError("torch copied the cudaMalloc buffer instead of wrapping it")
    return t


# -- stream ordering ---------------------------------------------------------------------------


class StreamFence:
    """Orders host-side transport work after GPU work queued on a stream, without a device-wide sync.

    One reusable event per fence (no allocation per step):

    - :meth:`before_send`: the bytes of ``tensor`` are final once the work queued
      so far on its current stream is done; wait for exactly that;
    - :meth:`after_copy`: record the end of a copy queued on ``stream``;
      :meth:`wait` blocks until it completed (e.g. before re-posting a host slot
      that a device copy is still reading).
    """

    def __init__(self, device: "torch.device | None" = None) -> None:
        import torch

        self.event = torch.cuda.Event(blocking=False)
        self.device = device
        self.pending = False

    def before_send(self, tensor: "torch.Tensor") -> None:
        import torch

        self.event.record(torch.cuda.current_stream(tensor.device))
        self.event.synchronize()

    def after_copy(self, stream: "torch.cuda.Stream | None" = None) -> None:
        import torch

        self.event.record(stream or torch.cuda.current_stream(self.device))
        self.pending = True

    def wait(self) -> None:
        if self.pending:
            self.event.synchronize()
            self.pending = False

    def done(self) -> bool:
        return not self.pending or bool(self.event.query())


# -- overlapped staging for host-only transports -------------------------------------------------


def staged_chunks(src: "torch.Tensor", host: "torch.Tensor", *, chunk: int = DEFAULT_CHUNK,
                  stream: "torch.cuda.Stream | None" = None) -> Iterator[memoryview]:
    """Copy ``src`` (CUDA, contiguous) into the pinned ``host`` slot chunk by chunk; yield each chunk when ready.

    All copies are queued at once on ``stream`` (a side stream, ordered after
    the work already queued on ``src``'s current stream), with one event per
    chunk; iterating waits for one chunk at a time, so the consumer (a socket)
    sends chunk *i* while the copy engine moves chunk *i+1*. Both tensors are
    flat uint8 views of the same length.
    """
    import torch

    n = src.numel() * src.element_size()
    flat = src.reshape(-1).view(torch.uint8) if src.dtype != torch.uint8 else src.reshape(-1)
    dst = host.reshape(-1)[:n]
    if not host.is_pinned():
        raise ValueError("staged_chunks needs a pinned host slot (a pageable copy cannot overlap)")
    side = stream or torch.cuda.Stream(device=src.device)
    side.wait_stream(torch.cuda.current_stream(src.device))
    events = []
    with torch.cuda.stream(side):
        for off in range(0, n, chunk):
            dst[off : off + chunk].copy_(flat[off : off + chunk], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(side)
            events.append((off, min(chunk, n - off), ev))
    src.record_stream(side)
    mv = memoryview(dst.numpy())
    for off, k, ev in events:
        ev.synchronize()
        yield mv[off : off + k]


def staged_send(transport: Any, tag: int, src: "torch.Tensor", host: "torch.Tensor", *, step: int,
                shape: tuple[int, ...] | None = None, timeout: float | None, chunk: int = DEFAULT_CHUNK) -> None:
    """Send CUDA ``src`` over a host-only transport through the pinned ``host`` slot.

    With a transport that has ``send_chunks(tag, nbytes, chunks, *, step, shape, timeout)``
    (header first, then each chunk as the iterator yields it), device->host
    copies overlap the socket. Otherwise: one copy, wait, one send (what
    :meth:`tensorwire.Link.send` does today).
    """
    import torch

    n = src.numel() * src.element_size()
    send_chunks = getattr(transport, "send_chunks", None)
    if send_chunks is not None and n > chunk:
        send_chunks(tag, n, staged_chunks(src, host, chunk=chunk), step=step, shape=shape, timeout=timeout)
        return
    flat = src.reshape(-1).view(torch.uint8) if src.dtype != torch.uint8 else src.reshape(-1)
    host.reshape(-1)[:n].copy_(flat, non_blocking=True)
    torch.cuda.current_stream(src.device).synchronize()
    transport.send(tag, host.reshape(-1)[:n], step=step, shape=shape, timeout=timeout)
