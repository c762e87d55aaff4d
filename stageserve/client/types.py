"""The client's request and result types, and their proto forms (``stageserve.v1.Router``)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.errors import InvalidRequestError, StageServeError
from services.common.pb.stageserve.v1 import common_pb2, router_pb2
from services.common.types import FinishReason, Grammar, TokenLogprob, Usage
from services.common.wire import (
    finish_reason_from_proto,
    token_logprob_from_proto,
    usage_from_proto,
)


@dataclass(frozen=True)
class Image:
    """One image of a chat message: its compressed bytes (PNG, JPEG, WebP, ...), or a URL the
    router fetches (``http(s)://``, or ``data:image/<type>;base64,...``). Exactly one."""

    data: bytes | None = None
    url: str | None = None

    def __post_init__(self) -> None:
        if (self.data is None) == (self.url is None):
            raise InvalidRequestError("an Image takes exactly one of data and url", param="image")

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Image:
        return cls(data=Path(path).read_bytes())


@dataclass(frozen=True)
class Message:
    """One turn of a conversation: its role (``system``, ``user``, ``assistant`` or ``tool``)
    and its content, a string or a sequence of strings and images in order. An assistant turn
    may carry ``tool_calls`` (a ``Completion``'s, say); a ``tool`` turn holds, as text, the
    result of the earlier call its ``tool_call_id`` names."""

    role: str
    content: str | Sequence[str | Image] = ()
    tool_calls: Sequence[ToolCall] = ()  # assistant turns only
    tool_call_id: str = ""  # tool turns only, and there required


@dataclass(frozen=True)
class Sampling:
    """How tokens are drawn. A field left at None (or empty) takes the server's default, which
    ``SamplingParams`` in ``stageserve/v1/common.proto`` documents, as it does each range."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    max_new_tokens: int | None = None
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: Mapping[int, float] = field(default_factory=dict)  # token id -> bias
    return_logprobs: bool = False  # each token's logprob (raw model log-softmax) in the chunks
    num_top_logprobs: int = 0  # with return_logprobs: the most likely tokens' too, in [0, 20]
    grammar: Grammar | None = None  # the grammar the output follows (structured outputs)
    # a prompt's logprobs (and this many top ones' each) in each choice's first chunk; with
    # max_new_tokens=0, the prompt alone
    num_prompt_logprobs: int | None = None

    def to_proto(self) -> common_pb2.SamplingParams:
        optional = {
            name: getattr(self, name)
            for name in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "repetition_penalty",
                "frequency_penalty",
                "presence_penalty",
                "seed",
                "max_new_tokens",
                "num_prompt_logprobs",
            )
            if getattr(self, name) is not None
        }
        grammar = self.grammar
        if grammar is not None:
            optional["grammar"] = common_pb2.Grammar(
                kind=grammar.kind.value, spec=grammar.spec, is_strict=grammar.is_strict
            )
        return common_pb2.SamplingParams(
            **optional,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            return_logprobs=self.return_logprobs,
            num_top_logprobs=self.num_top_logprobs,
            logit_bias=[
                common_pb2.LogitBias(token_id=token_id, bias=bias)
                for token_id, bias in self.logit_bias.items()
            ],
        )


@dataclass(frozen=True)
class Tool:
    """A function the model may call (chat only): its name, what it does, and the JSON schema
    of its arguments object."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] | None = None

    def to_proto(self) -> router_pb2.Tool:
        parameters = "" if self.parameters is None else json.dumps(self.parameters)
        return router_pb2.Tool(name=self.name, description=self.description, parameters=parameters)


@dataclass(frozen=True)
class ToolChoice:
    """How the output may call the tools: a ``mode`` (``none``, ``auto``, ``required``) or the
    ``function_name`` of the one tool it calls. Exactly one."""

    mode: str | None = None
    function_name: str | None = None

    def __post_init__(self) -> None:
        if (self.mode is None) == (self.function_name is None):
            raise InvalidRequestError(
                "a ToolChoice takes exactly one of mode and function_name", param="tool_choice"
            )

    def to_proto(self) -> router_pb2.ToolChoice:
        if self.mode is not None:
            return router_pb2.ToolChoice(mode=self.mode)
        return router_pb2.ToolChoice(function_name=self.function_name)


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a tool call in a chunk: the call's first piece has its ``id`` and ``name``,
    and each piece the next part of its arguments' JSON text."""

    index: int  # the call's place among its choice's calls
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCall:
    """A tool call of a whole output: ``arguments`` is JSON text as the model wrote it (cut
    short when the output hit max_new_tokens)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Chunk:
    """One streamed message: the text and token ids generated since the previous one (and their
    logprobs when ``Sampling.return_logprobs``). Only the last chunk of a stream has
    ``finish_reason`` and ``usage``."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # parallel to token_ids, or empty
    choice_index: int = 0  # the choice it belongs to (num_choices > 1)
    # a choice's first chunk with Sampling.num_prompt_logprobs: the prompt's token ids and the
    # logprobs of tokens 1 .. n-1 (the first has none)
    prompt_token_ids: tuple[int, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    # with tools (tool_choice not "none"): text is the content that is not a call
    tool_calls: tuple[ToolCallDelta, ...] = ()


@dataclass(frozen=True)
class Completion:
    """A whole choice: every chunk's text and token ids, and the last one's ending."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason  # STOP with tool_calls: OpenAI's "tool_calls"
    usage: Usage  # this choice's (the prompt counts in each choice)
    logprobs: tuple[TokenLogprob, ...] = ()  # parallel to token_ids, or empty
    choice_index: int = 0
    prompt_token_ids: tuple[int, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()


class _ChoiceBuilder:
    def __init__(self) -> None:
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.calls: list[list[str]] = []  # id, name, arguments
        self.first: Chunk | None = None
        self.last: Chunk | None = None

    def add(self, chunk: Chunk) -> None:
        self.first = self.first or chunk
        self.texts.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        for piece in chunk.tool_calls:
            if piece.index == len(self.calls):
                self.calls.append([piece.id, piece.name, ""])
            self.calls[piece.index][2] += piece.arguments
        self.last = chunk

    def completion(self) -> Completion:
        first, last = self.first, self.last
        if first is None or last is None or last.finish_reason is None or last.usage is None:
            raise StageServeError("the server ended the stream without its final message")
        return Completion(
            last.request_id,
            "".join(self.texts),
            tuple(self.token_ids),
            last.finish_reason,
            last.usage,
            tuple(self.logprobs),
            last.choice_index,
            first.prompt_token_ids,
            first.prompt_logprobs,
            tuple(ToolCall(*call) for call in self.calls),
        )


class CompletionBuilder:
    """Joins a stream's chunks into its choices' ``Completion``s."""

    def __init__(self) -> None:
        self._choices: dict[int, _ChoiceBuilder] = {}

    def add(self, chunk: Chunk) -> None:
        self._choices.setdefault(chunk.choice_index, _ChoiceBuilder()).add(chunk)

    def completions(self) -> tuple[Completion, ...]:
        """Every choice's, by index; ``StageServeError`` when the stream ended without a
        choice's final chunk."""
        if not self._choices or sorted(self._choices) != list(range(len(self._choices))):
            raise StageServeError("the server ended the stream without its final message")
        return tuple(self._choices[i].completion() for i in range(len(self._choices)))

    def completion(self) -> Completion:
        """The one choice's (``completions`` for several)."""
        completions = self.completions()
        if len(completions) != 1:
            raise StageServeError(f"the call has {len(completions)} choices; read completions()")
        return completions[0]


def build_request(
    *,
    prompt: str | None,
    messages: Sequence[Message] | None,
    sampling: Sampling | None,
    stop: Sequence[str],
    model: str,
    request_id: str,
    num_choices: int = 1,
    tools: Sequence[Tool] = (),
    tool_choice: str | ToolChoice | None = None,
    parallel_tool_calls: bool | None = None,
    add_generation_prompt: bool | None = None,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    skip_special_tokens: bool | None = None,
) -> router_pb2.GenerateRequest:
    """The GenerateRequest of one call; ``InvalidRequestError`` for input the proto cannot
    carry (both or neither of ``prompt`` and ``messages``, a value outside its field's type,
    ``chat_template_kwargs`` that is not JSON)."""
    if (prompt is None) == (messages is None):
        raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
    if isinstance(tool_choice, str):
        tool_choice = ToolChoice(mode=tool_choice)
    try:
        kwargs = dict(chat_template_kwargs or {})
        kwargs_json = json.dumps(kwargs, allow_nan=False) if kwargs else ""
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidRequestError(
            f"chat_template_kwargs must be a JSON object: {exc}", param="chat_template_kwargs"
        ) from None
    try:
        request = router_pb2.GenerateRequest(
            request_id=request_id,
            model=model,
            sampling_params=(sampling or Sampling()).to_proto(),
            stop=list(stop),
            num_choices=num_choices,
            tools=[tool.to_proto() for tool in tools],
            parallel_tool_calls=parallel_tool_calls,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=kwargs_json,
            skip_special_tokens=skip_special_tokens,
        )
        if tool_choice is not None:
            request.tool_choice.CopyFrom(tool_choice.to_proto())
        if prompt is not None:
            request.prompt = prompt
        else:
            assert messages is not None
            request.chat.CopyFrom(_chat(messages))
    except (TypeError, ValueError) as exc:  # protobuf's refusal of a value
        raise InvalidRequestError(f"the request cannot be encoded: {exc}") from exc
    return request


def _chat(messages: Sequence[Message]) -> common_pb2.ChatMessages:
    chat = common_pb2.ChatMessages()
    for message in messages:
        proto = chat.messages.add(role=message.role, tool_call_id=message.tool_call_id)
        for call in message.tool_calls:
            if not isinstance(call, ToolCall):
                raise TypeError(f"a tool call is a ToolCall, not {type(call).__name__}")
            proto.tool_calls.add(id=call.id, name=call.name, arguments=call.arguments)
        parts = [message.content] if isinstance(message.content, str) else message.content
        for part in parts:
            if isinstance(part, str):
                proto.content.add(text=part)
            elif isinstance(part, Image):
                image = proto.content.add().image
                if part.url is not None:
                    image.url = part.url
                else:
                    image.data = part.data
            else:
                raise TypeError(f"a content part is a str or an Image, not {type(part).__name__}")
    return chat


def chunk_from_proto(response: router_pb2.GenerateResponse) -> Chunk:
    is_last = response.HasField("usage")
    return Chunk(
        response.request_id,
        response.text_delta,
        tuple(response.token_ids),
        finish_reason_from_proto(response.finish_reason),
        usage_from_proto(response.usage) if is_last else None,
        tuple(token_logprob_from_proto(logprob) for logprob in response.logprobs),
        response.choice_index,
        tuple(response.prompt_token_ids),
        tuple(token_logprob_from_proto(logprob) for logprob in response.prompt_logprobs),
        tuple(
            ToolCallDelta(call.index, call.id, call.name, call.arguments)
            for call in response.tool_calls
        ),
    )
