"""OpenAI request bodies (pydantic, parsed by FastAPI) and their checks into router types.

Shape errors (missing or mistyped fields) are FastAPI's validation errors; range and
consistency errors are ``InvalidRequestError`` raised with the offending ``param``.
Types are strict: a boolean is ``true``/``false``, an integer is an integer (not ``1.0``,
``"1"`` or ``true``); a number field takes integers too.

Nothing a client sends is ignored. A field this server does not know is refused with a
400 naming it, as OpenAI does (vLLM logs and ignores them instead): a client that sends
a field expects its effect, and an ignored one gives a 200 without it. Every field
OpenAI defines is either honoured or refused with a message saying it is not supported
(``openai_params.py`` holds the refusals and the sampling fields' conversion).
"""

from __future__ import annotations

import json
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr

from services.common.errors import InvalidRequestError
from services.common.types import ChatMessage, ContentPart, ImagePart, TextPart
from services.router import prompt_embeds, tool_prompt
from services.router.images import ImageLoader
from services.router.prompt_embeds import PromptEmbeds

ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
# The image is processed at the model's own resolution limit, which is what "high" asks for.
IMAGE_DETAILS = (None, "auto", "high")


class Body(BaseModel):
    """A request body (or part of one): unknown fields are a 400, never ignored."""

    model_config = ConfigDict(extra="forbid")


class ImageUrl(Body):
    url: StrictStr
    detail: StrictStr | None = None  # auto or high; low (a downscaled image) is refused


class ContentPartBody(Body):
    type: StrictStr
    text: StrictStr | None = None
    image_url: ImageUrl | StrictStr | None = None


class FunctionBody(Body):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: StrictBool | None = None  # the arguments follow ``parameters`` exactly


class ToolBody(Body):
    type: StrictStr  # function
    function: FunctionBody


class NamedFunction(Body):
    name: StrictStr


class NamedToolChoice(Body):
    type: StrictStr  # function
    function: NamedFunction


class ToolCallFunction(Body):
    name: StrictStr
    arguments: StrictStr  # a JSON object's text


class ToolCallBody(Body):
    id: StrictStr
    type: StrictStr  # function
    function: ToolCallFunction


class ChatMessageBody(Body):
    role: StrictStr
    content: StrictStr | list[ContentPartBody] | None = None
    name: StrictStr | None = None  # refused: the chat template has no participant names
    tool_calls: list[ToolCallBody] | None = None  # assistant messages only
    tool_call_id: StrictStr | None = None  # tool messages: the call this is the result of


class StreamOptions(Body):
    include_usage: StrictBool = False


# (field, is its value one this server honours, why another value is refused)
Refusal = tuple[str, Any, str]


def _unset(value: Any) -> bool:
    return value is None


class _GenerationBody(Body):
    """The fields chat and text completions share (OpenAI's, then vLLM-style extensions)."""

    REFUSALS: ClassVar[tuple[Refusal, ...]] = (
        ("n", lambda v: v in (None, 1), "n > 1 (several choices) is not supported yet"),
        (
            "service_tier",
            lambda v: v in (None, "auto", "default"),
            "only the default service tier is supported",
        ),
    )
    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    n: StrictInt | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None  # only with stream: true
    frequency_penalty: StrictFloat | None = None
    presence_penalty: StrictFloat | None = None
    logit_bias: dict[StrictStr, StrictFloat] | None = None  # {"<token id>": bias in [-100, 100]}
    # End-user ids OpenAI keeps for abuse monitoring; they never change the output.
    user: StrictStr | None = None
    safety_identifier: StrictStr | None = None
    service_tier: StrictStr | None = None  # auto / default (the one tier)
    # Extensions (vLLM's names and meanings).
    top_k: StrictInt | None = None  # -1 or 0 = off
    min_p: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt | None = None  # EOS and stop_token_ids are masked until this many tokens
    stop_token_ids: list[StrictInt] | None = (
        None  # token ids that end generation (kept in the output)
    )
    # {"type": "text" | "json_object" | "json_schema", "json_schema": {name, schema, strict}}
    response_format: dict[str, Any] | None = None


class ChatCompletionBody(_GenerationBody):
    REFUSALS: ClassVar[tuple[Refusal, ...]] = (
        *_GenerationBody.REFUSALS,
        ("functions", _unset, "functions are not supported yet (no tools)"),
        ("function_call", _unset, "function_call is not supported yet (no tools)"),
        ("audio", _unset, "audio output is not supported"),
        ("modalities", lambda v: v in (None, ["text"]), 'only text output (["text"]) is supported'),
        ("prediction", _unset, "predicted outputs are not supported"),
        (
            "reasoning_effort",
            _unset,
            "reasoning_effort is not supported (the model does not reason)",
        ),
        ("verbosity", _unset, "verbosity is not supported"),
        ("web_search_options", _unset, "web search is not supported"),
        ("store", lambda v: not v, "stored completions are not supported"),
        ("metadata", _unset, "metadata is kept with stored completions, which are not supported"),
        ("prompt_cache_key", _unset, "prompt_cache_key is not supported"),
    )
    messages: list[ChatMessageBody]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None  # each output token's logprob (raw model log-softmax)
    top_logprobs: StrictInt | None = None  # 0..20 most likely tokens per position; needs logprobs
    tools: list[ToolBody] | None = None
    tool_choice: StrictStr | NamedToolChoice | None = None  # none / auto / required / named
    parallel_tool_calls: StrictBool | None = None
    functions: list[Any] | None = None
    function_call: StrictStr | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[StrictStr] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: StrictStr | None = None
    verbosity: StrictStr | None = None
    web_search_options: dict[str, Any] | None = None
    store: StrictBool | None = None
    metadata: dict[str, Any] | None = None
    prompt_cache_key: StrictStr | None = None


class CompletionBody(_GenerationBody):
    REFUSALS: ClassVar[tuple[Refusal, ...]] = (
        *_GenerationBody.REFUSALS,
        ("best_of", lambda v: v in (None, 1), "best_of > 1 is not supported yet"),
        ("suffix", lambda v: v in (None, ""), "suffix is not supported yet"),
    )
    prompt: StrictStr | list[StrictStr] | None = None
    # vLLM's format: base64 of torch.save of a [num_tokens, hidden] float32/bfloat16/float16 tensor
    prompt_embeds: StrictStr | None = None
    echo: StrictBool = False  # the prompt text comes first (with logprobs: its tokens' too)
    # 0..20 (OpenAI: 0..5; vLLM allows 20): the sampled tokens' logprobs and this many top ones
    logprobs: StrictInt | None = None
    # vLLM's extension, 0..20: each prompt token's logprob and this many top ones (not streamed)
    prompt_logprobs: StrictInt | None = None
    best_of: StrictInt | None = None
    suffix: StrictStr | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error body (documented in /openapi.json; the handlers write it with ``error_body``)."""

    error: ErrorDetail


class ModelNotFoundError(InvalidRequestError):
    """The request names a model this router does not serve (HTTP 400, code model_not_found)."""

    code = "model_not_found"


def check_model(model: str | None, served_model_name: str) -> None:
    if model not in (None, "", served_model_name):
        raise ModelNotFoundError(
            f"the model {model!r} does not exist; this server serves {served_model_name!r}",
            param="model",
        )


def check_text(text: str, param: str) -> str:
    """``text`` if it is valid Unicode; a lone surrogate (JSON ``"\\ud800"``) is refused."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{param} is not valid Unicode: it holds a lone surrogate at index {exc.start}",
            param=param,
        ) from None
    return text


def completion_input(body: CompletionBody, max_context_len: int) -> str | PromptEmbeds:
    """The completion's one input: its prompt text, or its ``prompt_embeds`` unpacked (fewer
    rows than ``max_context_len``)."""
    if (body.prompt is None) == (body.prompt_embeds is None):
        raise InvalidRequestError("give exactly one of prompt and prompt_embeds", param="prompt")
    if body.prompt_embeds is not None:
        return prompt_embeds.from_base64(body.prompt_embeds, max_context_len)
    return completion_prompt(body)


def completion_prompt(body: CompletionBody) -> str:
    assert body.prompt is not None
    if isinstance(body.prompt, str):
        return check_text(body.prompt, "prompt")
    if len(body.prompt) != 1:
        raise InvalidRequestError(
            f"prompt must be a string or a list of one string, got {len(body.prompt)}",
            param="prompt",
        )
    return check_text(body.prompt[0], "prompt[0]")


async def chat_messages(
    messages: list[ChatMessageBody], images: ImageLoader, tools: list[Any] | None = None
) -> tuple[ChatMessage, ...]:
    """The conversation as router types, with every image_url loaded as compressed bytes;
    ``tools`` (the request's tool objects), tool calls and tool results written in
    (``tool_prompt``)."""
    if not messages:
        raise InvalidRequestError("messages must hold at least one message", param="messages")
    out: list[ChatMessage] = []
    call_ids: set[str] = set()
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        role = _role(message, param)
        content = await _content(message.content, f"{param}.content", images)
        if role == "tool":
            text = tool_prompt.tool_response(_tool_result(message, content, call_ids, param))
            if i and messages[i - 1].role == "tool":
                out[-1] = ChatMessage("user", (*out[-1].content, TextPart("\n" + text)))
            else:
                out.append(ChatMessage("user", (TextPart(text),)))
        elif message.tool_calls:
            calls = _tool_calls(message.tool_calls, call_ids, f"{param}.tool_calls")
            if content:
                content = (*content, TextPart("\n"))
            out.append(ChatMessage(role, (*content, TextPart(calls))))
        else:
            out.append(ChatMessage(role, content))
    return tool_prompt.with_tools(out, tools or ())


def _role(message: ChatMessageBody, param: str) -> str:
    role = ROLES.get(message.role)
    if role is None:
        raise InvalidRequestError(
            f"unknown role {message.role!r}; expected one of {', '.join(ROLES)}",
            param=f"{param}.role",
        )
    if message.name is not None:
        raise InvalidRequestError(
            "message names are not supported: the chat template has no participant names",
            param=f"{param}.name",
        )
    if message.tool_calls is not None and role != "assistant":
        raise InvalidRequestError(
            "only assistant messages have tool_calls", param=f"{param}.tool_calls"
        )
    if (message.tool_call_id is None) != (role != "tool"):
        raise InvalidRequestError(
            "a tool message needs a tool_call_id, and only tool messages have one",
            param=f"{param}.tool_call_id",
        )
    return role


def _tool_result(
    message: ChatMessageBody, content: tuple[ContentPart, ...], call_ids: set[str], param: str
) -> str:
    if message.tool_call_id not in call_ids:
        raise InvalidRequestError(
            f"tool_call_id {message.tool_call_id!r} names no earlier assistant tool call",
            param=f"{param}.tool_call_id",
        )
    if any(not isinstance(part, TextPart) for part in content):
        raise InvalidRequestError("a tool message's content must be text", param=f"{param}.content")
    return "".join(part.text for part in content if isinstance(part, TextPart))


def _tool_calls(calls: list[ToolCallBody], call_ids: set[str], param: str) -> str:
    blocks = []
    for j, call in enumerate(calls):
        if call.type != "function":
            raise InvalidRequestError(
                f"unsupported tool call type {call.type!r}; expected function",
                param=f"{param}[{j}].type",
            )
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise InvalidRequestError(
                "arguments must be a JSON object's text",
                param=f"{param}[{j}].function.arguments",
            )
        call_ids.add(call.id)
        blocks.append(tool_prompt.tool_call(call.function.name, arguments))
    return "\n".join(blocks)


async def _content(
    content: str | list[ContentPartBody] | None, param: str, images: ImageLoader
) -> tuple[ContentPart, ...]:
    if content is None:
        return ()
    if isinstance(content, str):
        return (TextPart(check_text(content, param)),)
    parts: list[ContentPart] = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        if part.type == "text":
            _check_part_fields(part, where, needs="text", refuses="image_url")
            assert part.text is not None
            parts.append(TextPart(check_text(part.text, f"{where}.text")))
        elif part.type == "image_url":
            _check_part_fields(part, where, needs="image_url", refuses="text")
            parts.append(ImagePart(await _image(part.image_url, f"{where}.image_url", images)))
        else:
            raise InvalidRequestError(
                f"unsupported content part type {part.type!r}; expected text or image_url",
                param=f"{where}.type",
            )
    return tuple(parts)


def _check_part_fields(part: ContentPartBody, where: str, *, needs: str, refuses: str) -> None:
    if getattr(part, needs) is None:
        raise InvalidRequestError(
            f"a {part.type} part needs a {needs} field", param=f"{where}.{needs}"
        )
    if getattr(part, refuses) is not None:
        raise InvalidRequestError(
            f"a {part.type} part takes no {refuses} field", param=f"{where}.{refuses}"
        )


async def _image(image_url: ImageUrl | str | None, param: str, images: ImageLoader) -> bytes:
    assert image_url is not None
    if isinstance(image_url, str):
        return await images.load(image_url, param)
    if image_url.detail not in IMAGE_DETAILS:
        raise InvalidRequestError(
            f"image detail {image_url.detail!r} is not supported; images are processed at the "
            "model's full resolution (auto or high)",
            param=f"{param}.detail",
        )
    return await images.load(image_url.url, param)
