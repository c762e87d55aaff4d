"""The checks and conversions of a ``GenerateRequest``'s own fields, for the gRPC servicer.

Each rule is the HTTP API's, reached through its code (``sampling_params_from_proto``,
``template_options``): a field unknown to this server's protos is refused, never ignored.
"""

from __future__ import annotations

import json

import msgspec
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from services.common.errors import InvalidRequestError
from services.common.pb.stageserve.v1 import router_pb2
from services.common.types import SamplingParams
from services.common.wire import sampling_params_from_proto
from services.engine.processing.chat import template_kwargs_from_json
from services.router.chat_template import template_options
from services.router.tools import FunctionTool
from services.router.types import ChatTemplateOptions


def check_known_fields(message: Message, path: str = "") -> None:
    """``InvalidRequestError`` when ``message`` or a message inside it carries fields unknown
    here."""
    unknown = sorted({field.field_number for field in UnknownFieldSet(message)})
    if unknown:
        where = path or type(message).DESCRIPTOR.name
        raise InvalidRequestError(
            f"{where} has fields this server does not know (field numbers "
            f"{', '.join(map(str, unknown))}); unknown fields are refused, not ignored",
            param=path or None,
        )
    for descriptor, value in message.ListFields():
        if descriptor.message_type is None:
            continue
        name = f"{path}.{descriptor.name}" if path else descriptor.name
        if descriptor.is_repeated:
            for i, item in enumerate(value):
                check_known_fields(item, f"{name}[{i}]")
        else:
            check_known_fields(value, name)


def sampling_params(request: router_pb2.GenerateRequest) -> tuple[SamplingParams, int]:
    """The request's sampling parameters (unset optional fields take the engine defaults, the
    proto's documented ones) and its max_tokens: 0 for the prompt alone (max_new_tokens set to
    0 with num_prompt_logprobs, as HTTP's echo with max_tokens 0)."""
    message = request.sampling_params
    params = sampling_params_from_proto(message)
    if params.num_prompt_logprobs >= 0 and request.WhichOneof("input") != "prompt":
        raise InvalidRequestError(
            "num_prompt_logprobs needs a prompt, not chat or prompt_embeds (as on the HTTP "
            "API, where completions take prompt_logprobs and echo and chat takes neither)",
            param="num_prompt_logprobs",
        )
    is_prompt_only = message.HasField("max_new_tokens") and message.max_new_tokens == 0
    if is_prompt_only:
        if params.num_prompt_logprobs < 0:
            raise InvalidRequestError(
                "max_new_tokens must be > 0, got 0 (0 needs num_prompt_logprobs: the prompt alone)",
                param="max_new_tokens",
            )
        if params.min_tokens:
            raise InvalidRequestError(
                f"min_tokens must be 0 with max_new_tokens 0, got {params.min_tokens}",
                param="min_tokens",
            )
        params = msgspec.structs.replace(params, max_new_tokens=1)
    params.validate()
    return params, 0 if is_prompt_only else params.max_new_tokens


TEMPLATE_FIELDS = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs")


def template_options_of(request: router_pb2.GenerateRequest) -> ChatTemplateOptions:
    """The chat template fields checked as the HTTP API's; set beside a prompt or
    prompt_embeds (which no template renders), INVALID_ARGUMENT naming the field."""
    if request.WhichOneof("input") != "chat":
        for name in TEMPLATE_FIELDS:
            is_set = (
                request.HasField(name)
                if name == "add_generation_prompt"
                else getattr(request, name)
            )
            if is_set:
                raise InvalidRequestError(
                    f"{name} needs a chat input (no chat template renders a prompt)", param=name
                )
        return ChatTemplateOptions()
    add_generation_prompt = (
        request.add_generation_prompt if request.HasField("add_generation_prompt") else True
    )
    kwargs = template_kwargs_from_json(request.chat_template_kwargs)
    return template_options(add_generation_prompt, request.continue_final_message, kwargs)


def function_tool(tool: router_pb2.Tool, param: str) -> FunctionTool:
    parameters = None
    if tool.parameters:
        try:
            parameters = json.loads(tool.parameters)
        except (ValueError, RecursionError):
            parameters = None
        if not isinstance(parameters, dict):
            raise InvalidRequestError(
                f"{param}.parameters must be a JSON object's text (the arguments' JSON schema)",
                param=f"{param}.parameters",
            )
    return FunctionTool(tool.name, tool.description or None, parameters)
