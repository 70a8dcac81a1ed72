"""The CUDA driver calls of the copy-engine path, behind one small class (:class:`CeDriver`).

Everything the copy-engine path asks of CUDA is here: export an allocation
(``cuIpcGetMemHandle`` on the allocation's base, found with
``cuPointerGetAttributes``), open a peer's export **in the calling device's own
context** with lazy peer access (opened in the owner's context instead, copies
from another device stage through the host and stream memory operations on the
mapping fail), register shared host pages with the GPU, and queue copy-engine
copies (``cuMemcpyAsync``), flag writes (``cuStreamWriteValue32``) and flag waits
(``cuStreamWaitValue32``, cyclic ``>=``) on streams.

The CPU tests replace this class with a simulator of the same methods
(``tests/support/ce_sim.py``); the protocol above it never calls CUDA itself.

Every call runs with the device's primary context current (the one torch uses),
made current for the calling thread when it has another or none.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Callable, ClassVar

from ...errors import TensorWireError
from ...settings import setting
from .cstructs import HANDLE_BYTES, IpcHandle, MemOp

__all__ = ["CeDriver", "BindingsCalls", "DriverError", "NotExportable", "HANDLE_BYTES", "FLAG_PTX", "pick_bindings"]

_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1
_CU_MEMHOSTREGISTER_PORTABLE = 0x1
_CU_MEMHOSTREGISTER_DEVICEMAP = 0x2
_CU_STREAM_NON_BLOCKING = 0x1
_CU_EVENT_DISABLE_TIMING = 0x2
_CU_STREAM_WAIT_VALUE_GEQ = 0x0
_CU_STREAM_WRITE_VALUE_DEFAULT = 0x0  # with a memory barrier: earlier writes are visible first
_CU_POINTER_ATTRIBUTE_BUFFER_ID = 7
_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9
_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11
_CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12
_CU_STREAM_MEM_OP_WAIT_VALUE_32 = 1
_CU_STREAM_MEM_OP_WRITE_VALUE_32 = 2
_CUDA_ERROR_NOT_READY = 600
_CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712


class DriverError(TensorWireError):
    """A CUDA driver call of the copy-engine path failed (the message names the call and the error)."""


class NotExportable(DriverError):
    """This allocation cannot be exported with legacy CUDA IPC (``cuMem*`` / expandable-segment memory)."""


def _lib() -> Any:
    # PyDLL: the calls keep the GIL. They queue work and return in microseconds; releasing the GIL around each
    # would let another Python thread take it, and taking it back can cost up to the interpreter's switch interval.
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            return ctypes.PyDLL(name)
        except OSError:
            continue
    raise DriverError("libcuda (the CUDA driver library) not found")


def pick_bindings(choice: str, load: Callable[[], Any], driver_major: int) -> tuple[Any, str]:
    """cuda-python's driver module for the per-message calls, or None for ctypes; and why, in words.

    ``choice``: ``TENSORWIRE_CE_BINDINGS`` (``auto``, ``cuda-python`` or ``ctypes``); ``load()`` imports
    ``cuda.bindings.driver`` (raises ImportError where it is not installed); ``driver_major``: the CUDA major
    version of the installed driver (bindings of a newer major than the driver's are not used: their entry
    points may be missing from it).

    Raises:
        DriverError: ``cuda-python`` was asked for and cannot be used (says why).
    """
    if choice == "ctypes":
        return None, "ctypes (TENSORWIRE_CE_BINDINGS=ctypes)"
    why = ""
    mod: Any = None
    try:
        mod = load()
    except ImportError as exc:
        why = f"cuda-python's bindings are not installed ({exc}; pip install 'tensorwire[cuda13]' or [cuda12])"
    if mod is not None:
        version = str(getattr(mod, "__version__", "") or _bindings_version())
        head = version.split(".", 1)[0]
        major = int(head) if head.isdigit() else 0
        if not major:
            why = f"cuda-python's bindings of an unknown version ({version!r})"
        elif major > driver_major:
            why = f"cuda-python's bindings {version} are for CUDA {major}, newer than the driver's CUDA {driver_major}"
        else:
            return mod, f"cuda-python's bindings {version}"
    if choice == "cuda-python":
        raise DriverError(f"TENSORWIRE_CE_BINDINGS=cuda-python, but {why}")
    return None, f"ctypes: {why}"


def _bindings_version() -> str:
    try:
        from importlib.metadata import version

        return version("cuda-bindings")
    except Exception:  # noqa: BLE001 - not a distribution this Python knows: unknown
        return ""


def _load_bindings() -> Any:
    from cuda.bindings import driver  # (NVIDIA's Cython bindings; optional: the extras cuda12 / cuda13)

    return driver


def _fn(lib: Any, names: tuple[str, ...], argtypes: list[Any]) -> Any:
    for name in names:
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
            return fn
    raise DriverError(f"the CUDA driver has none of {names}")


#: The flag kernels of captured messages, as PTX the driver compiles for the device once per context. Both run as
#: one thread. ``tw_flag_wait``: until the 32-bit word at ``addr`` reaches ``value`` (cyclic ``>=``, as
#: ``cuStreamWaitValue32``'s GEQ), look at it again every ~0.1 us; then make what its writer wrote before it
#: visible (a system-scope fence) and write 0 there. ``tw_flag_write``: make everything before it visible, then
#: write ``value`` at ``addr``. The words are the region's flags: host memory registered with CUDA.
FLAG_PTX = b"""
.version 7.0
.target sm_70
.address_size 64

.visible .entry tw_flag_wait(.param .u64 addr, .param .u32 value)
{
    .reg .pred p;
    .reg .b32 v, want, d;
    .reg .b64 a;
    ld.param.u64 a, [addr];
    ld.param.u32 want, [value];
LOOK:
    ld.volatile.u32 v, [a];
    sub.s32 d, v, want;
    setp.ge.s32 p, d, 0;
    @p bra DONE;
    nanosleep.u32 100;
    bra LOOK;
DONE:
    fence.acq_rel.sys;
    st.volatile.u32 [a], 0;
    ret;
}

.visible .entry tw_flag_write(.param .u64 addr, .param .u32 value)
{
    .reg .b32 v;
    .reg .b64 a;
    ld.param.u64 a, [addr];
    ld.param.u32 v, [value];
    fence.acq_rel.sys;
    st.volatile.u32 [a], v;
    ret;
}
"""


class BindingsCalls:
    """The copy-engine path's per-message driver calls through cuda-python's bindings (the module ``cb``,
    ``cuda.bindings.driver``): the same as :class:`CeDriver`'s ctypes ones, arguments and errors alike.

    ``error_text(code)``: the words for a failed call's code. Streams and events are handles (ints), wrapped in the
    bindings' types once each.
    """

    def __init__(self, cb: Any, error_text: Callable[[int], str]) -> None:
        self.cb = cb
        self._ok = cb.CUresult.CUDA_SUCCESS
        self._error_text = error_text
        self._streams: dict[int, Any] = {}
        self._events: dict[int, Any] = {}

    def stream(self, stream: int) -> Any:
        s = self._streams.get(stream)
        if s is None:
            if len(self._streams) >= 4096:  # (callers making ever-new streams must not grow it)
                self._streams.clear()
            s = self._streams[stream] = self.cb.CUstream(stream)
        return s

    def event(self, event: int) -> Any:
        e = self._events.get(event)
        if e is None:
            e = self._events[event] = self.cb.CUevent(event)
        return e

    def _check(self, result: Any, what: str) -> None:
        err = result[0]
        if err != self._ok:
            raise DriverError(f"{what}: {self._error_text(int(err))}")

    def copy(self, stream: int, dst: int, src: int, nbytes: int) -> None:
        self._check(self.cb.cuMemcpyAsync(dst, src, nbytes, self.stream(stream)), "cuMemcpyAsync")

    def write(self, stream: int, addr: int, value: int) -> None:
        self._check(
            self.cb.cuStreamWriteValue32(self.stream(stream), addr, value & 0xFFFFFFFF, _CU_STREAM_WRITE_VALUE_DEFAULT),
            "cuStreamWriteValue32",
        )

    def wait(self, stream: int, addr: int, value: int) -> None:
        self._check(
            self.cb.cuStreamWaitValue32(self.stream(stream), addr, value & 0xFFFFFFFF, _CU_STREAM_WAIT_VALUE_GEQ),
            "cuStreamWaitValue32",
        )

    def order(self, after: int, before: int, event: int) -> None:
        ev = self.event(event)
        self._check(self.cb.cuEventRecord(ev, self.stream(before)), "cuEventRecord")
        self._check(self.cb.cuStreamWaitEvent(self.stream(after), ev, 0), "cuStreamWaitEvent")


class CeDriver:
    """The copy-engine path's driver calls (ctypes on ``libcuda``; the per-message ones through cuda-python's
    bindings where installed: :func:`pick_bindings`). One per process (:meth:`get`).

    Raises (constructor):
        DriverError: no driver library, or one without the entry points (CUDA < 11.7).
    """

    _instance: ClassVar["CeDriver | None"] = None
    _instance_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def get(cls) -> "CeDriver":
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def __init__(self) -> None:
        c = ctypes
        lib = _lib()
        p, u64, u32 = c.c_void_p, c.c_uint64, c.c_uint32
        self._init = _fn(lib, ("cuInit",), [c.c_uint])
        self._device_get = _fn(lib, ("cuDeviceGet",), [c.POINTER(c.c_int), c.c_int])
        self._retain = _fn(lib, ("cuDevicePrimaryCtxRetain",), [c.POINTER(p), c.c_int])
        self._get_current = _fn(lib, ("cuCtxGetCurrent",), [c.POINTER(p)])
        self._set_current = _fn(lib, ("cuCtxSetCurrent",), [p])
        self._ipc_get = _fn(lib, ("cuIpcGetMemHandle",), [c.c_char_p, u64])
        self._ipc_open = _fn(
            lib, ("cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle"), [c.POINTER(u64), IpcHandle, c.c_uint]
        )
        self._ipc_close = _fn(lib, ("cuIpcCloseMemHandle",), [u64])
        self._attrs = _fn(lib, ("cuPointerGetAttributes",), [c.c_uint, c.POINTER(c.c_int), c.POINTER(p), u64])
        self._host_register = _fn(lib, ("cuMemHostRegister_v2", "cuMemHostRegister"), [p, c.c_size_t, c.c_uint])
        self._host_unregister = _fn(lib, ("cuMemHostUnregister",), [p])
        self._host_dptr = _fn(
            lib, ("cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer"), [c.POINTER(u64), p, c.c_uint]
        )
        self._memcpy = _fn(lib, ("cuMemcpyAsync",), [u64, u64, c.c_size_t, p])
        self._write = _fn(lib, ("cuStreamWriteValue32_v2", "cuStreamWriteValue32"), [p, u64, u32, c.c_uint])
        self._wait = _fn(lib, ("cuStreamWaitValue32_v2", "cuStreamWaitValue32"), [p, u64, u32, c.c_uint])
        try:  # (one call, one graph node, for a wait and a write: wait_reset)
            self._batch: Any = _fn(
                lib, ("cuStreamBatchMemOp_v2", "cuStreamBatchMemOp"), [p, c.c_uint, c.POINTER(MemOp), c.c_uint]
            )
        except DriverError:
            self._batch = None
        self._stream_create = _fn(lib, ("cuStreamCreate",), [c.POINTER(p), c.c_uint])
        self._stream_query = _fn(lib, ("cuStreamQuery",), [p])
        self._event_create = _fn(lib, ("cuEventCreate",), [c.POINTER(p), c.c_uint])
        self._event_record = _fn(lib, ("cuEventRecord",), [p, p])
        self._stream_wait_event = _fn(lib, ("cuStreamWaitEvent",), [p, p, c.c_uint])
        self._is_capturing = _fn(lib, ("cuStreamIsCapturing",), [p, c.POINTER(c.c_int)])
        self._can_peer = _fn(lib, ("cuDeviceCanAccessPeer",), [c.POINTER(c.c_int), c.c_int, c.c_int])
        self._module_load = _fn(lib, ("cuModuleLoadData",), [c.POINTER(p), c.c_char_p])
        self._module_function = _fn(lib, ("cuModuleGetFunction",), [c.POINTER(p), p, c.c_char_p])
        self._launch = _fn(lib, ("cuLaunchKernel",), [p] + [c.c_uint] * 7 + [p, c.POINTER(p), p])
        self._kernels: dict[int, tuple[int, int] | None] = {}
        self._error_name = getattr(lib, "cuGetErrorName", None)
        if self._error_name is not None:
            self._error_name.argtypes = [c.c_int, c.POINTER(c.c_char_p)]
            self._error_name.restype = c.c_int
        self._contexts: dict[int, int] = {}
        self._lock = threading.Lock()
        self._attr_kinds = (c.c_int * 3)(
            _CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, _CU_POINTER_ATTRIBUTE_RANGE_SIZE, _CU_POINTER_ATTRIBUTE_BUFFER_ID
        )
        self._tls = threading.local()
        self._handle_buf = c.create_string_buffer(HANDLE_BYTES)
        self._export_lock = threading.Lock()
        # The per-message calls (copy, flag write and wait, stream order) go through cuda-python's Cython bindings
        # where they are installed for this driver: a copy's call 0.2-0.7 us shorter than through ctypes on two H200s
        # (bench/results/ce-host-levels_h200x2_2026-11-30.log, ce-host-bindings-ab_h200x2_2026-11-30.log); everything
        # else stays ctypes.
        version = c.c_int()
        self._check(_fn(lib, ("cuDriverGetVersion",), [c.POINTER(c.c_int)])(c.byref(version)), "cuDriverGetVersion")
        module, self.bindings = pick_bindings(setting("ce_bindings"), _load_bindings, version.value // 1000)
        self._bound = BindingsCalls(module, self.error_text) if module is not None else None
        self._calls: BindingsCalls | None = self._bound  # (None: ctypes; see use_bindings)

    def use_bindings(self, on: bool) -> bool:
        """Make the per-message calls through cuda-python's bindings (``on``) or ctypes; returns whether the
        bindings are in use now (False where they could not be loaded). For benchmarks comparing the two."""
        self._calls = self._bound if on else None
        return self._calls is not None

    # -- errors and contexts ------------------------------------------------------------------------------
    def error_text(self, code: int) -> str:
        if self._error_name is not None:
            name = ctypes.c_char_p()
            if self._error_name(code, ctypes.byref(name)) == 0 and name.value:
                return f"{name.value.decode()} ({code})"
        return f"CUDA driver error {code}"

    def _check(self, code: int, what: str) -> None:
        if code != 0:
            raise DriverError(f"{what}: {self.error_text(code)}")

    def context(self, device: int) -> int:
        """The primary context of ``device`` (retained once), made current in the calling thread."""
        ctx = self._contexts.get(device)
        if ctx is None:
            with self._lock:
                ctx = self._contexts.get(device)
                if ctx is None:
                    self._check(self._init(0), "cuInit")
                    dev = ctypes.c_int()
                    self._check(self._device_get(ctypes.byref(dev), device), f"cuDeviceGet({device})")
                    handle = ctypes.c_void_p()
                    self._check(self._retain(ctypes.byref(handle), dev), f"cuDevicePrimaryCtxRetain({device})")
                    ctx = self._contexts[device] = int(handle.value or 0)
        if getattr(self._tls, "ctx", None) != ctx:
            cur = ctypes.c_void_p()
            self._get_current(ctypes.byref(cur))
            if int(cur.value or 0) != ctx:
                self._check(self._set_current(ctypes.c_void_p(ctx)), "cuCtxSetCurrent")
            self._tls.ctx = ctx
        return ctx

    def can_access_peer(self, device: int, peer_device: int) -> bool:
        if device == peer_device:
            return True
        ok = ctypes.c_int()
        self._check(self._can_peer(ctypes.byref(ok), device, peer_device), "cuDeviceCanAccessPeer")
        return bool(ok.value)

    # -- memory ---------------------------------------------------------------------------------------------
    def allocation(self, ptr: int) -> tuple[int, int, int]:
        """``(base, size, buffer id)`` of the allocation holding device address ``ptr`` (one driver call)."""
        out = getattr(self._tls, "attrs", None)
        if out is None:  # per thread: the three results and the array of their addresses, made once
            base, size, buf_id = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_uint64()
            data = (ctypes.c_void_p * 3)(*(ctypes.addressof(v) for v in (base, size, buf_id)))
            out = self._tls.attrs = (base, size, buf_id, data)
        base, size, buf_id, data = out
        self._check(self._attrs(3, self._attr_kinds, data, ptr), "cuPointerGetAttributes")
        return base.value, size.value, buf_id.value

    def device_of(self, ptr: int) -> int:
        """The ordinal of the device whose memory holds ``ptr`` (a mapped peer export: the device it lives on)."""
        kind = (ctypes.c_int * 1)(_CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL)
        ordinal = ctypes.c_int(-1)
        data = (ctypes.c_void_p * 1)(ctypes.addressof(ordinal))
        self._check(self._attrs(1, kind, data, ptr), "cuPointerGetAttributes(device ordinal)")
        return ordinal.value

    def export(self, base: int) -> bytes:
        """The IPC handle (64 bytes) of the allocation starting at ``base``.

        Raises:
            NotExportable: legacy IPC cannot export it (``cuMem*`` / expandable-segment memory).
        """
        with self._export_lock:
            code = self._ipc_get(self._handle_buf, base)
            if code != 0:
                raise NotExportable(f"cuIpcGetMemHandle: {self.error_text(code)}")
            # (a c_char array reads up to its first NUL: take the raw 64 bytes)
            return ctypes.string_at(self._handle_buf, HANDLE_BYTES)

    def open(self, handle: bytes) -> int:
        """Map a peer's export in the current context (lazy peer access); returns the device address of its base."""
        if len(handle) != HANDLE_BYTES:
            raise DriverError(f"an IPC handle is {HANDLE_BYTES} bytes, got {len(handle)}")
        raw = IpcHandle.from_buffer_copy(handle)  # (a struct, passed by value as the C API takes it)
        out = ctypes.c_uint64()
        self._check(self._ipc_open(ctypes.byref(out), raw, _CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle")
        return int(out.value)

    def close(self, dptr: int) -> None:
        self._ipc_close(dptr)

    def register_host(self, addr: int, nbytes: int) -> int:
        """Pin and map host pages for every context (portable); returns their device address."""
        code = self._host_register(
            ctypes.c_void_p(addr), nbytes, _CU_MEMHOSTREGISTER_PORTABLE | _CU_MEMHOSTREGISTER_DEVICEMAP
        )
        if code not in (0, _CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED):
            self._check(code, f"cuMemHostRegister({nbytes} bytes)")
        out = ctypes.c_uint64()
        self._check(self._host_dptr(ctypes.byref(out), ctypes.c_void_p(addr), 0), "cuMemHostGetDevicePointer")
        return int(out.value)

    def unregister_host(self, addr: int) -> None:
        self._host_unregister(ctypes.c_void_p(addr))

    # -- stream work ----------------------------------------------------------------------------------------
    def new_stream(self) -> int:
        s = ctypes.c_void_p()
        self._check(self._stream_create(ctypes.byref(s), _CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        return int(s.value or 0)

    def new_event(self) -> int:
        e = ctypes.c_void_p()
        self._check(self._event_create(ctypes.byref(e), _CU_EVENT_DISABLE_TIMING), "cuEventCreate")
        return int(e.value or 0)

    def order(self, after: int, before: int, event: int) -> None:
        """Work queued on stream ``after`` from now on runs after the work queued on ``before`` so far."""
        calls = self._calls
        if calls is not None:
            calls.order(after, before, event)
            return
        self._check(self._event_record(event, before), "cuEventRecord")
        self._check(self._stream_wait_event(after, event, 0), "cuStreamWaitEvent")

    def copy(self, stream: int, dst: int, src: int, nbytes: int) -> None:
        calls = self._calls
        if calls is not None:
            calls.copy(stream, dst, src, nbytes)
            return
        self._check(self._memcpy(dst, src, nbytes, stream), "cuMemcpyAsync")

    def write(self, stream: int, addr: int, value: int) -> None:
        calls = self._calls
        if calls is not None:
            calls.write(stream, addr, value)
            return
        self._check(
            self._write(stream, addr, value & 0xFFFFFFFF, _CU_STREAM_WRITE_VALUE_DEFAULT), "cuStreamWriteValue32"
        )

    def wait(self, stream: int, addr: int, value: int) -> None:
        calls = self._calls
        if calls is not None:
            calls.wait(stream, addr, value)
            return
        self._check(self._wait(stream, addr, value & 0xFFFFFFFF, _CU_STREAM_WAIT_VALUE_GEQ), "cuStreamWaitValue32")

    def wait_reset(self, stream: int, addr: int, value: int) -> None:
        """``stream`` waits until the word at ``addr`` reaches ``value``, then writes 0 there: one batch of two
        stream memory operations (one call; captured, one graph node instead of two -- a replay's host time grows
        with its nodes). Where the driver refuses the batch, the two operations one by one."""
        wait = (_CU_STREAM_MEM_OP_WAIT_VALUE_32, addr, value, _CU_STREAM_WAIT_VALUE_GEQ)
        if not self._batch2(stream, wait, (_CU_STREAM_MEM_OP_WRITE_VALUE_32, addr, 0, _CU_STREAM_WRITE_VALUE_DEFAULT)):
            self.wait(stream, addr, value)
            self.write(stream, addr, 0)

    def write_wait(self, stream: int, waddr: int, wvalue: int, addr: int, value: int) -> None:
        """``write(stream, waddr, wvalue)``, then ``wait(stream, addr, value)``: one batch of two stream memory
        operations, one driver call instead of two (a Link's receive). Where the driver refuses the batch, the
        two one by one."""
        write = (_CU_STREAM_MEM_OP_WRITE_VALUE_32, waddr, wvalue, _CU_STREAM_WRITE_VALUE_DEFAULT)
        if not self._batch2(stream, write, (_CU_STREAM_MEM_OP_WAIT_VALUE_32, addr, value, _CU_STREAM_WAIT_VALUE_GEQ)):
            self.write(stream, waddr, wvalue)
            self.wait(stream, addr, value)

    def _batch2(self, stream: int, *ops: tuple[int, int, int, int]) -> bool:
        """Queue ``ops`` (``(operation, address, 32-bit value, flags)``, in that order) as one
        ``cuStreamBatchMemOp``; False where the driver has none or refuses it (then it is not asked again)."""
        batch = self._batch
        if batch is None:
            return False
        arr = (MemOp * len(ops))()
        for op, (operation, address, value, flags) in zip(arr, ops):
            op.operation, op.address, op.value, op.flags = operation, address, value & 0xFFFFFFFF, flags
        if batch(stream, len(ops), arr, 0) == 0:
            return True
        self._batch = None  # (refused: not tried again)
        return False

    # -- flag kernels (captured messages: a replay's host time does not grow with them) -----------------
    def flag_kernels(self, device: int) -> bool:
        """Load the two flag kernels (:data:`FLAG_PTX`) into ``device``'s context, once; False where the driver
        refuses them (the caller then uses stream memory operations). Call outside any graph capture."""
        got = self._kernels.get(device, 0)
        if got == 0:
            self.context(device)
            mod, wait, write = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
            ok = (
                self._module_load(ctypes.byref(mod), FLAG_PTX) == 0
                and self._module_function(ctypes.byref(wait), mod, b"tw_flag_wait") == 0
                and self._module_function(ctypes.byref(write), mod, b"tw_flag_write") == 0
            )
            got = self._kernels[device] = (int(wait.value or 0), int(write.value or 0)) if ok else None
        return got is not None

    def kernel_wait_reset(self, device: int, stream: int, addr: int, value: int) -> None:
        """What :meth:`wait_reset` does, by a one-thread kernel on ``stream`` (one kernel node when captured:
        ~0.01 us of host per replay against ~2 us for a memory-operation node; it polls the word, sleeping
        0.1 us between looks)."""
        self._kernel(device, 0, stream, addr, value, "tw_flag_wait")

    def kernel_write(self, device: int, stream: int, addr: int, value: int) -> None:
        """What :meth:`write` does, by a one-thread kernel on ``stream`` (earlier work's writes visible first)."""
        self._kernel(device, 1, stream, addr, value, "tw_flag_write")

    def _kernel(self, device: int, which: int, stream: int, addr: int, value: int, name: str) -> None:
        fns = self._kernels.get(device)
        if not fns:
            raise DriverError(f"{name}: the flag kernels are not loaded on device {device}")
        a, v = ctypes.c_uint64(addr), ctypes.c_uint32(value & 0xFFFFFFFF)
        args = (ctypes.c_void_p * 2)(ctypes.addressof(a), ctypes.addressof(v))
        self._check(self._launch(fns[which], 1, 1, 1, 1, 1, 1, 0, stream, args, None), f"cuLaunchKernel({name})")

    def capturing(self, stream: int) -> bool:
        """Whether ``stream`` is being captured into a CUDA graph (its work is recorded, not run).

        The legacy default stream (``0``: torch's default stream) cannot be captured (CUDA refuses to begin a
        capture on it), so for it there is no driver call: the common eager case saves ~2 us per isend/irecv.
        """
        if stream == 0:
            return False
        status = getattr(self._tls, "status", None)
        if status is None:
            status = self._tls.status = ctypes.c_int()
        self._check(self._is_capturing(stream, ctypes.byref(status)), "cuStreamIsCapturing")
        return status.value != 0

    def idle(self, stream: int) -> bool:
        code = int(self._stream_query(stream))
        if code == _CUDA_ERROR_NOT_READY:
            return False
        self._check(code, "cuStreamQuery")
        return True

    def copy_tensor(self, stream: int, dst: Any, src: Any) -> None:
        """Queue ``dst.copy_(src)`` (torch's copy: any strides) on ``stream`` of their device."""
        import torch

        # (stream 0 is the legacy default stream -- torch's default stream; torch.cuda.ExternalStream(0) is not
        # that stream but a new one from torch's pool, unordered with the caller's work)
        if stream == 0:
            target = torch.cuda.default_stream(dst.device)
        else:
            target = torch.cuda.ExternalStream(stream, device=dst.device)
        with torch.cuda.stream(target):
            dst.copy_(src)
