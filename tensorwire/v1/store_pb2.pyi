from tensorwire.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ShardLayout(_message.Message):
    __slots__ = ("shards", "index", "rows", "row_start", "row_stop", "fingerprint")
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ROW_START_FIELD_NUMBER: _ClassVar[int]
    ROW_STOP_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    shards: int
    index: int
    rows: int
    row_start: int
    row_stop: int
    fingerprint: bytes
    def __init__(self, shards: _Optional[int] = ..., index: _Optional[int] = ..., rows: _Optional[int] = ..., row_start: _Optional[int] = ..., row_stop: _Optional[int] = ..., fingerprint: _Optional[bytes] = ...) -> None: ...

class TensorInfo(_message.Message):
    __slots__ = ("spec", "version", "nbytes", "layout")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    spec: _types_pb2.TensorSpec
    version: int
    nbytes: int
    layout: ShardLayout
    def __init__(self, spec: _Optional[_Union[_types_pb2.TensorSpec, _Mapping]] = ..., version: _Optional[int] = ..., nbytes: _Optional[int] = ..., layout: _Optional[_Union[ShardLayout, _Mapping]] = ...) -> None: ...

class Transfer(_message.Message):
    __slots__ = ("tag", "step", "nbytes", "op_id")
    TAG_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    tag: int
    step: int
    nbytes: int
    op_id: int
    def __init__(self, tag: _Optional[int] = ..., step: _Optional[int] = ..., nbytes: _Optional[int] = ..., op_id: _Optional[int] = ...) -> None: ...

class OpenSessionRequest(_message.Message):
    __slots__ = ("protocol_version", "transport", "client", "host_id", "data_requests", "shm", "layouts")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    transport: str
    client: str
    host_id: str
    data_requests: int
    shm: int
    layouts: int
    def __init__(self, protocol_version: _Optional[int] = ..., transport: _Optional[str] = ..., client: _Optional[str] = ..., host_id: _Optional[str] = ..., data_requests: _Optional[int] = ..., shm: _Optional[int] = ..., layouts: _Optional[int] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "nonce", "data", "protocol_version", "max_bytes", "max_index_rows", "max_rows_bytes", "data_requests", "shm", "shm_hello", "layouts")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_INDEX_ROWS_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_BYTES_FIELD_NUMBER: _ClassVar[int]
    DATA_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    SHM_HELLO_FIELD_NUMBER: _ClassVar[int]
    LAYOUTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    nonce: bytes
    data: _containers.RepeatedCompositeFieldContainer[_types_pb2.TransportAddress]
    protocol_version: int
    max_bytes: int
    max_index_rows: int
    max_rows_bytes: int
    data_requests: int
    shm: int
    shm_hello: str
    layouts: int
    def __init__(self, session_id: _Optional[str] = ..., nonce: _Optional[bytes] = ..., data: _Optional[_Iterable[_Union[_types_pb2.TransportAddress, _Mapping]]] = ..., protocol_version: _Optional[int] = ..., max_bytes: _Optional[int] = ..., max_index_rows: _Optional[int] = ..., max_rows_bytes: _Optional[int] = ..., data_requests: _Optional[int] = ..., shm: _Optional[int] = ..., shm_hello: _Optional[str] = ..., layouts: _Optional[int] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseSessionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DeclareRequest(_message.Message):
    __slots__ = ("session_id", "spec", "layout")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    spec: _types_pb2.TensorSpec
    layout: ShardLayout
    def __init__(self, session_id: _Optional[str] = ..., spec: _Optional[_Union[_types_pb2.TensorSpec, _Mapping]] = ..., layout: _Optional[_Union[ShardLayout, _Mapping]] = ...) -> None: ...

class DeclareResponse(_message.Message):
    __slots__ = ("info", "created")
    INFO_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    info: TensorInfo
    created: bool
    def __init__(self, info: _Optional[_Union[TensorInfo, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class BeginPutRequest(_message.Message):
    __slots__ = ("session_id", "spec", "timeout_ms", "layout")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    spec: _types_pb2.TensorSpec
    timeout_ms: int
    layout: ShardLayout
    def __init__(self, session_id: _Optional[str] = ..., spec: _Optional[_Union[_types_pb2.TensorSpec, _Mapping]] = ..., timeout_ms: _Optional[int] = ..., layout: _Optional[_Union[ShardLayout, _Mapping]] = ...) -> None: ...

class BeginPutResponse(_message.Message):
    __slots__ = ("transfer", "created")
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    transfer: Transfer
    created: bool
    def __init__(self, transfer: _Optional[_Union[Transfer, _Mapping]] = ..., created: _Optional[bool] = ...) -> None: ...

class PutRowsRequest(_message.Message):
    __slots__ = ("session_id", "name", "index", "values", "add", "timeout_ms", "layout")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    ADD_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    name: str
    index: bytes
    values: _types_pb2.TensorSpec
    add: bool
    timeout_ms: int
    layout: ShardLayout
    def __init__(self, session_id: _Optional[str] = ..., name: _Optional[str] = ..., index: _Optional[bytes] = ..., values: _Optional[_Union[_types_pb2.TensorSpec, _Mapping]] = ..., add: _Optional[bool] = ..., timeout_ms: _Optional[int] = ..., layout: _Optional[_Union[ShardLayout, _Mapping]] = ...) -> None: ...

class PutRowsResponse(_message.Message):
    __slots__ = ("transfer",)
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    transfer: Transfer
    def __init__(self, transfer: _Optional[_Union[Transfer, _Mapping]] = ...) -> None: ...

class CommitPutRequest(_message.Message):
    __slots__ = ("session_id", "op_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    op_id: int
    def __init__(self, session_id: _Optional[str] = ..., op_id: _Optional[int] = ...) -> None: ...

class CommitPutResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: TensorInfo
    def __init__(self, info: _Optional[_Union[TensorInfo, _Mapping]] = ...) -> None: ...

class AbortPutRequest(_message.Message):
    __slots__ = ("session_id", "op_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    OP_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    op_id: int
    def __init__(self, session_id: _Optional[str] = ..., op_id: _Optional[int] = ...) -> None: ...

class AbortPutResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("session_id", "name", "timeout_ms", "layout")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    name: str
    timeout_ms: int
    layout: ShardLayout
    def __init__(self, session_id: _Optional[str] = ..., name: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., layout: _Optional[_Union[ShardLayout, _Mapping]] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("info", "transfer")
    INFO_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    info: TensorInfo
    transfer: Transfer
    def __init__(self, info: _Optional[_Union[TensorInfo, _Mapping]] = ..., transfer: _Optional[_Union[Transfer, _Mapping]] = ...) -> None: ...

class GetRowsRequest(_message.Message):
    __slots__ = ("session_id", "name", "index", "timeout_ms", "layout")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    name: str
    index: bytes
    timeout_ms: int
    layout: ShardLayout
    def __init__(self, session_id: _Optional[str] = ..., name: _Optional[str] = ..., index: _Optional[bytes] = ..., timeout_ms: _Optional[int] = ..., layout: _Optional[_Union[ShardLayout, _Mapping]] = ...) -> None: ...

class GetRowsResponse(_message.Message):
    __slots__ = ("info", "transfer", "shape")
    INFO_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    info: TensorInfo
    transfer: Transfer
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, info: _Optional[_Union[TensorInfo, _Mapping]] = ..., transfer: _Optional[_Union[Transfer, _Mapping]] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class ListRequest(_message.Message):
    __slots__ = ("page_token", "page_size")
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    page_token: str
    page_size: int
    def __init__(self, page_token: _Optional[str] = ..., page_size: _Optional[int] = ...) -> None: ...

class ListResponse(_message.Message):
    __slots__ = ("tensors", "next_page_token")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorInfo]
    next_page_token: str
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorInfo, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class StatRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class StatResponse(_message.Message):
    __slots__ = ("info",)
    INFO_FIELD_NUMBER: _ClassVar[int]
    info: TensorInfo
    def __init__(self, info: _Optional[_Union[TensorInfo, _Mapping]] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("name", "layout")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    name: str
    layout: ShardLayout
    def __init__(self, name: _Optional[str] = ..., layout: _Optional[_Union[ShardLayout, _Mapping]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SnapshotResponse(_message.Message):
    __slots__ = ("path", "tensors", "nbytes", "seconds")
    PATH_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    path: str
    tensors: int
    nbytes: int
    seconds: float
    def __init__(self, path: _Optional[str] = ..., tensors: _Optional[int] = ..., nbytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...
