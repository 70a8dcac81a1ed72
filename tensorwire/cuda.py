"""CUDA bindings of the data path: allocator check, IPC-safe CUDA slots, stream ordering.

The chunked staging engines built on them live in :mod:`tensorwire.p2p.staging`.

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

**Stream memory operations.** :class:`StreamMemOps` binds the driver's
``cuStreamWaitValue32`` (the v2 entry point of CUDA >= 11.7, available on every
platform; the v1 one only where the driver enables it) and allocates words of
device-mapped pinned host memory: a stream can then be made to wait, on the GPU,
until the host writes a value there (:mod:`tensorwire.distributed.streams`).

**Host memory the GPU reads in place** (``cudaHostRegister``):
:mod:`tensorwire.hostmap`, through the runtime library :func:`cudart` loads.

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
from typing import TYPE_CHECKING, Any, Callable, Mapping


if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "expandable_segments",
    "check_allocator",
    "AllocatorReport",
    "alloc_cuda",
    "CudaBuffer",
    "sync_current_stream",
    "current_raw_stream",
    "StreamMemOps",
    "stream_mem_ops",
    "cudart",
]

log = logging.getLogger(__name__)

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
            settings = torch._C._accelerator_getAllocatorSettings()
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
                    "memory. tensorwire allocates its CUDA slots with cudaMalloc (tensorwire.cuda.alloc_cuda), "
                    "but tensors you send from the caching allocator cross over the slower path "
                    "(unset expandable_segments to avoid that)",
                    rep.source,
                )
    return rep


# -- IPC-safe device memory ------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def cudart() -> Any:
    """The CUDA runtime library torch itself loaded (or any libcudart found), loaded once.

    Raises:
        OSError: no libcudart could be loaded.
    """
    import torch

    candidates = []
    base = os.path.dirname(torch.__file__)
    for pat in (
        os.path.join(base, "lib", "libcudart.so*"),
        os.path.join(os.path.dirname(base), "nvidia", "cuda_runtime", "lib", "libcudart.so*"),
        os.path.join(os.path.dirname(base), "nvidia", "cu*", "lib", "libcudart.so*"),
    ):
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
def memcpy_async() -> Any:
    """``f(dst_ptr, src_ptr, nbytes, stream) -> bool``: ``cudaMemcpyAsync(..., cudaMemcpyDefault, raw stream)``
    with ``stream``'s device current; False when it failed (the error is cleared: the caller takes torch's way).
    None when the runtime or torch lacks what this needs."""
    try:
        lib = cudart()
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
        lib = cudart()
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
        err = int(fn(raw(idx)))
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
    return bool(err == 0)


def sync_current_stream(device: "torch.device") -> None:
    """Block until the work queued so far on ``device``'s current stream is done (see :func:`_on_current_stream`)."""
    if _on_current_stream("cudaStreamSynchronize", (0,))(device) is None:
        import torch

        torch.cuda.current_stream(device).synchronize()


class CudaBuffer:
    """Owner of one ``cudaMalloc`` allocation, exposed through ``__cuda_array_interface__`` (uint8, flat)."""

    def __init__(self, nbytes: int, device: int) -> None:
        lib = cudart()
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
            import cupy

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


def current_raw_stream(device: int) -> int:
    """The raw ``cudaStream_t`` of the current stream of CUDA device ``device`` (0: the legacy default stream).
    Torch's function is looked up once: per message, an ``import`` and a lookup cost ~0.7 us on the 2-core VM."""
    fn = _RAW_STREAM[0]
    if fn is None:
        fn = _RAW_STREAM[0] = _raw_stream_fn()
    return int(fn(device))


def _raw_stream_fn() -> Callable[[int], int]:
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return raw  # type: ignore[no-any-return]
    return lambda device: int(torch.cuda.current_stream(device).cuda_stream)


_RAW_STREAM: list[Callable[[int], int] | None] = [None]


# -- stream memory operations (CUDA driver API) -----------------------------------------------------------

_CU_STREAM_NON_BLOCKING = 0x1
_CU_MEMHOSTALLOC_PORTABLE = 0x1
_CU_MEMHOSTALLOC_DEVICEMAP = 0x2
#: cuStreamWaitValue32 flag: wait until (int32_t)(*addr - value) >= 0 -- a cyclic comparison made for sequence numbers
CU_STREAM_WAIT_VALUE_GEQ = 0x0
_CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1 = 92
#: how long the probe waits for a stream to see a host write to a mapped word
_PROBE_S = 2.0


@functools.lru_cache(maxsize=1)
def _libcuda() -> Any:
    """The CUDA driver library (the one the runtime torch loaded uses)."""
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("libcuda (the CUDA driver library) not found")


def _bind(lib: Any, name: str, argtypes: list[Any]) -> Any:
    fn = getattr(lib, name)
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


class StreamMemOps:
    """A stream waits, on the GPU, for a 32-bit word of mapped pinned host memory (CUDA driver API via ctypes).

    - :meth:`unusable` says why this device cannot (None: it can): the driver's
      entry point, the device attribute for the v1 API, and a probe (a stream
      waits for a word, the host writes it, the stream must go on);
    - :meth:`alloc_words` allocates device-mapped pinned host memory
      (``cuMemHostAlloc(PORTABLE | DEVICEMAP)``: usable from every device);
    - :meth:`wait_geq` queues ``cuStreamWaitValue32(stream, addr, value, GEQ)``.

    Driver calls run with the device's primary context current (the one torch
    uses), pushed for the call when the calling thread has another or none.

    Raises (constructor):
        OSError: no CUDA driver. AttributeError: a driver without stream memory operations.
    """

    def __init__(self, lib: Any) -> None:
        c = ctypes
        self._lib = lib
        self._init = _bind(lib, "cuInit", [c.c_uint])
        self._version = _bind(lib, "cuDriverGetVersion", [c.POINTER(c.c_int)])
        self._device_get = _bind(lib, "cuDeviceGet", [c.POINTER(c.c_int), c.c_int])
        self._attribute = _bind(lib, "cuDeviceGetAttribute", [c.POINTER(c.c_int), c.c_int, c.c_int])
        self._retain = _bind(lib, "cuDevicePrimaryCtxRetain", [c.POINTER(c.c_void_p), c.c_int])
        self._get_current = _bind(lib, "cuCtxGetCurrent", [c.POINTER(c.c_void_p)])
        self._push = _bind(lib, "cuCtxPushCurrent_v2", [c.c_void_p])
        self._pop = _bind(lib, "cuCtxPopCurrent_v2", [c.POINTER(c.c_void_p)])
        self._host_alloc = _bind(lib, "cuMemHostAlloc", [c.POINTER(c.c_void_p), c.c_size_t, c.c_uint])
        self._device_pointer = _bind(lib, "cuMemHostGetDevicePointer_v2", [c.POINTER(c.c_uint64), c.c_void_p, c.c_uint])
        self._stream_create = _bind(lib, "cuStreamCreate", [c.POINTER(c.c_void_p), c.c_uint])
        self._stream_query = _bind(lib, "cuStreamQuery", [c.c_void_p])
        self._stream_destroy = _bind(lib, "cuStreamDestroy_v2", [c.c_void_p])
        self._error_name = getattr(lib, "cuGetErrorName", None)
        if self._error_name is not None:
            self._error_name.argtypes = [c.c_int, c.POINTER(c.c_char_p)]
            self._error_name.restype = c.c_int
        self.api = "v2"
        wait = getattr(lib, "cuStreamWaitValue32_v2", None)
        if wait is None:
            self.api = "v1"
            wait = lib.cuStreamWaitValue32
        wait.argtypes = [c.c_void_p, c.c_uint64, c.c_uint32, c.c_uint]
        wait.restype = c.c_int
        self._wait = wait
        self._contexts: dict[int, int] = {}
        self._devices: dict[int, int] = {}
        self._verdicts: dict[int, str | None] = {}
        self._lock = threading.Lock()

    # -- helpers ------------------------------------------------------------------------------------------
    def error_text(self, code: int) -> str:
        if self._error_name is not None:
            name = ctypes.c_char_p()
            if self._error_name(code, ctypes.byref(name)) == 0 and name.value:
                return f"{name.value.decode()} ({code})"
        return f"CUDA driver error {code}"

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise OSError(f"{what}: {self.error_text(code)}")

    def _context(self, device: int) -> int:
        ctx = self._contexts.get(device)
        if ctx is None:
            self._check(self._init(0), "cuInit")
            dev = ctypes.c_int()
            self._check(self._device_get(ctypes.byref(dev), device), f"cuDeviceGet({device})")
            handle = ctypes.c_void_p()
            self._check(self._retain(ctypes.byref(handle), dev), f"cuDevicePrimaryCtxRetain({device})")
            self._devices[device] = dev.value
            ctx = self._contexts[device] = int(handle.value or 0)
        return ctx

    def _enter(self, device: int) -> bool:
        """Make ``device``'s primary context current; True when it was pushed (then :meth:`_leave`)."""
        ctx = self._context(device)
        cur = ctypes.c_void_p()
        if self._get_current(ctypes.byref(cur)) == 0 and int(cur.value or 0) == ctx:
            return False
        self._check(self._push(ctypes.c_void_p(ctx)), "cuCtxPushCurrent")
        return True

    def _leave(self, pushed: bool) -> None:
        if pushed:
            self._pop(ctypes.byref(ctypes.c_void_p()))

    # -- the interface ------------------------------------------------------------------------------------
    def alloc_words(self, nbytes: int, device: int) -> tuple[int, int]:
        """``nbytes`` of zeroed, device-mapped, portable pinned host memory: (host address, device address).

        Never freed by tensorwire (a stream may poll it until the process ends).

        Raises:
            OSError: the driver refused.
        """
        pushed = self._enter(device)
        try:
            host = ctypes.c_void_p()
            flags = _CU_MEMHOSTALLOC_PORTABLE | _CU_MEMHOSTALLOC_DEVICEMAP
            self._check(self._host_alloc(ctypes.byref(host), nbytes, flags), f"cuMemHostAlloc({nbytes})")
            addr = int(host.value or 0)
            ctypes.memset(addr, 0, nbytes)
            dptr = ctypes.c_uint64()
            self._check(self._device_pointer(ctypes.byref(dptr), ctypes.c_void_p(addr), 0), "cuMemHostGetDevicePointer")
            return addr, int(dptr.value)
        finally:
            self._leave(pushed)

    def wait_geq(self, device: int, stream: int, device_addr: int, value: int) -> int:
        """Queue on ``stream`` (a raw handle of ``device``; 0: the legacy default stream) a wait until the word at
        ``device_addr`` is at or past ``value`` (cyclic). Returns the driver's result code (0: queued)."""
        try:
            pushed = self._enter(device)
        except OSError:
            return -1
        try:
            return int(self._wait(ctypes.c_void_p(stream), device_addr, value & 0xFFFFFFFF, CU_STREAM_WAIT_VALUE_GEQ))
        finally:
            self._leave(pushed)

    def unusable(self, device: int) -> str | None:
        """Why streams of ``device`` cannot wait on host words here (None: they can). Probed once per device."""
        with self._lock:
            if device not in self._verdicts:
                try:
                    self._verdicts[device] = self._probe(device)
                except OSError as exc:
                    self._verdicts[device] = str(exc)
            return self._verdicts[device]

    def _probe(self, device: int) -> str | None:
        version = ctypes.c_int()
        self._check(self._version(ctypes.byref(version)), "cuDriverGetVersion")
        if self.api == "v1":
            enabled = ctypes.c_int()
            self._context(device)
            cu_device = self._devices[device]
            self._check(
                self._attribute(ctypes.byref(enabled), _CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1, cu_device),
                "cuDeviceGetAttribute(CAN_USE_STREAM_MEM_OPS)",
            )
            if not enabled.value:
                return (
                    f"driver {version.value} has only the v1 stream memory operations, and they are disabled "
                    "(CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS = 0; NVreg_EnableStreamMemOPs=1 enables them)"
                )
        host, dev_addr = self.alloc_words(64, device)
        word = ctypes.c_uint32.from_address(host)
        word.value = 1
        pushed = self._enter(device)
        try:
            stream = ctypes.c_void_p()
            self._check(self._stream_create(ctypes.byref(stream), _CU_STREAM_NON_BLOCKING), "cuStreamCreate")
            err = int(self._wait(stream, dev_addr, 2, CU_STREAM_WAIT_VALUE_GEQ))
            if err != 0:
                return f"cuStreamWaitValue32 ({self.api}) failed: {self.error_text(err)}"
            word.value = 2  # the stream must see this host write and go on
            deadline = time.monotonic() + _PROBE_S
            while True:
                err = int(self._stream_query(stream))
                if err == 0:
                    self._stream_destroy(stream)
                    return None
                if err != _CUDA_ERROR_NOT_READY:
                    return f"a stream waiting on a mapped host word failed: {self.error_text(err)}"
                if time.monotonic() > deadline:
                    return f"a stream waiting on a mapped host word did not see the host's write within {_PROBE_S} s"
                time.sleep(0.0005)
        finally:
            self._leave(pushed)


@functools.lru_cache(maxsize=1)
def stream_mem_ops() -> StreamMemOps | None:
    """The driver's stream memory operations, or None where the driver or its entry points are missing."""
    try:
        return StreamMemOps(_libcuda())
    except (OSError, AttributeError) as exc:
        log.debug("no CUDA stream memory operations: %s", exc)
        return None
