"""A chat request checked and turned into one generation: its sampling options, its tool plan
(with the call grammar where a call is required), the grammar compiled, its messages with the
images loaded. ``/v1/chat/completions`` serves the plan; ``/v1/responses`` plans the chat
request it converts to (``responses_input.py``); gRPC ``Router.Generate`` makes the same plan
from its request (``servicer.py``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import Request

from services.common.types import SamplingParams
from services.router.chat_template import check_final_message, template_options
from services.router.generation import GenerationPipeline
from services.router.http_responses import until_disconnect
from services.router.images import ImageLoader
from services.router.openai_params import GenerationOptions, generation_options
from services.router.openai_prompt import chat_messages
from services.router.openai_schema import ChatCompletionBody
from services.router.tool_parsers import ToolFormat
from services.router.tools import ToolPlan, tool_plan
from services.router.types import GenerationRequest


@dataclass(frozen=True)
class ChatPlan:
    generation: GenerationRequest
    num_choices: int  # n
    tools: ToolPlan | None  # None: the request has no tools


def generation_request(
    request_id: str, options: GenerationOptions, timeout_s: float, **prompt: Any
) -> GenerationRequest:
    """The generation of a checked request; ``prompt``: ``GenerationRequest``'s prompt field
    (and a chat's ``template``)."""
    return GenerationRequest(
        request_id,
        **prompt,
        params=options.params,
        max_tokens=options.max_tokens,
        max_tokens_param=options.max_tokens_param,
        stop=options.stop,
        timeout_s=timeout_s,
        skip_special_tokens=options.skip_special_tokens,
    )


def with_tool_grammar(
    params: SamplingParams, grammar_param: str, tools: ToolPlan | None
) -> tuple[SamplingParams, str]:
    """``params`` under the tools' call grammar where they require a call (the field to blame
    then: ``tools``), else as they are; with the field that set the grammar."""
    if tools is None or tools.grammar is None:
        return params, grammar_param
    return msgspec.structs.replace(params, grammar=tools.grammar), "tools"


@dataclass(frozen=True)
class ChatPlanner:
    pipeline: GenerationPipeline
    images: ImageLoader
    tool_format: ToolFormat  # the model's tool-call format
    max_stop_strings: int
    max_n: int
    request_timeout_s: float

    async def plan(self, body: ChatCompletionBody, request: Request, request_id: str) -> ChatPlan:
        """``InvalidRequestError`` naming the chat field at fault; ``AbortedError`` when the
        client goes away while images load."""
        options = generation_options(body, self.max_stop_strings, self.max_n)
        template = template_options(
            body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs
        )
        tools = tool_plan(body, self.tool_format)
        params, grammar_param = with_tool_grammar(options.params, options.grammar_param, tools)
        options = dataclasses.replace(options, params=params)
        await self.pipeline.check_grammar(options.params, grammar_param)
        listed = None if tools is None else list(tools.tools)
        messages = await until_disconnect(
            request, chat_messages(body.messages, self.images, listed, self.tool_format)
        )
        check_final_message(template, messages)
        generation = generation_request(
            request_id, options, self.request_timeout_s, messages=messages, template=template
        )
        return ChatPlan(generation, options.num_choices, tools)
