from services.common.pb.stageserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SpanStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SPAN_STATUS_UNSPECIFIED: _ClassVar[SpanStatus]
    SPAN_STATUS_WRITTEN: _ClassVar[SpanStatus]
    SPAN_STATUS_INVALID_IMAGE: _ClassVar[SpanStatus]
    SPAN_STATUS_FAILED: _ClassVar[SpanStatus]
    SPAN_STATUS_NEEDS_IMAGE_DATA: _ClassVar[SpanStatus]
    SPAN_STATUS_SKIPPED: _ClassVar[SpanStatus]
SPAN_STATUS_UNSPECIFIED: SpanStatus
SPAN_STATUS_WRITTEN: SpanStatus
SPAN_STATUS_INVALID_IMAGE: SpanStatus
SPAN_STATUS_FAILED: SpanStatus
SPAN_STATUS_NEEDS_IMAGE_DATA: SpanStatus
SPAN_STATUS_SKIPPED: SpanStatus

class EncodeSpan(_message.Message):
    __slots__ = ("span", "image_data", "dest_row")
    SPAN_FIELD_NUMBER: _ClassVar[int]
    IMAGE_DATA_FIELD_NUMBER: _ClassVar[int]
    DEST_ROW_FIELD_NUMBER: _ClassVar[int]
    span: _common_pb2.ImageSpan
    image_data: bytes
    dest_row: int
    def __init__(self, span: _Optional[_Union[_common_pb2.ImageSpan, _Mapping]] = ..., image_data: _Optional[bytes] = ..., dest_row: _Optional[int] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "spans", "embedding_refs", "deadline_unix_ms", "cache_only")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_REFS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    CACHE_ONLY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    spans: _containers.RepeatedCompositeFieldContainer[EncodeSpan]
    embedding_refs: _containers.RepeatedCompositeFieldContainer[_common_pb2.EmbeddingRef]
    deadline_unix_ms: int
    cache_only: bool
    def __init__(self, request_id: _Optional[str] = ..., spans: _Optional[_Iterable[_Union[EncodeSpan, _Mapping]]] = ..., embedding_refs: _Optional[_Iterable[_Union[_common_pb2.EmbeddingRef, _Mapping]]] = ..., deadline_unix_ms: _Optional[int] = ..., cache_only: _Optional[bool] = ...) -> None: ...

class SpanResult(_message.Message):
    __slots__ = ("content_hash", "status", "is_cache_hit", "owner_rank", "error_message")
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    IS_CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    OWNER_RANK_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    content_hash: str
    status: SpanStatus
    is_cache_hit: bool
    owner_rank: int
    error_message: str
    def __init__(self, content_hash: _Optional[str] = ..., status: _Optional[_Union[SpanStatus, str]] = ..., is_cache_hit: _Optional[bool] = ..., owner_rank: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[SpanResult]
    def __init__(self, results: _Optional[_Iterable[_Union[SpanResult, _Mapping]]] = ...) -> None: ...
