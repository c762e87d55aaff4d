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
    __slots__ = ("request_id", "first_token_id", "kv_written_proof", "deadline_unix_ms", "traceparent", "tracestate")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    KV_WRITTEN_PROOF_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    TRACESTATE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    first_token_id: int
    kv_written_proof: bytes
    deadline_unix_ms: int
    traceparent: str
    tracestate: str
    def __init__(self, request_id: _Optional[str] = ..., first_token_id: _Optional[int] = ..., kv_written_proof: _Optional[bytes] = ..., deadline_unix_ms: _Optional[int] = ..., traceparent: _Optional[str] = ..., tracestate: _Optional[str] = ...) -> None: ...

class DecodeStreamRequest(_message.Message):
    __slots__ = ("generate", "abort")
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    generate: DecodeGenerateRequest
    abort: AbortRequest
    def __init__(self, generate: _Optional[_Union[DecodeGenerateRequest, _Mapping]] = ..., abort: _Optional[_Union[AbortRequest, _Mapping]] = ...) -> None: ...

class DecodeStreamResponse(_message.Message):
    __slots__ = ("request_ids", "token_ids", "ends", "waiting_request_ids", "logprobs", "logprob_indices")
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ENDS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_INDICES_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    ends: _containers.RepeatedCompositeFieldContainer[RequestEnd]
    waiting_request_ids: _containers.RepeatedScalarFieldContainer[str]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    logprob_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ..., token_ids: _Optional[_Iterable[int]] = ..., ends: _Optional[_Iterable[_Union[RequestEnd, _Mapping]]] = ..., waiting_request_ids: _Optional[_Iterable[str]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., logprob_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class RequestEnd(_message.Message):
    __slots__ = ("request_id", "finish_reason", "usage", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    finish_reason: _common_pb2.FinishReason
    usage: _common_pb2.Usage
    error: StreamError
    def __init__(self, request_id: _Optional[str] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[_common_pb2.Usage, _Mapping]] = ..., error: _Optional[_Union[StreamError, _Mapping]] = ...) -> None: ...

class StreamError(_message.Message):
    __slots__ = ("code", "error_type", "message", "param")
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_TYPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PARAM_FIELD_NUMBER: _ClassVar[int]
    code: str
    error_type: str
    message: str
    param: str
    def __init__(self, code: _Optional[str] = ..., error_type: _Optional[str] = ..., message: _Optional[str] = ..., param: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("dp_rank", "num_total_pages", "num_free_pages", "num_used_pages", "num_running_requests", "num_reserved_requests", "num_quarantined_pages", "is_serving")
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_USED_PAGES_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_QUARANTINED_PAGES_FIELD_NUMBER: _ClassVar[int]
    IS_SERVING_FIELD_NUMBER: _ClassVar[int]
    dp_rank: int
    num_total_pages: int
    num_free_pages: int
    num_used_pages: int
    num_running_requests: int
    num_reserved_requests: int
    num_quarantined_pages: int
    is_serving: bool
    def __init__(self, dp_rank: _Optional[int] = ..., num_total_pages: _Optional[int] = ..., num_free_pages: _Optional[int] = ..., num_used_pages: _Optional[int] = ..., num_running_requests: _Optional[int] = ..., num_reserved_requests: _Optional[int] = ..., num_quarantined_pages: _Optional[int] = ..., is_serving: _Optional[bool] = ...) -> None: ...

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
