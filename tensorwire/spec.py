"""``TensorSpec``: what a statically shaped tensor looks like on the wire.

A spec is immutable and validated when it is built:

- ``name``: printable, 1..256 characters;
- ``dtype``: one of :data:`DTYPES` (an explicit allowlist);
- ``shape``: rank <= 8, every dim >= 0, total size <= :data:`MAX_TENSOR_BYTES`;
- ``device``: ``"cpu"`` or ``"cuda"`` (the index is local to each process and
  is not part of the agreement between peers);
- ``dynamic``: per dim, whether the dim is a maximum (the actual size travels
  with each message).

Specs compare by value. Each dtype and device kind has a wire code
(:data:`DTYPE_CODES`, :data:`DEVICE_CODES`), the enum values of the protobuf
message ``tensorwire.v1.TensorSpec``; the conversion to and from that message
lives with the gRPC code that sends it (``tensorwire._proto``), so this leaf
imports no generated code. torch is imported lazily.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Literal, Mapping

from tensorwire.errors import ShapeMismatchError, SpecError

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = [
    "TensorSpec",
    "DTYPES",
    "DTYPE_CODES",
    "DTYPE_BY_CODE",
    "DEVICE_CODES",
    "DEVICE_BY_CODE",
    "MAX_RANK",
    "MAX_NAME_LEN",
    "MAX_TENSOR_BYTES",
    "check_name",
    "check_same_specs",
]

MAX_RANK = 8
MAX_NAME_LEN = 256
#: A single tensor larger than this (1 TiB) is rejected as not fitting in memory.
MAX_TENSOR_BYTES = 1 << 40

# name -> (itemsize, proto enum value)
_DTYPE_TABLE: dict[str, tuple[int, int]] = {
    "float32": (4, 1),
    "float16": (2, 2),
    "bfloat16": (2, 3),
    "float64": (8, 4),
    "int8": (1, 5),
    "int16": (2, 6),
    "int32": (4, 7),
    "int64": (8, 8),
    "uint8": (1, 9),
    "bool": (1, 10),
    # bytes to the data plane like any other; kept for torch.distributed users (backend "tensorwire")
    "complex64": (8, 11),
    "float8_e4m3fn": (1, 12),
    "float8_e5m2": (1, 13),
    "float8_e4m3fnuz": (1, 14),
    "float8_e5m2fnuz": (1, 15),
}
#: The dtypes tensorwire moves, by name.
DTYPES: tuple[str, ...] = tuple(_DTYPE_TABLE)
_DTYPE_BY_PROTO = {v[1]: k for k, v in _DTYPE_TABLE.items()}
_DTYPE_ALIASES = {
    "float": "float32",
    "half": "float16",
    "double": "float64",
    "long": "int64",
    "int": "int32",
    "short": "int16",
}

DeviceKind = Literal["cpu", "cuda"]
_DEVICE_TO_PROTO = {"cpu": 1, "cuda": 2}
_DEVICE_BY_PROTO = {v: k for k, v in _DEVICE_TO_PROTO.items()}

#: dtype name -> its wire code (the ``tensorwire.v1.DType`` enum value), and back.
DTYPE_CODES: Mapping[str, int] = {name: code for name, (_, code) in _DTYPE_TABLE.items()}
DTYPE_BY_CODE: Mapping[int, str] = _DTYPE_BY_PROTO
#: device kind -> its wire code (the ``tensorwire.v1.DeviceKind`` enum value), and back.
DEVICE_CODES: Mapping[str, int] = _DEVICE_TO_PROTO
DEVICE_BY_CODE: Mapping[int, str] = _DEVICE_BY_PROTO


def _dtype_name(dtype: Any) -> str:
    """Normalise a torch dtype, numpy dtype or string to an allowlisted name."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
    else:
        name = str(dtype).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in _DTYPE_TABLE:
        raise SpecError(f"dtype {dtype!r} is not supported; supported dtypes: {', '.join(DTYPES)}")
    return name


def _device_kind(device: Any) -> DeviceKind:
    kind = str(getattr(device, "type", device)).split(":", 1)[0]
    if kind not in _DEVICE_TO_PROTO:
        raise SpecError(f"device {device!r} is not supported; use 'cpu' or 'cuda'")
    return kind  # type: ignore[return-value]


def check_name(name: Any) -> str:
    """Return ``name`` if it is a valid tensor name.

    Raises:
        SpecError: not a str, empty, longer than :data:`MAX_NAME_LEN`, or not printable.
    """
    if not isinstance(name, str):
        raise SpecError(f"tensor name must be a str, got {type(name).__name__}")
    if not 1 <= len(name) <= MAX_NAME_LEN:
        raise SpecError(f"tensor name must have 1..{MAX_NAME_LEN} characters, got {len(name)}")
    if not name.isprintable():
        raise SpecError(f"tensor name {name!r} contains non-printable characters")
    return name


@dataclass(frozen=True)
class TensorSpec:
    """A validated, immutable description of one tensor.

    Args:
        name: printable, at most 256 characters.
        shape: at most 8 non-negative dims. For dynamic dims, the maximum.
        dtype: torch dtype or its name (``"float32"``, ``torch.bfloat16``, ...).
        device: ``"cpu"`` or ``"cuda"`` (``"cuda:1"`` is accepted, the index dropped).
        dynamic: dims whose size may vary up to ``shape[i]`` per message, as a
            sequence of dim indices or of booleans per dim.

    Raises:
        SpecError: on any invalid field; the message says which and why.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    device: DeviceKind = "cpu"
    dynamic: tuple[bool, ...] = field(default=())

    def __init__(
        self,
        name: str,
        shape: Iterable[int],
        dtype: Any = "float32",
        device: Any = "cpu",
        *,
        dynamic: Iterable[int] | Iterable[bool] | None = None,
    ) -> None:
        name = check_name(name)
        try:
            dims = tuple(int(d) for d in shape)
        except (TypeError, ValueError) as exc:
            raise SpecError(f"{name}: shape must be a sequence of ints, got {shape!r}") from exc
        if len(dims) > MAX_RANK:
            raise SpecError(f"{name}: rank {len(dims)} exceeds the maximum of {MAX_RANK}")
        if any(d < 0 for d in dims):
            raise SpecError(f"{name}: negative dim in shape {dims}")
        dtype_name = _dtype_name(dtype)
        itemsize = _DTYPE_TABLE[dtype_name][0]
        numel = math.prod(dims)
        if numel * itemsize > MAX_TENSOR_BYTES:
            raise SpecError(f"{name}: {numel * itemsize} bytes exceeds the per-tensor limit of {MAX_TENSOR_BYTES}")
        dyn = _normalise_dynamic(name, dynamic, len(dims))
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "shape", dims)
        object.__setattr__(self, "dtype", dtype_name)
        object.__setattr__(self, "device", _device_kind(device))
        object.__setattr__(self, "dynamic", dyn)

    # -- derived -------------------------------------------------------------
    @property
    def itemsize(self) -> int:
        return _DTYPE_TABLE[self.dtype][0]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the slot (dynamic dims at their maximum)."""
        return self.numel * self.itemsize

    @property
    def is_dynamic(self) -> bool:
        return any(self.dynamic)

    @property
    def torch_dtype(self) -> "torch.dtype":
        import torch

        return getattr(torch, self.dtype)

    def with_name(self, name: str) -> "TensorSpec":
        return TensorSpec(name, self.shape, self.dtype, self.device, dynamic=self.dynamic)

    # -- construction helpers -----------------------------------------------
    @classmethod
    def of(cls, name: str, tensor: Any, *, dynamic: Iterable[int] | None = None) -> "TensorSpec":
        """The spec of an existing tensor (torch tensor or anything with shape/dtype/device)."""
        device = getattr(tensor, "device", "cpu")
        return cls(name, tuple(tensor.shape), tensor.dtype, device, dynamic=dynamic)

    # -- checks ---------------------------------------------------------------
    def check_shape(self, shape: tuple[int, ...]) -> None:
        """Check an actual shape against this spec (dynamic dims up to their max).

        Raises:
            ShapeMismatchError: naming the tensor, the spec and the shape.
        """
        if len(shape) != len(self.shape):
            raise ShapeMismatchError(f"{self.name}: got shape {tuple(shape)}, negotiated {self.describe()}")
        for i, (got, want) in enumerate(zip(shape, self.shape)):
            if self.dynamic and self.dynamic[i]:
                if got > want:
                    raise ShapeMismatchError(
                        f"{self.name}: dim {i} is {got}, larger than its declared maximum {want} ({self.describe()})"
                    )
            elif got != want:
                raise ShapeMismatchError(f"{self.name}: got shape {tuple(shape)}, negotiated {self.describe()}")

    def check_tensor(self, tensor: Any) -> None:
        """Check a tensor's dtype, device kind and shape against this spec.

        Raises:
            ShapeMismatchError: naming the tensor and both descriptions.
        """
        try:
            dtype = _dtype_name(tensor.dtype)
        except SpecError:
            dtype = str(tensor.dtype)
        device = str(getattr(getattr(tensor, "device", "cpu"), "type", "cpu"))
        if dtype != self.dtype or device != self.device:
            raise ShapeMismatchError(
                f"{self.name}: got {dtype}{list(tensor.shape)} on {device}, negotiated {self.describe()}"
            )
        self.check_shape(tuple(tensor.shape))

    def describe(self) -> str:
        dims = ", ".join(f"<={d}" if self.dynamic and self.dynamic[i] else str(d) for i, d in enumerate(self.shape))
        return f"{self.dtype}[{dims}] on {self.device}"

    def __str__(self) -> str:
        return f"{self.name}: {self.describe()}"


def _normalise_dynamic(name: str, dynamic: Any, rank: int) -> tuple[bool, ...]:
    if dynamic is None:
        return ()
    items = tuple(dynamic)
    if not items:
        return ()
    if all(isinstance(x, bool) for x in items):
        if len(items) != rank:
            raise SpecError(f"{name}: dynamic flags {items} do not match rank {rank}")
        flags = items
    else:
        idx = set()
        for x in items:
            i = int(x)
            if not -rank <= i < rank:
                raise SpecError(f"{name}: dynamic dim {x} out of range for rank {rank}")
            idx.add(i % rank)
        flags = tuple(i in idx for i in range(rank))
    return flags if any(flags) else ()


def check_same_specs(
    mine: Mapping[str, TensorSpec] | Iterable[TensorSpec],
    theirs: Mapping[str, TensorSpec] | Iterable[TensorSpec],
    *,
    what: str,
) -> None:
    """Check that two declarations of the same direction agree exactly.

    ``what`` says which direction, e.g. ``"rank 0 sends / rank 1 receives"``.

    Raises:
        ShapeMismatchError: names the first differing tensor and both specs, or
            the names present on one side only.
    """
    a = mine if isinstance(mine, Mapping) else {s.name: s for s in mine}
    b = theirs if isinstance(theirs, Mapping) else {s.name: s for s in theirs}
    problems = []
    for name in sorted(set(a) | set(b)):
        sa, sb = a.get(name), b.get(name)
        if sa is None:
            problems.append(f"{name}: missing on the sending side, receiver expects {sb.describe()}")  # type: ignore[union-attr]
        elif sb is None:
            problems.append(f"{name}: sender declares {sa.describe()}, receiver does not expect it")
        elif sa != sb:
            problems.append(f"{name}: sender declares {sa.describe()}, receiver expects {sb.describe()}")
    if problems:
        raise ShapeMismatchError(f"link negotiation failed ({what}): " + "; ".join(problems))
