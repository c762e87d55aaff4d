"""The client's request and result types, and their proto forms (``stageserve.v1.Router``)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from services.common.errors import InvalidRequestError, StageServeError
from services.common.pb.stageserve.v1 import common_pb2, router_pb2
from services.common.types import FinishReason, TokenLogprob, Usage
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
    """One turn of a conversation: its role (``system``, ``user`` or ``assistant``) and its
    content, a string or a sequence of strings and images in order."""

    role: str
    content: str | Sequence[str | Image]


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
            )
            if getattr(self, name) is not None
        }
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


@dataclass(frozen=True)
class Completion:
    """A whole generation: every chunk's text and token ids, and the last one's ending."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    usage: Usage
    logprobs: tuple[TokenLogprob, ...] = ()  # parallel to token_ids, or empty


class CompletionBuilder:
    """Joins a stream's chunks into its ``Completion``."""

    def __init__(self) -> None:
        self._texts: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[TokenLogprob] = []
        self._last: Chunk | None = None

    def add(self, chunk: Chunk) -> None:
        self._texts.append(chunk.text)
        self._token_ids.extend(chunk.token_ids)
        self._logprobs.extend(chunk.logprobs)
        self._last = chunk

    def completion(self) -> Completion:
        """``StageServeError`` when the stream ended without its final chunk."""
        last = self._last
        if last is None or last.finish_reason is None or last.usage is None:
            raise StageServeError("the server ended the stream without its final message")
        return Completion(
            last.request_id,
            "".join(self._texts),
            tuple(self._token_ids),
            last.finish_reason,
            last.usage,
            tuple(self._logprobs),
        )


def build_request(
    *,
    prompt: str | None,
    messages: Sequence[Message] | None,
    sampling: Sampling | None,
    stop: Sequence[str],
    model: str,
    request_id: str,
) -> router_pb2.GenerateRequest:
    """The GenerateRequest of one call; ``InvalidRequestError`` for input the proto cannot
    carry (both or neither of ``prompt`` and ``messages``, a value outside its field's type)."""
    if (prompt is None) == (messages is None):
        raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
    try:
        request = router_pb2.GenerateRequest(
            request_id=request_id,
            model=model,
            sampling_params=(sampling or Sampling()).to_proto(),
            stop=list(stop),
        )
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
        proto = chat.messages.add(role=message.role)
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
    )
