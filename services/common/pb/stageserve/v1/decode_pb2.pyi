from services.common.pb.stageserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "mrope_position_delta", "sampling_params", "deadline_unix_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MROPE_POSITION_DELTA_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    mrope_position_delta: int
    sampling_params: _common_pb2.SamplingParams
    deadline_unix_ms: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., mrope_position_delta: _Optional[int] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., deadline_unix_ms: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("kv_ref",)
    KV_REF_FIELD_NUMBER: _ClassVar[int]
    kv_ref: _common_pb2.KvRef
    def __init__(self, kv_ref: _Optional[_Union[_common_pb2.KvRef, _Mapping]] = ...) -> None: ...

class DecodeGenerateRequest(_message.Message):
    __slots__ = ("request_id", "first_token_id", "kv_written_proof")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    KV_WRITTEN_PROOF_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    kv_written_proof: bytes
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., kv_written_proof: _Optional[bytes] = ...) -> None: ...

class DecodeGenerateResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "usage")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "reason", "is_kv_written")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    IS_KV_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    reason: str
    is_kv_written: bool
    def __init__(self, request_id: _Optional[str] = ..., reason: _Optional[str] = ..., is_kv_written: _Optional[bool] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("is_found",)
    IS_FOUND_FIELD_NUMBER: _ClassVar[int]
    is_found: bool
    def __init__(self, is_found: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DecodeRankStats(_message.Message):
    __slots__ = ("dp_rank", "num_total_pages", "num_free_pages", "num_used_pages", "num_running_requests", "num_reserved_requests", "num_quarantined_pages")
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUARANTINED_PAGES_FIELD_NUMBER: _ClassVar[int]
    dp_rank: int
    num_total_pages: int
    num_free_pages: int
    num_used_pages: int
    num_running_requests: int
    num_reserved_requests: int
    num_quarantined_pages: int
    def __init__(self, dp_rank: _Optional[int] = ..., num_total_pages: _Optional[int] = ..., num_free_pages: _Optional[int] = ..., num_used_pages: _Optional[int] = ..., num_running_requests: _Optional[int] = ..., num_reserved_requests: _Optional[int] = ..., num_quarantined_pages: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("page_size", "num_total_pages", "num_free_pages", "num_used_pages", "num_running_requests", "num_reserved_requests", "ranks", "num_quarantined_pages")
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUARANTINED_PAGES_FIELD_NUMBER: _ClassVar[int]
    page_size: int
    num_total_pages: int
    num_free_pages: int
    num_used_pages: int
    num_running_requests: int
    num_reserved_requests: int
    ranks: _containers.RepeatedCompositeFieldContainer[DecodeRankStats]
    num_quarantined_pages: int
    def __init__(self, page_size: _Optional[int] = ..., num_total_pages: _Optional[int] = ..., num_free_pages: _Optional[int] = ..., num_used_pages: _Optional[int] = ..., num_running_requests: _Optional[int] = ..., num_reserved_requests: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[DecodeRankStats, _Mapping]]] = ..., num_quarantined_pages: _Optional[int] = ...) -> None: ...
