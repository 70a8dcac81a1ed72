"""Arrays of any library in and out of a serve client, through DLPack: no copy on the way.

``put``, ``put_rows`` and ``add_rows`` take a torch tensor or any object with
``__dlpack__`` (a NumPy, CuPy or JAX array): :func:`as_tensor` makes a torch
view of its memory (``torch.from_dlpack``), and the client reads the bytes
from there as it reads a tensor's. ``get`` and ``get_rows`` take ``out=`` of
any of them too (written in place: a CuPy array is a CUDA destination, filled
on the GPU path) and return that same object; without ``out=``, ``as_=``
picks what comes back (:data:`AS_CHOICES`): a torch tensor (the default), a
NumPy array over the same receive buffer, or a CuPy array (the client fills a
new CUDA tensor and hands it over through DLPack).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from tensorwire.errors import ConfigError, SpecError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["AS_CHOICES", "As", "as_tensor", "check_as", "convert"]

#: What ``get`` / ``get_rows`` may return with ``as_=`` (None: a torch tensor).
AS_CHOICES = ("torch", "numpy", "cupy")
As = Literal["torch", "numpy", "cupy"]


def as_tensor(what: str, obj: Any, *, writable: bool = False) -> "torch.Tensor":
    """``obj`` as a torch tensor over the same memory: a tensor as is, else through ``torch.from_dlpack``.

    ``writable``: the caller writes into it (an ``out=``): read-only arrays and JAX arrays (immutable)
    are refused.

    Raises:
        SpecError: not a tensor and no ``__dlpack__``; on a device other than the CPU or CUDA; negative strides (DLPack cannot describe them to
            torch); read-only where it is written; a dtype DLPack cannot carry.
    """
    import torch

    if isinstance(obj, torch.Tensor):
        if not (obj.is_cpu or obj.is_cuda):
            raise SpecError(f"{what} is on {obj.device}: a serve client reads and writes CPU and CUDA memory")
        return obj
    if not hasattr(obj, "__dlpack__"):
        raise SpecError(
            f"{what} must be a torch.Tensor or an array with __dlpack__ (NumPy, CuPy, JAX), got {type(obj).__name__}"
        )
    strides = getattr(obj, "strides", None)
    # torch aborts the process on a negative stride (it throws from a function that may not throw): refuse first
    if isinstance(strides, tuple) and any(isinstance(s, int) and s < 0 for s in strides):
        raise SpecError(f"{what}: an array with negative strides cannot be shared; pass a contiguous copy")
    if writable:
        if type(obj).__module__.split(".", 1)[0] in ("jax", "jaxlib"):
            raise SpecError(f"{what}: JAX arrays are immutable; pass a NumPy, CuPy or torch destination")
        flags = getattr(obj, "flags", None)
        if flags is not None and getattr(flags, "writeable", True) is False:
            raise SpecError(f"{what}: the array is read-only")
    try:
        t = torch.from_dlpack(obj)
    except (BufferError, TypeError, ValueError, RuntimeError) as exc:
        raise SpecError(f"{what}: a {type(obj).__name__} could not be shared through DLPack ({exc})") from exc
    return as_tensor(what, t)


def check_as(as_: Any, out: Any) -> str | None:
    """``as_`` checked (None: a torch tensor); it cannot go with ``out=``.

    Raises:
        ConfigError: not one of :data:`AS_CHOICES`, or given with ``out=``.
    """
    if as_ is None:
        return None
    if as_ not in AS_CHOICES:
        raise ConfigError(f"as_ must be one of {', '.join(AS_CHOICES)}, got {as_!r}")
    if out is not None:
        raise ConfigError("give out= or as_=, not both (out= is returned as it is)")
    return str(as_)


def convert(t: "torch.Tensor", as_: str | None) -> Any:
    """A result tensor as ``as_`` asks (no copy: NumPy over the same host memory, CuPy over the same device
    memory; the caller made ``t`` a CUDA tensor for CuPy).

    Raises:
        SpecError: NumPy has no such dtype (bfloat16, float8), or a CuPy result of a host tensor.
        ConfigError: CuPy is not installed.
    """
    if as_ is None or as_ == "torch":
        return t
    if as_ == "numpy":
        try:
            return t.detach().numpy()
        except TypeError as exc:
            raise SpecError(f"as_='numpy': NumPy has no {str(t.dtype).removeprefix('torch.')} ({exc})") from exc
    try:
        import cupy
    except ImportError as exc:
        raise ConfigError("as_='cupy' needs CuPy installed") from exc
    if not t.is_cuda:
        raise SpecError("as_='cupy': the result is not on a CUDA device")
    return cupy.from_dlpack(t)
