from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    INT8: _ClassVar[DType]
    INT16: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT64: _ClassVar[DType]
    UINT8: _ClassVar[DType]
    BOOL: _ClassVar[DType]
    COMPLEX64: _ClassVar[DType]
    FLOAT8_E4M3FN: _ClassVar[DType]
    FLOAT8_E5M2: _ClassVar[DType]
    FLOAT8_E4M3FNUZ: _ClassVar[DType]
    FLOAT8_E5M2FNUZ: _ClassVar[DType]

class DeviceKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEVICE_KIND_UNSPECIFIED: _ClassVar[DeviceKind]
    CPU: _ClassVar[DeviceKind]
    CUDA: _ClassVar[DeviceKind]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
FLOAT64: DType
INT8: DType
INT16: DType
INT32: DType
INT64: DType
UINT8: DType
BOOL: DType
COMPLEX64: DType
FLOAT8_E4M3FN: DType
FLOAT8_E5M2: DType
FLOAT8_E4M3FNUZ: DType
FLOAT8_E5M2FNUZ: DType
DEVICE_KIND_UNSPECIFIED: DeviceKind
CPU: DeviceKind
CUDA: DeviceKind

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype", "device", "dynamic")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    device: DeviceKind
    dynamic: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., device: _Optional[_Union[DeviceKind, str]] = ..., dynamic: _Optional[_Iterable[bool]] = ...) -> None: ...

class TransportAddress(_message.Message):
    __slots__ = ("kind", "host", "port")
    KIND_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    host: str
    port: int
    def __init__(self, kind: _Optional[str] = ..., host: _Optional[str] = ..., port: _Optional[int] = ...) -> None: ...
