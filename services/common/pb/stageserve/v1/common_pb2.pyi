from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]

class KvBufferKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_BUFFER_KIND_UNSPECIFIED: _ClassVar[KvBufferKind]
    KV_BUFFER_KIND_K: _ClassVar[KvBufferKind]
    KV_BUFFER_KIND_V: _ClassVar[KvBufferKind]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
KV_BUFFER_KIND_UNSPECIFIED: KvBufferKind
KV_BUFFER_KIND_K: KvBufferKind
KV_BUFFER_KIND_V: KvBufferKind

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty", "seed", "max_new_tokens", "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias", "return_logprobs", "num_top_logprobs", "grammar", "num_prompt_logprobs")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    seed: int
    max_new_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    min_tokens: int
    logit_bias: _containers.RepeatedCompositeFieldContainer[LogitBias]
    return_logprobs: bool
    num_top_logprobs: int
    grammar: Grammar
    num_prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., seed: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Iterable[_Union[LogitBias, _Mapping]]] = ..., return_logprobs: _Optional[bool] = ..., num_top_logprobs: _Optional[int] = ..., grammar: _Optional[_Union[Grammar, _Mapping]] = ..., num_prompt_logprobs: _Optional[int] = ...) -> None: ...

class Grammar(_message.Message):
    __slots__ = ("kind", "spec", "is_strict")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    IS_STRICT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    spec: str
    is_strict: bool
    def __init__(self, kind: _Optional[str] = ..., spec: _Optional[str] = ..., is_strict: _Optional[bool] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class LogitBias(_message.Message):
    __slots__ = ("token_id", "bias")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    bias: float
    def __init__(self, token_id: _Optional[int] = ..., bias: _Optional[float] = ...) -> None: ...

class ImageSpan(_message.Message):
    __slots__ = ("offset", "length", "content_hash", "grid_t", "grid_h", "grid_w")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    GRID_T_FIELD_NUMBER: _ClassVar[int]
    GRID_H_FIELD_NUMBER: _ClassVar[int]
    GRID_W_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    content_hash: str
    grid_t: int
    grid_h: int
    grid_w: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ..., content_hash: _Optional[str] = ..., grid_t: _Optional[int] = ..., grid_h: _Optional[int] = ..., grid_w: _Optional[int] = ...) -> None: ...

class ImageData(_message.Message):
    __slots__ = ("content_hash", "data")
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    content_hash: str
    data: bytes
    def __init__(self, content_hash: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...

class ImageInput(_message.Message):
    __slots__ = ("data", "url")
    DATA_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    url: str
    def __init__(self, data: _Optional[bytes] = ..., url: _Optional[str] = ...) -> None: ...

class ImageHeaderInput(_message.Message):
    __slots__ = ("content_hash", "height", "width", "num_bytes")
    CONTENT_HASH_FIELD_NUMBER: _ClassVar[int]
    HEIGHT_FIELD_NUMBER: _ClassVar[int]
    WIDTH_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    content_hash: str
    height: int
    width: int
    num_bytes: int
    def __init__(self, content_hash: _Optional[str] = ..., height: _Optional[int] = ..., width: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class ContentPart(_message.Message):
    __slots__ = ("text", "image", "image_header")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    IMAGE_HEADER_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: ImageInput
    image_header: ImageHeaderInput
    def __init__(self, text: _Optional[str] = ..., image: _Optional[_Union[ImageInput, _Mapping]] = ..., image_header: _Optional[_Union[ImageHeaderInput, _Mapping]] = ...) -> None: ...

class ToolCall(_message.Message):
    __slots__ = ("id", "name", "arguments")
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    arguments: str
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: _containers.RepeatedCompositeFieldContainer[ContentPart]
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCall]
    tool_call_id: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[_Iterable[_Union[ContentPart, _Mapping]]] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("num_prompt_tokens", "num_completion_tokens", "num_cached_image_tokens", "num_prefix_cached_tokens", "num_prefix_cached_image_tokens")
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_IMAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_CACHED_IMAGE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    num_prompt_tokens: int
    num_completion_tokens: int
    num_cached_image_tokens: int
    num_prefix_cached_tokens: int
    num_prefix_cached_image_tokens: int
    def __init__(self, num_prompt_tokens: _Optional[int] = ..., num_completion_tokens: _Optional[int] = ..., num_cached_image_tokens: _Optional[int] = ..., num_prefix_cached_tokens: _Optional[int] = ..., num_prefix_cached_image_tokens: _Optional[int] = ...) -> None: ...

class KvBuffer(_message.Message):
    __slots__ = ("kind", "base_address", "size_bytes", "layer_stride_bytes", "page_stride_bytes", "slot_stride_bytes")
    KIND_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYER_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOT_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    kind: KvBufferKind
    base_address: int
    size_bytes: int
    layer_stride_bytes: int
    page_stride_bytes: int
    slot_stride_bytes: int
    def __init__(self, kind: _Optional[_Union[KvBufferKind, str]] = ..., base_address: _Optional[int] = ..., size_bytes: _Optional[int] = ..., layer_stride_bytes: _Optional[int] = ..., page_stride_bytes: _Optional[int] = ..., slot_stride_bytes: _Optional[int] = ...) -> None: ...

class KvRef(_message.Message):
    __slots__ = ("backend", "session_id", "dp_rank", "page_ids", "page_size", "num_layers", "num_kv_heads", "head_dim", "dtype", "buffers", "request_id", "nonce", "expires_unix_ms", "mac", "tp_shards")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    TP_SHARDS_FIELD_NUMBER: _ClassVar[int]
    backend: str
    session_id: str
    dp_rank: int
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    buffers: _containers.RepeatedCompositeFieldContainer[KvBuffer]
    request_id: str
    nonce: bytes
    expires_unix_ms: int
    mac: bytes
    tp_shards: _containers.RepeatedCompositeFieldContainer[KvRefShard]
    def __init__(self, backend: _Optional[str] = ..., session_id: _Optional[str] = ..., dp_rank: _Optional[int] = ..., page_ids: _Optional[_Iterable[int]] = ..., page_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[str] = ..., buffers: _Optional[_Iterable[_Union[KvBuffer, _Mapping]]] = ..., request_id: _Optional[str] = ..., nonce: _Optional[bytes] = ..., expires_unix_ms: _Optional[int] = ..., mac: _Optional[bytes] = ..., tp_shards: _Optional[_Iterable[_Union[KvRefShard, _Mapping]]] = ...) -> None: ...

class KvRefShard(_message.Message):
    __slots__ = ("session_id", "buffers", "head_start")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    buffers: _containers.RepeatedCompositeFieldContainer[KvBuffer]
    head_start: int
    def __init__(self, session_id: _Optional[str] = ..., buffers: _Optional[_Iterable[_Union[KvBuffer, _Mapping]]] = ..., head_start: _Optional[int] = ...) -> None: ...

class EmbeddingRef(_message.Message):
    __slots__ = ("backend", "engine_address", "session_id", "cp_rank", "base_address", "num_rows", "row_stride_bytes", "hidden_size", "dtype")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    CP_RANK_FIELD_NUMBER: _ClassVar[int]
    BASE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    ROW_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    backend: str
    engine_address: str
    session_id: str
    cp_rank: int
    base_address: int
    num_rows: int
    row_stride_bytes: int
    hidden_size: int
    dtype: str
    def __init__(self, backend: _Optional[str] = ..., engine_address: _Optional[str] = ..., session_id: _Optional[str] = ..., cp_rank: _Optional[int] = ..., base_address: _Optional[int] = ..., num_rows: _Optional[int] = ..., row_stride_bytes: _Optional[int] = ..., hidden_size: _Optional[int] = ..., dtype: _Optional[str] = ...) -> None: ...
