"""Message signatures: what one point-to-point message looks like, and how it rides in a frame header.

A *signature* is ``(dtype, shape, device kind)`` of one message; with the peer,
the direction and the tag it identifies a stream of messages. Every message of
``backend="tensorwire"`` carries its sender's signature in the transport's
fixed-size frame header (the eight ``i64`` "shape" words the TCP and UCX
transports already send with every message on a header tag), so the receiver
checks each message against its own tensor for free: no extra message, no
round trip, no serialization. The encoding (one word of flags, then the dims)::

    word 0   VERSION << 24 | ndim << 16 | device << 8 | dtype code
    word 1-7 dims 0..6
             (rank 8: word 7 = dim 6 << 32 | dim 7, both < 2**31)

:func:`signature_of` builds and caches, per ``(dtype, shape, device kind)``,
the :class:`Signature` and its encoded header: the per-signature state of the
hot path is one dictionary lookup.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, ProtocolError
from ..spec import DTYPES, MAX_RANK

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["Signature", "signature_of", "decode", "WIRE_VERSION"]

WIRE_VERSION = 1
#: dtype name -> code in the header (1-based; order of the spec allowlist, which only ever grows at its end)
_CODES = {name: i + 1 for i, name in enumerate(DTYPES)}
_NAMES = {code: name for name, code in _CODES.items()}
_DEVICES = {"cpu": 0, "cuda": 1}
_DEVICE_NAMES = {v: k for k, v in _DEVICES.items()}
_ITEMSIZE: dict[str, int] = {}


@dataclass(frozen=True, slots=True)
class Signature:
    """One message's dtype (allowlisted name), shape and device kind ("cpu" / "cuda")."""

    dtype: str
    shape: tuple[int, ...]
    device: str
    #: bytes of one message (derived; not compared)
    nbytes: int = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", math.prod(self.shape) * _itemsize(self.dtype))

    def describe(self) -> str:
        return f"{self.dtype}{list(self.shape)} on {self.device} ({self.nbytes} bytes)"

    def fills(self, other: "Signature") -> bool:
        """Whether a message of this signature fills a receive tensor of ``other`` exactly.

        The same dtype, device and shape; or the same dtype and device with one element on both sides (a
        0-d tensor into ``[1]`` or the other way: some torch versions' pipelining sends its shape-exchange
        scalars so). Anything else is a mismatch: never bytes of another shape or type.
        """
        if self == other:
            return True
        return (
            self.dtype == other.dtype
            and self.device == other.device
            and math.prod(self.shape) == 1 == math.prod(other.shape)
        )

    def encode(self) -> tuple[int, ...]:
        """The eight header words (see the module docstring).

        Raises:
            ConfigError: a rank-8 tensor whose last two dims do not fit 31 bits each.
        """
        ndim = len(self.shape)
        words = [WIRE_VERSION << 24 | ndim << 16 | _DEVICES[self.device] << 8 | _CODES[self.dtype]]
        dims = list(self.shape)
        if ndim == MAX_RANK:
            if dims[6] >= 1 << 31 or dims[7] >= 1 << 31:
                raise ConfigError(f"rank-8 tensor {self.shape}: its last two dims must be < 2**31")
            dims = dims[:6] + [dims[6] << 32 | dims[7]]
        words.extend(dims)
        words.extend([0] * (MAX_RANK - len(words)))
        return tuple(words)


def _itemsize(dtype: str) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        import torch

        size = _ITEMSIZE[dtype] = getattr(torch, dtype).itemsize
    return size


def decode(words: tuple[int, ...] | None) -> Signature:
    """The signature a peer put in a header.

    Raises:
        ProtocolError: no header words, another wire version, or codes this build does not know.
    """
    if not words or len(words) != MAX_RANK:
        raise ProtocolError(f"message without a tensorwire.distributed signature header: {words!r}")
    head = words[0]
    version, ndim, device, code = head >> 24, (head >> 16) & 0xFF, (head >> 8) & 0xFF, head & 0xFF
    if version != WIRE_VERSION:
        raise ProtocolError(f"peer speaks signature version {version}, this build {WIRE_VERSION}")
    if code not in _NAMES or device not in _DEVICE_NAMES or ndim > MAX_RANK:
        raise ProtocolError(f"bad signature header {words!r}")
    dims = list(words[1 : 1 + ndim]) if ndim < MAX_RANK else list(words[1:7]) + [words[7] >> 32, words[7] & 0xFFFFFFFF]
    return Signature(_NAMES[code], tuple(dims), _DEVICE_NAMES[device])


# (torch dtype, shape, is_cpu, is_cuda) -> (Signature, header words); grows by one entry per new signature
_CACHE: dict[tuple[Any, tuple[int, ...], bool, bool], tuple[Signature, tuple[int, ...]]] = {}
_CACHE_MAX = 4096


def signature_of(tensor: "torch.Tensor") -> tuple[Signature, tuple[int, ...]]:
    """``(signature, header words)`` of a tensor, cached per signature.

    Raises:
        ConfigError: a dtype outside the allowlist or a device other than cpu/cuda (names both).
    """
    # torch.Size hashes and compares as the tuple of its dims; the two flags tell cpu, cuda and anything else apart
    key = (tensor.dtype, tensor.shape, tensor.is_cpu, tensor.is_cuda)
    hit = _CACHE.get(key)
    if hit is not None:
        return hit
    name = str(tensor.dtype).removeprefix("torch.")
    if name not in _CODES:
        raise ConfigError(f"backend 'tensorwire' does not move {tensor.dtype}; supported: {', '.join(DTYPES)}")
    device = tensor.device.type
    if device not in _DEVICES:
        raise ConfigError(f"backend 'tensorwire' moves cpu and cuda tensors, not {tensor.device}")
    shape = tuple(tensor.shape)
    if len(shape) > MAX_RANK:
        raise ConfigError(f"backend 'tensorwire' moves tensors of rank <= {MAX_RANK}, got shape {shape}")
    sig = Signature(name, shape, device)
    if len(_CACHE) >= _CACHE_MAX:
        _CACHE.clear()
    hit = _CACHE[key] = (sig, sig.encode())
    return hit
