"""Host memory the GPU reads in place: a range of host memory registered with CUDA, and a CUDA tensor over it.

:func:`map_host` page-locks a range of host memory (``cudaHostRegister``,
portable and mapped) and hands back a CUDA tensor over the same bytes (the
device pointer of the range, through ``__cuda_array_interface__``): a kernel
reading it (an ``index_select``) fetches the bytes over PCIe / C2C straight
from host memory, as the GPU does from a pinned table in SpeedTorch, DGL or
PyG. The serve client maps the daemon's shared-memory slots this way
(:mod:`tensorwire.serve.client.shm_maps`).

The runtime library is the one torch loaded (:func:`tensorwire.cuda.cudart`).
Nothing here initializes CUDA at import.
"""

from __future__ import annotations

import ctypes
from typing import Any

from tensorwire.cuda import cudart

__all__ = ["HostMapping", "map_host"]

_HOST_REGISTER_PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped


class HostMapping:
    """A range of host memory registered with CUDA (:func:`map_host`); ``tensor``: a flat uint8 CUDA tensor
    over it on ``device``. :meth:`close` unregisters it: no kernel may read ``tensor`` after that (the caller
    synchronizes first)."""

    def __init__(self, ptr: int, nbytes: int, device_ptr: int, device: int, lib: Any) -> None:
        self.ptr, self.nbytes, self.device_ptr, self.device = ptr, nbytes, device_ptr, device
        self._lib = lib
        self.tensor: Any = None

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.device_ptr, False), "version": 3}

    def close(self) -> None:
        if self.ptr:
            self.tensor = None
            self._lib.cudaHostUnregister(ctypes.c_void_p(self.ptr))
            self._lib.cudaGetLastError()
            self.ptr = 0


def map_host(ptr: int, nbytes: int, device: int) -> HostMapping:
    """Register host range ``[ptr, ptr + nbytes)`` with CUDA (page-locked, mapped for every device) and make
    a CUDA tensor over it on ``device`` (``HostMapping.tensor``; no copy: checked through the data pointer).

    Raises:
        OSError: the CUDA runtime is not there, or refused (out of locked memory, a range already
            registered, no unified addressing): the caller stages through pinned memory instead. The
            runtime's error is cleared first.
    """
    import torch

    lib = cudart()
    reg, get_ptr = lib.cudaHostRegister, lib.cudaHostGetDevicePointer
    reg.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    reg.restype = ctypes.c_int
    get_ptr.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_uint]
    get_ptr.restype = ctypes.c_int
    lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    with torch.cuda.device(device):
        err = reg(ctypes.c_void_p(ptr), nbytes, _HOST_REGISTER_PORTABLE_MAPPED)
        if err != 0:
            lib.cudaGetLastError()
            raise OSError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {err}")
        m = HostMapping(ptr, nbytes, 0, device, lib)
        m.device_ptr = ptr  # for close() until the device pointer is known
        try:
            dptr = ctypes.c_void_p()
            err = get_ptr(ctypes.byref(dptr), ctypes.c_void_p(ptr), 0)
            if err != 0:
                lib.cudaGetLastError()
                raise OSError(f"cudaHostGetDevicePointer failed with CUDA error {err}")
            m.device_ptr = int(dptr.value or 0)
            t = torch.as_tensor(m, device=torch.device("cuda", device))
            if t.data_ptr() != m.device_ptr or t.device.index != device:
                raise OSError("torch copied the mapped host range instead of viewing it")
        except BaseException:
            m.close()
            raise
    m.tensor = t
    return m
