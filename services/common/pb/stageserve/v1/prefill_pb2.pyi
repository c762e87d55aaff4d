from services.common.pb.stageserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "image_spans", "images", "sampling_params", "kv_ref", "deadline_unix_ms", "prompt_embeds", "prompt_embeds_dtype")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_SPANS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    KV_REF_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_EMBEDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_EMBEDS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    image_spans: _containers.RepeatedCompositeFieldContainer[_common_pb2.ImageSpan]
    images: _containers.RepeatedCompositeFieldContainer[_common_pb2.ImageData]
    sampling_params: _common_pb2.SamplingParams
    kv_ref: _common_pb2.KvRef
    deadline_unix_ms: int
    prompt_embeds: bytes
    prompt_embeds_dtype: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., image_spans: _Optional[_Iterable[_Union[_common_pb2.ImageSpan, _Mapping]]] = ..., images: _Optional[_Iterable[_Union[_common_pb2.ImageData, _Mapping]]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., kv_ref: _Optional[_Union[_common_pb2.KvRef, _Mapping]] = ..., deadline_unix_ms: _Optional[int] = ..., prompt_embeds: _Optional[bytes] = ..., prompt_embeds_dtype: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "finish_reason", "num_kv_bytes", "kv_transfer_us", "num_cached_image_tokens", "kv_written_proof", "first_logprob", "prompt_logprobs", "num_prefix_cached_tokens", "num_prefix_cached_image_tokens")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_US_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_IMAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_WRITTEN_PROOF_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_CACHED_IMAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    finish_reason: _common_pb2.FinishReason
    num_kv_bytes: int
    kv_transfer_us: int
    num_cached_image_tokens: int
    kv_written_proof: bytes
    first_logprob: _common_pb2.TokenLogprob
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    num_prefix_cached_tokens: int
    num_prefix_cached_image_tokens: int
    def __init__(self, first_token_id: _Optional[int] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., num_kv_bytes: _Optional[int] = ..., kv_transfer_us: _Optional[int] = ..., num_cached_image_tokens: _Optional[int] = ..., kv_written_proof: _Optional[bytes] = ..., first_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., num_prefix_cached_tokens: _Optional[int] = ..., num_prefix_cached_image_tokens: _Optional[int] = ...) -> None: ...
