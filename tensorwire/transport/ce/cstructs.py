"""The C structures the copy-engine path passes to the CUDA driver (ctypes), apart from :mod:`.driver`.

They live in a module of their own because :mod:`.driver` is compiled by mypyc (``tensorwire/native.py``), which
cannot compile a subclass of ``ctypes.Structure``: this module always stays Python.
"""

from __future__ import annotations

import ctypes

__all__ = ["HANDLE_BYTES", "IpcHandle", "MemOp"]

#: bytes of a legacy IPC memory handle (CUipcMemHandle)
HANDLE_BYTES = 64


class IpcHandle(ctypes.Structure):
    """``CUipcMemHandle``: 64 opaque bytes, passed by value (a bare ctypes array would be passed as a pointer)."""

    _fields_ = [("reserved", ctypes.c_char * HANDLE_BYTES)]


class MemOp(ctypes.Structure):
    """``CUstreamBatchMemOpParams`` as a wait or a write of a 32-bit value (the union's 48 bytes, that member)."""

    _fields_ = [
        ("operation", ctypes.c_uint32),
        ("_pad0", ctypes.c_uint32),
        ("address", ctypes.c_uint64),
        ("value", ctypes.c_uint64),
        ("flags", ctypes.c_uint32),
        ("_pad1", ctypes.c_uint32),
        ("alias", ctypes.c_uint64),  # (for the driver's use)
        ("_pad2", ctypes.c_uint64),
    ]
