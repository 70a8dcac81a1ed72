"""A :class:`~tensorwire.spec.TensorSpec` to and from its protobuf message ``tensorwire.v1.TensorSpec``.

The gRPC code of both doors uses it: the link negotiation (``p2p/control.py``) and
the serve client and daemon. It sits outside ``spec.py`` so that the leaf imports no
generated code (and so no protobuf).
"""

from __future__ import annotations

from typing import cast

from tensorwire.errors import SpecError
from tensorwire.spec import DEVICE_BY_CODE, DEVICE_CODES, DTYPE_BY_CODE, DTYPE_CODES, TensorSpec
from tensorwire.v1 import types_pb2

__all__ = ["spec_to_proto", "spec_from_proto"]


def spec_to_proto(spec: TensorSpec) -> types_pb2.TensorSpec:
    """The message for ``spec``."""
    return types_pb2.TensorSpec(
        name=spec.name,
        shape=list(spec.shape),
        dtype=cast("types_pb2.DType", DTYPE_CODES[spec.dtype]),
        device=cast("types_pb2.DeviceKind", DEVICE_CODES[spec.device]),
        dynamic=list(spec.dynamic),
    )


def spec_from_proto(msg: types_pb2.TensorSpec) -> TensorSpec:
    """Build a spec from its message, validating every field.

    Raises:
        SpecError: unknown dtype/device code or any invalid field.
    """
    if msg.dtype not in DTYPE_BY_CODE:
        raise SpecError(f"{msg.name!r}: unknown dtype code {msg.dtype}")
    if msg.device not in DEVICE_BY_CODE:
        raise SpecError(f"{msg.name!r}: unknown device code {msg.device}")
    return TensorSpec(
        msg.name,
        tuple(msg.shape),
        DTYPE_BY_CODE[msg.dtype],
        DEVICE_BY_CODE[msg.device],
        dynamic=tuple(msg.dynamic) or None,
    )
