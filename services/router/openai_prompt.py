"""An OpenAI request's prompt as router types: a chat's messages (images loaded, tool calls
and results written in by ``ChatTurns``, which gRPC's chats go through too), or a completion's
prompts (texts or token ids) or ``prompt_embeds``."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.errors import InvalidRequestError
from services.common.types import ChatMessage, ContentPart, ImagePart, TextPart
from services.engine.processing import TextProcessor
from services.router import prompt_embeds, tool_prompt
from services.router.images import ImageLoader
from services.router.openai_schema import (
    ChatMessageBody,
    CompletionBody,
    ContentPartBody,
    ImageUrl,
    ToolCallBody,
    check_text,
)
from services.router.prompt_embeds import PromptEmbeds
from services.router.tool_parsers import ToolFormat

ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
# The image is processed at the model's own resolution limit, which is what "high" asks for.
IMAGE_DETAILS = (None, "auto", "high")


PromptInput = str | tuple[int, ...]  # a completion prompt: its text or its token ids


def completion_input(
    body: CompletionBody, max_context_len: int, text: TextProcessor
) -> list[PromptInput] | PromptEmbeds:
    """The completion's input: its prompts (one, or the batch in order), or its
    ``prompt_embeds`` unpacked (fewer rows than ``max_context_len``). ``text``: the model's
    tokenizer, which token ids are checked against."""
    if (body.prompt is None) == (body.prompt_embeds is None):
        raise InvalidRequestError("give exactly one of prompt and prompt_embeds", param="prompt")
    if body.prompt_embeds is not None:
        return prompt_embeds.from_base64(body.prompt_embeds, max_context_len)
    prompt = body.prompt
    assert prompt is not None
    if isinstance(prompt, str):
        return [check_text(prompt, "prompt")]
    if not prompt:
        raise InvalidRequestError("prompt must not be an empty list", param="prompt")
    if isinstance(prompt[0], int):
        return [_token_ids(prompt, "prompt", max_context_len, text)]  # type: ignore[arg-type]
    return [
        check_text(p, f"prompt[{i}]")
        if isinstance(p, str)
        else _token_ids(p, f"prompt[{i}]", max_context_len, text)
        for i, p in enumerate(prompt)
    ]


def _token_ids(
    ids: list[int], param: str, max_context_len: int, text: TextProcessor
) -> tuple[int, ...]:
    """A token-id prompt, checked as the tokenizer checks a text's ids: not empty, shorter
    than the context, every id in the vocabulary and none an image or video placeholder."""
    if not ids:
        raise InvalidRequestError(f"{param} must hold at least one token id", param=param)
    if len(ids) >= max_context_len:
        raise InvalidRequestError(
            f"{param} has {len(ids)} tokens; this model's context is {max_context_len} tokens",
            param=param,
        )
    vocab_size = text.vocab_size
    vision_ids = {text.image_token_id, text.video_token_id}
    for j, token_id in enumerate(ids):
        if not 0 <= token_id < vocab_size:
            raise InvalidRequestError(
                f"{param}[{j}] is {token_id}; token ids are in [0, {vocab_size})",
                param=f"{param}[{j}]",
            )
        if token_id in vision_ids:
            raise InvalidRequestError(
                f"{param}[{j}] is an image or video placeholder token; raw prompts carry no "
                "images (send images as chat messages)",
                param=f"{param}[{j}]",
            )
    return tuple(ids)


async def chat_messages(
    messages: list[ChatMessageBody],
    images: ImageLoader,
    tools: list[Any] | None = None,
    style: ToolFormat = ToolFormat.HERMES,
) -> tuple[ChatMessage, ...]:
    """The conversation as router types, with every image_url loaded as compressed bytes;
    ``tools`` (the request's tool objects), tool calls and tool results written in
    (``tool_prompt``) as the model's tool-call format ``style`` has them."""
    if not messages:
        raise InvalidRequestError("messages must hold at least one message", param="messages")
    turns = ChatTurns(style)
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        role = known_role(message.role, param)
        if message.name is not None:
            raise InvalidRequestError(
                "message names are not supported: the chat template has no participant names",
                param=f"{param}.name",
            )
        check_tool_fields(role, param, message.tool_calls is not None, message.tool_call_id)
        content = await _content(message.content, f"{param}.content", images)
        calls = (
            _sent_call(call, f"{param}.tool_calls[{j}]")
            for j, call in enumerate(message.tool_calls or ())
        )
        turns.add(role, content, param, calls, message.tool_call_id)
    return turns.messages(tools or ())


@dataclass(frozen=True)
class SentCall:
    """One tool call of an assistant turn, as a request sent it."""

    id: str
    name: str
    arguments: str  # a JSON object's text
    arguments_param: str  # its arguments' field: messages[1].tool_calls[0].function.arguments


def known_role(role: str, param: str) -> str:
    """The router's name of a message's sent ``role`` (``developer`` is ``system``);
    ``InvalidRequestError`` naming ``<param>.role`` for an unknown one."""
    known = ROLES.get(role)
    if known is None:
        raise InvalidRequestError(
            f"unknown role {role!r}; expected one of {', '.join(ROLES)}", param=f"{param}.role"
        )
    return known


def check_tool_fields(role: str, param: str, has_calls: bool, tool_call_id: str | None) -> None:
    """Only an assistant turn has tool calls, and a tool turn (always) and no other a
    ``tool_call_id``; ``role`` as ``known_role`` names it, ``param`` the message's field."""
    if has_calls and role != "assistant":
        raise InvalidRequestError(
            "only assistant messages have tool_calls", param=f"{param}.tool_calls"
        )
    if (tool_call_id is None) != (role != "tool"):
        raise InvalidRequestError(
            "a tool message needs a tool_call_id, and only tool messages have one",
            param=f"{param}.tool_call_id",
        )


class ChatTurns:
    """A conversation's turns as the router's chat messages, tool calls and results written in
    as the model's tool-call format ``style`` has them (``tool_prompt``): the HTTP API's
    messages and gRPC's ``ChatMessage``s both go through it, so one owner checks a tool turn
    (its ``tool_call_id`` names an earlier call; its content is text; a call's arguments are a
    JSON object's text). Each turn comes with ``param``, the request's field of the message
    (``messages[2]``, ``chat.messages[2]``), which its errors name; the caller checks the
    turn's role (``known_role``, ``check_tool_fields``) before loading its content."""

    def __init__(self, style: ToolFormat) -> None:
        self._style = style
        self._out: list[ChatMessage] = []
        self._call_ids: set[str] = set()
        self._last_role: str | None = None

    def add(
        self,
        role: str,
        content: tuple[ContentPart, ...],
        param: str,
        calls: Iterable[SentCall] = (),
        tool_call_id: str | None = None,
    ) -> None:
        """The next turn; ``calls``: an assistant turn's, checked in order as they come."""
        if role == "tool":
            text = tool_prompt.tool_response(self._tool_result(content, tool_call_id, param))
            if self._last_role == "tool":  # consecutive results form one user turn
                last = self._out[-1]
                self._out[-1] = ChatMessage("user", (*last.content, TextPart("\n" + text)))
            else:
                self._out.append(ChatMessage("user", (TextPart(text),)))
        elif checked := self._tool_calls(calls):
            text = tool_prompt.tool_calls(checked, after_text=bool(content), style=self._style)
            self._out.append(ChatMessage(role, (*content, TextPart(text))))
        else:
            self._out.append(ChatMessage(role, content))
        self._last_role = role

    def messages(self, tools: Sequence[Any] = ()) -> tuple[ChatMessage, ...]:
        """The turns so far, ``tools`` (the request's tool objects) listed in the system
        message."""
        return tool_prompt.with_tools(self._out, tools, self._style)

    def _tool_result(
        self, content: tuple[ContentPart, ...], tool_call_id: str | None, param: str
    ) -> str:
        if tool_call_id not in self._call_ids:
            raise InvalidRequestError(
                f"tool_call_id {tool_call_id!r} names no earlier assistant tool call",
                param=f"{param}.tool_call_id",
            )
        if any(not isinstance(part, TextPart) for part in content):
            raise InvalidRequestError(
                "a tool message's content must be text", param=f"{param}.content"
            )
        return "".join(part.text for part in content if isinstance(part, TextPart))

    def _tool_calls(self, calls: Iterable[SentCall]) -> list[tuple[str, dict[str, Any]]]:
        checked = []
        for call in calls:
            try:
                arguments = json.loads(call.arguments)
            except (ValueError, RecursionError):  # RecursionError: nested too deep
                arguments = None
            if not isinstance(arguments, dict):
                raise InvalidRequestError(
                    "arguments must be a JSON object's text", param=call.arguments_param
                )
            self._call_ids.add(call.id)
            checked.append((call.name, arguments))
        return checked


def _sent_call(call: ToolCallBody, param: str) -> SentCall:
    if call.type != "function":
        raise InvalidRequestError(
            f"unsupported tool call type {call.type!r}; expected function",
            param=f"{param}.type",
        )
    function = call.function
    return SentCall(call.id, function.name, function.arguments, f"{param}.function.arguments")


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
