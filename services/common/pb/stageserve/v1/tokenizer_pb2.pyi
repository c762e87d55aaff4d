from services.common.pb.stageserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TokenizeRequest(_message.Message):
    __slots__ = ("request_id", "chat", "prompt", "add_generation_prompt", "continue_final_message", "chat_template_kwargs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chat: _common_pb2.ChatMessages
    prompt: str
    add_generation_prompt: bool
    continue_final_message: bool
    chat_template_kwargs: str
    def __init__(self, request_id: _Optional[str] = ..., chat: _Optional[_Union[_common_pb2.ChatMessages, _Mapping]] = ..., prompt: _Optional[str] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., chat_template_kwargs: _Optional[str] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "image_spans", "mrope_position_delta")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IMAGE_SPANS_FIELD_NUMBER: _ClassVar[int]
    MROPE_POSITION_DELTA_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    image_spans: _containers.RepeatedCompositeFieldContainer[_common_pb2.ImageSpan]
    mrope_position_delta: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., image_spans: _Optional[_Iterable[_Union[_common_pb2.ImageSpan, _Mapping]]] = ..., mrope_position_delta: _Optional[int] = ...) -> None: ...
