"""Slots: one preallocated buffer per negotiated spec.

A :class:`Slot` is allocated once when a link is negotiated, never moved and
reused every step, so UCX's registration cache hits on every transfer after the
first and nothing is allocated on the hot path.

Memory kinds:

- CPU specs: page-locked (pinned) host memory when CUDA is available (so a GPU
  can DMA from/to it), page-aligned pageable memory otherwise.
- CUDA specs: device memory on the slot's device (default: the current one).
  From PyTorch's caching allocator (blocks >= 512-byte aligned), except when that
  allocator maps memory with expandable segments: then from plain
  ``cudaMalloc`` (:func:`tensorwire.cuda.alloc_cuda`), because CUDA IPC handles
  — what UCX's ``cuda_ipc`` needs to move GPU memory between processes — cannot
  be made for expandable-segment memory, and UCX would silently take a path an
  order of magnitude slower. Such a slot is page-aligned, lives outside the
  caching allocator (it does not count in ``torch.cuda.memory_allocated()``)
  and is freed with its last tensor. :func:`cuda_slot_source` says which one a
  new slot gets.
- staging: a pinned host slot shadowing a CUDA spec, used when the transport
  cannot reach GPU memory (TCP); the Link cuts it into chunks
  (:func:`tensorwire.p2p.staging.chunk_plan`).

Every slot exposes ``raw`` (a flat ``uint8`` tensor over all its bytes) and
``tensor`` (the typed view of the full spec shape); ``view(shape)`` returns the
typed view of a smaller actual shape for dynamic dims, without copying.
"""

from __future__ import annotations

import functools
import mmap
from typing import TYPE_CHECKING

from tensorwire.spec import TensorSpec
from tensorwire.cuda import expandable_segments, alloc_cuda, check_allocator

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np
    import torch

__all__ = ["Slot", "allocate_host", "allocate_cuda", "cuda_slot_source", "cuda_available", "PAGE"]

PAGE = mmap.PAGESIZE


@functools.lru_cache(maxsize=1)
def cuda_available() -> bool:
    """Whether torch sees a CUDA device (cached; never called at import)."""
    import torch

    return bool(torch.cuda.is_available())


def cuda_in_use() -> bool:
    """Whether this process has initialized CUDA already (set a device, made a CUDA tensor): a GPU job."""
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda.is_initialized())


def allocate_host(nbytes: int, *, pinned: bool | None = None) -> "torch.Tensor":
    """A flat uint8 CPU tensor of ``nbytes``: pinned if CUDA is present, page-aligned otherwise.

    The tensor's data pointer is page-aligned in both cases.
    """
    import torch

    if pinned is None:
        pinned = cuda_available()
    if pinned:
        # cudaHostAlloc returns page-aligned memory.
        return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)[:nbytes]
    backing = torch.empty(nbytes + PAGE, dtype=torch.uint8)
    offset = (-backing.data_ptr()) % PAGE
    return backing[offset : offset + nbytes]


def cuda_slot_source() -> str:
    """Where new CUDA slots come from: ``"cudaMalloc"`` under expandable segments, else ``"caching-allocator"``.

    Checked per slot (cheap: environment and the allocator's own settings), so
    a process that switches its allocator settings before linking is honoured.
    """
    return "cudaMalloc" if expandable_segments().expandable else "caching-allocator"


def allocate_cuda(nbytes: int, device: "torch.device") -> "torch.Tensor":
    """A flat uint8 CUDA tensor of ``nbytes`` on ``device`` that CUDA IPC can export (see the module docstring)."""
    import torch

    if cuda_slot_source() == "cudaMalloc":
        check_allocator()  # warns once: tensors the user sends from the caching allocator are still affected
        return alloc_cuda(nbytes, device, align=PAGE)
    # Unchanged from before cudaMalloc slots existed: a caching-allocator block (>= 512-byte aligned).
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


class Slot:
    """A preallocated buffer for one spec. Allocated once; never reallocated.

    Attributes:
        spec: the spec this slot holds.
        raw: flat ``uint8`` tensor over the slot's bytes.
        tensor: typed view with the spec's full shape.
        pinned: whether host memory is page-locked.
    """

    __slots__ = ("spec", "raw", "tensor", "pinned", "_np")

    def __init__(self, spec: TensorSpec, *, device: "torch.device | str | None" = None, host: bool = False) -> None:
        import torch

        self.spec = spec
        nbytes = spec.nbytes
        if spec.device == "cuda" and not host:
            dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
            self.raw = allocate_cuda(nbytes, dev)
            self.pinned = False
        else:
            self.raw = allocate_host(nbytes)
            # Fault every page in now, so the first transfer into this slot does
            # not pay for (or show up as) memory growth on the hot path.
            self.raw.zero_()
            self.pinned = bool(self.raw.is_pinned()) if nbytes else False
        self.tensor = _typed_view(self.raw, spec.torch_dtype, spec.shape)
        self._np: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes

    @property
    def is_cuda(self) -> bool:
        return bool(self.raw.is_cuda)

    @property
    def data_ptr(self) -> int:
        return int(self.raw.data_ptr())

    def host_array(self) -> "np.ndarray":
        """Zero-copy NumPy uint8 view of a host slot (cached: no allocation per step)."""
        if self._np is None:
            self._np = self.raw.numpy()
        return self._np

    def view(self, shape: tuple[int, ...]) -> "torch.Tensor":
        """Typed view of the first ``prod(shape)`` elements with ``shape`` (no copy)."""
        if shape == self.spec.shape:
            return self.tensor
        import math

        n = math.prod(shape) * self.spec.itemsize
        return _typed_view(self.raw[:n], self.spec.torch_dtype, shape)

    def __repr__(self) -> str:
        kind = "cuda" if self.is_cuda else ("pinned" if self.pinned else "host")
        return f"Slot({self.spec}, {kind}, {self.nbytes} B @ {self.data_ptr:#x})"


def _typed_view(raw: "torch.Tensor", dtype: "torch.dtype", shape: tuple[int, ...]) -> "torch.Tensor":
    import torch

    if raw.numel() == 0:
        return torch.empty(shape, dtype=dtype, device=raw.device) if 0 in shape else raw.view(dtype).reshape(shape)
    return raw.view(dtype).view(shape)


def as_bytes(tensor: "torch.Tensor") -> "torch.Tensor":
    """Flat uint8 view of a contiguous tensor's bytes (no copy; 0-d and bool included)."""
    import torch

    flat = tensor.reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    return flat.view(torch.uint8)
