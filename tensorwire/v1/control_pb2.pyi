from tensorwire.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LinkOffer(_message.Message):
    __slots__ = ("protocol_version", "run_id", "from_rank", "to_rank", "link_name", "send", "recv", "data", "transport", "nonce", "has_cuda", "host_id")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_RANK_FIELD_NUMBER: _ClassVar[int]
    TO_RANK_FIELD_NUMBER: _ClassVar[int]
    LINK_NAME_FIELD_NUMBER: _ClassVar[int]
    SEND_FIELD_NUMBER: _ClassVar[int]
    RECV_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    HAS_CUDA_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    run_id: str
    from_rank: int
    to_rank: int
    link_name: str
    send: _containers.RepeatedCompositeFieldContainer[_types_pb2.TensorSpec]
    recv: _containers.RepeatedCompositeFieldContainer[_types_pb2.TensorSpec]
    data: _containers.RepeatedCompositeFieldContainer[_types_pb2.TransportAddress]
    transport: str
    nonce: bytes
    has_cuda: bool
    host_id: str
    def __init__(self, protocol_version: _Optional[int] = ..., run_id: _Optional[str] = ..., from_rank: _Optional[int] = ..., to_rank: _Optional[int] = ..., link_name: _Optional[str] = ..., send: _Optional[_Iterable[_Union[_types_pb2.TensorSpec, _Mapping]]] = ..., recv: _Optional[_Iterable[_Union[_types_pb2.TensorSpec, _Mapping]]] = ..., data: _Optional[_Iterable[_Union[_types_pb2.TransportAddress, _Mapping]]] = ..., transport: _Optional[str] = ..., nonce: _Optional[bytes] = ..., has_cuda: _Optional[bool] = ..., host_id: _Optional[str] = ...) -> None: ...

class NegotiateRequest(_message.Message):
    __slots__ = ("offer",)
    OFFER_FIELD_NUMBER: _ClassVar[int]
    offer: LinkOffer
    def __init__(self, offer: _Optional[_Union[LinkOffer, _Mapping]] = ...) -> None: ...

class NegotiateResponse(_message.Message):
    __slots__ = ("offer",)
    OFFER_FIELD_NUMBER: _ClassVar[int]
    offer: LinkOffer
    def __init__(self, offer: _Optional[_Union[LinkOffer, _Mapping]] = ...) -> None: ...
