"""A Responses API request as the chat request the chat path serves, and the chat path's error
params named as the Responses request names them.

``instructions`` becomes a system message first; ``input`` (a string: one user message) its
messages, whose ``input_text`` / ``output_text`` parts are text parts and ``input_image`` parts
image_url parts; ``function_call`` items become the assistant's tool calls (joined to the
assistant turn before them) and ``function_call_output`` items tool messages. ``text.format``
becomes ``response_format``, the flat function tools chat's ``{"type": "function",
"function": {...}}``, ``max_output_tokens`` ``max_tokens``, ``include``'s output logprobs
``logprobs``. An error the chat path raises names a chat field (``messages[2].content[0]``);
``ChatForm.renamed`` names the Responses field it came from (``input[1].content[0]``).
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from services.common.errors import InvalidRequestError, StageServeError
from services.router.http_errors import validation_message
from services.router.openai_schema import (
    ChatCompletionBody,
    ChatMessageBody,
    ContentPartBody,
    FunctionBody,
    ImageUrl,
    NamedFunction,
    NamedToolChoice,
    ToolBody,
    ToolCallBody,
    ToolCallFunction,
)
from services.router.responses_schema import (
    MAX_METADATA_KEY_LEN,
    MAX_METADATA_PAIRS,
    MAX_METADATA_VALUE_LEN,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolBody,
    InputImagePart,
    InputTextPart,
    MessageItem,
    OutputTextPart,
    ResponsesBody,
    TextBody,
)

M = TypeVar("M", bound=BaseModel)
LOGPROBS_INCLUDE = "message.output_text.logprobs"
ROLES = ("user", "assistant", "system", "developer")
_RENAMED = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}
_MESSAGE = re.compile(r"messages\[(\d+)\](.*)")
_TOOL = re.compile(r"tools\[(\d+)\]\.function\.(.+)")
_CALL = re.compile(r"\.tool_calls\[(\d+)\]\.function\.(.+)")


@dataclass(frozen=True)
class Origin:
    """Where one chat message came from: the Responses field of the message, the one of its
    content, and the items of its tool calls."""

    item: str  # instructions, input, input[3]
    content: str
    calls: tuple[str, ...] = ()

    def param(self, rest: str) -> str:
        """The Responses field of this message's chat field ``messages[i]<rest>``."""
        if rest.startswith(".content"):
            return self.content + rest[len(".content") :].replace(".image_url.detail", ".detail")
        if call := _CALL.fullmatch(rest):
            return f"{self.calls[int(call[1])]}.{call[2]}"
        if rest == ".tool_call_id":
            return f"{self.item}.call_id"
        return self.item + rest


@dataclass(frozen=True)
class ChatForm:
    """A Responses request as a chat request, and where each chat message came from."""

    body: ChatCompletionBody
    origins: tuple[Origin, ...]

    def param(self, chat_param: str) -> str:
        if message := _MESSAGE.fullmatch(chat_param):
            return self.origins[int(message[1])].param(message[2])
        if tool := _TOOL.fullmatch(chat_param):
            return f"tools[{tool[1]}].{tool[2]}"
        return _RENAMED.get(chat_param, chat_param)

    def renamed(self, error: StageServeError) -> StageServeError:
        """``error`` naming the Responses field, in its param and message, where it named a
        chat field."""
        if error.param is None or (param := self.param(error.param)) == error.param:
            return error
        renamed = copy.copy(error)
        renamed.message = error.message.replace(error.param, param)
        renamed.param = param
        renamed.args = (renamed.message,)
        return renamed

    @contextlib.contextmanager
    def naming_responses_fields(self) -> Iterator[None]:
        try:
            yield
        except StageServeError as exc:
            raise self.renamed(exc) from None


def chat_form(body: ResponsesBody) -> ChatForm:
    """``body`` as a chat request; ``InvalidRequestError`` naming the Responses field this
    server does not serve."""
    for field, is_honoured, reason in body.REFUSALS:
        if not is_honoured(getattr(body, field)):
            raise InvalidRequestError(f"{field}: {reason}", param=field)
    if body.stream_options is not None and not body.stream:
        raise InvalidRequestError(
            "stream_options is only allowed when stream is true", param="stream_options"
        )
    _check_metadata(body.metadata or {})
    messages, origins = _messages(body)
    chat = ChatCompletionBody(
        model=body.model,
        messages=messages,
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        user=body.user,
        safety_identifier=body.safety_identifier,
        service_tier=body.service_tier,
        response_format=_response_format(body.text),
        logprobs=_wants_logprobs(body) or None,
        top_logprobs=body.top_logprobs,
        tools=_tools(body.tools),
        tool_choice=_tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls,
    )
    return ChatForm(chat, tuple(origins))


def _wants_logprobs(body: ResponsesBody) -> bool:
    """Whether ``include`` asks for the output text's logprobs (a 400 naming any other
    value, and ``top_logprobs`` without it)."""
    for i, value in enumerate(body.include or ()):
        if value != LOGPROBS_INCLUDE:
            raise InvalidRequestError(
                f"include {value!r} is not supported; only {LOGPROBS_INCLUDE} is",
                param=f"include[{i}]",
            )
    is_wanted = bool(body.include)
    if body.top_logprobs is not None and not is_wanted:
        raise InvalidRequestError(
            f'top_logprobs needs include: ["{LOGPROBS_INCLUDE}"]', param="top_logprobs"
        )
    return is_wanted


def _parsed(model: type[M], value: dict[str, Any], *loc: str | int) -> M:
    """``value`` as ``model``; a field error is the 400 FastAPI's validation of the body
    would give, at ``loc``."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        errors = [{**error, "loc": ("body", *loc, *error["loc"])} for error in exc.errors()]
        message, param = validation_message(RequestValidationError(errors))
        raise InvalidRequestError(message, param=param) from None


def _check_metadata(metadata: dict[str, str]) -> None:
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidRequestError(
            f"metadata holds {len(metadata)} pairs; at most {MAX_METADATA_PAIRS} are allowed",
            param="metadata",
        )
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_LEN or len(value) > MAX_METADATA_VALUE_LEN:
            raise InvalidRequestError(
                f"metadata keys are at most {MAX_METADATA_KEY_LEN} characters and values at "
                f"most {MAX_METADATA_VALUE_LEN}",
                param=f"metadata.{key[:MAX_METADATA_KEY_LEN]}",
            )


def _messages(body: ResponsesBody) -> tuple[list[ChatMessageBody], list[Origin]]:
    messages: list[ChatMessageBody] = []
    origins: list[Origin] = []
    if body.instructions is not None:
        messages.append(ChatMessageBody(role="system", content=body.instructions))
        origins.append(Origin("instructions", "instructions"))
    if isinstance(body.input, str):
        messages.append(ChatMessageBody(role="user", content=body.input))
        origins.append(Origin("input", "input"))
        return messages, origins
    if not body.input:
        raise InvalidRequestError("input must hold at least one item", param="input")
    call_ids: set[str] = set()
    for i, raw in enumerate(body.input):
        param, kind = f"input[{i}]", raw.get("type", "message")
        if kind == "message":
            messages.append(_message(_parsed(MessageItem, raw, "input", i), i))
            origins.append(Origin(param, f"{param}.content"))
        elif kind == "function_call":
            call = _parsed(FunctionCallItem, raw, "input", i)
            call_ids.add(call.call_id)
            _add_call(messages, origins, call, param)
        elif kind == "function_call_output":
            result = _parsed(FunctionCallOutputItem, raw, "input", i)
            if result.call_id not in call_ids:
                raise InvalidRequestError(
                    f"call_id {result.call_id!r} names no earlier function_call item in input",
                    param=f"{param}.call_id",
                )
            messages.append(
                ChatMessageBody(role="tool", tool_call_id=result.call_id, content=result.output)
            )
            origins.append(Origin(param, f"{param}.output"))
        else:
            raise InvalidRequestError(
                f"input item type {kind!r} is not supported; expected message, function_call "
                "or function_call_output",
                param=f"{param}.type",
            )
    return messages, origins


def _message(item: MessageItem, i: int) -> ChatMessageBody:
    param = f"input[{i}]"
    if item.type not in (None, "message"):
        raise InvalidRequestError("a message item's type is message", param=f"{param}.type")
    if item.role not in ROLES:
        raise InvalidRequestError(
            f"unknown role {item.role!r}; expected one of {', '.join(ROLES)}",
            param=f"{param}.role",
        )
    if isinstance(item.content, str):
        return ChatMessageBody(role=item.role, content=item.content)
    parts = [_part(part, i, j) for j, part in enumerate(item.content)]
    return ChatMessageBody(role=item.role, content=parts)


def _part(raw: dict[str, Any], i: int, j: int) -> ContentPartBody:
    where, kind, loc = f"input[{i}].content[{j}]", raw.get("type"), ("input", i, "content", j)
    if kind in ("input_text", "output_text"):
        model = InputTextPart if kind == "input_text" else OutputTextPart
        return ContentPartBody(type="text", text=_parsed(model, raw, *loc).text)
    if kind != "input_image":
        raise InvalidRequestError(
            f"content part type {kind!r} is not supported; expected input_text, input_image "
            "or output_text",
            param=f"{where}.type",
        )
    image = _parsed(InputImagePart, raw, *loc)
    if image.file_id is not None:
        raise InvalidRequestError(
            "file_id: there is no files API here; send image_url (a data URL or an http(s) URL)",
            param=f"{where}.file_id",
        )
    if image.image_url is None:
        raise InvalidRequestError("an input_image part needs image_url", param=f"{where}.image_url")
    url = ImageUrl(url=image.image_url, detail=image.detail)
    return ContentPartBody(type="image_url", image_url=url)


def _add_call(
    messages: list[ChatMessageBody], origins: list[Origin], call: FunctionCallItem, param: str
) -> None:
    """The call as a tool call of the assistant turn it follows, or of a new one."""
    body = ToolCallBody(
        id=call.call_id,
        type="function",
        function=ToolCallFunction(name=call.name, arguments=call.arguments),
    )
    if not messages or messages[-1].role != "assistant":
        messages.append(ChatMessageBody(role="assistant", content=None))
        origins.append(Origin(param, f"{param}.content"))
    last = messages[-1]
    messages[-1] = last.model_copy(update={"tool_calls": [*(last.tool_calls or ()), body]})
    origins[-1] = Origin(origins[-1].item, origins[-1].content, (*origins[-1].calls, param))


def _response_format(text: TextBody | None) -> dict[str, Any] | None:
    if text is not None and text.verbosity is not None:
        raise InvalidRequestError("text.verbosity is not supported", param="text.verbosity")
    fmt = None if text is None else text.format
    if fmt is None:
        return None
    given = fmt.model_dump(exclude_none=True, by_alias=True)
    if fmt.type in ("text", "json_object"):
        if len(given) > 1:
            raise InvalidRequestError(
                f"a {fmt.type} format takes no field but type", param="text.format"
            )
        return {"type": fmt.type}
    if fmt.type != "json_schema":
        raise InvalidRequestError(
            f"text.format type {fmt.type!r} is not supported; expected text, json_object or "
            "json_schema",
            param="text.format.type",
        )
    if fmt.name is None:
        raise InvalidRequestError("a json_schema format needs a name", param="text.format.name")
    del given["type"]
    return {"type": "json_schema", "json_schema": given}


def _tools(tools: list[dict[str, Any]] | None) -> list[ToolBody] | None:
    """Chat's tools; an empty list asks for none, as leaving tools out does."""
    if not tools:
        return None
    out = []
    for i, raw in enumerate(tools):
        kind = raw.get("type")
        if kind != "function":
            raise InvalidRequestError(
                f"tool type {kind!r} is not supported; only function tools are (built-in tools "
                "such as web_search run on OpenAI's servers)",
                param=f"tools[{i}].type",
            )
        tool = _parsed(FunctionToolBody, raw, "tools", i)
        function = FunctionBody(
            name=tool.name,
            description=tool.description,
            parameters=tool.parameters,
            strict=tool.strict,
        )
        out.append(ToolBody(type="function", function=function))
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | NamedToolChoice | None:
    if choice is None or isinstance(choice, str):
        return choice
    name = choice.get("name")
    is_named = choice.get("type") == "function" and set(choice) == {"type", "name"}
    if not is_named or not isinstance(name, str):
        raise InvalidRequestError(
            'tool_choice must be none, auto, required or {"type": "function", "name": ...}',
            param="tool_choice",
        )
    return NamedToolChoice(type="function", function=NamedFunction(name=name))
