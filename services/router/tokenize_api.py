"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's request and response shapes.

``/tokenize`` takes a ``prompt`` (as ``/v1/completions`` tokenizes it) or ``messages``
(as ``/v1/chat/completions`` does: the chat template, images fetched and expanded to
their placeholder tokens), and goes through a tokenizer worker like a generation, so
``count`` is the ``usage.prompt_tokens`` the same input gets. A prompt of the context
length or more is a 400 there too (the tokenizer bounds its work by the context).
``add_special_tokens`` takes either value: the tokenizers this server loads (byte-level
BPE, Qwen2.5-VL) add no special tokens, so both give the same ids, as in vLLM.
``messages`` take chat's template fields (``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs``: ``chat_template.py``), a ``prompt``
none of them. ``return_token_strs`` is refused when true (not built).

``/detokenize`` decodes token ids with the router's copy of the tokenizer, special
tokens kept (vLLM's ``tokenizer.decode``), on a thread; an id outside the vocabulary, or
more ids than the context length, is a 400.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, StrictBool, StrictInt, StrictStr

from services.common.errors import InvalidRequestError
from services.engine.processing import TextProcessor
from services.router.chat_template import check_final_message, template_options
from services.router.generation import GenerationPipeline
from services.router.images import ImageLoader
from services.router.openai_prompt import chat_messages
from services.router.openai_schema import Body, ChatMessageBody, check_model, check_text
from services.router.tool_parsers import ToolFormat
from services.router.types import GenerationRequest


class TokenizeBody(Body):
    """vLLM's TokenizeCompletionRequest (``prompt``) or TokenizeChatRequest (``messages``)."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessageBody] | None = None
    add_special_tokens: StrictBool | None = None  # either value: no special tokens are added
    add_generation_prompt: StrictBool | None = None  # messages only; default true
    continue_final_message: StrictBool | None = None  # messages only; default false
    chat_template_kwargs: dict[StrictStr, Any] | None = None  # messages only
    return_token_strs: StrictBool | None = None  # true is refused


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # never set: return_token_strs is refused


# More ids than any context this server loads; checked before each id is validated, so a
# huge list costs the event loop no per-item work (the handler then checks max_model_len).
MAX_DETOKENIZE_IDS = 1 << 20


def _at_most_max_ids(value: Any) -> Any:
    if isinstance(value, list) and len(value) > MAX_DETOKENIZE_IDS:
        raise ValueError(f"{len(value)} ids; at most {MAX_DETOKENIZE_IDS} are decoded")
    return value


class DetokenizeBody(Body):
    model: StrictStr | None = None
    tokens: Annotated[list[StrictInt], BeforeValidator(_at_most_max_ids)]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizeApi:
    """The two handlers; ``create_app`` routes them."""

    def __init__(
        self,
        pipeline: GenerationPipeline,
        images: ImageLoader,
        text: TextProcessor,
        served_model_name: str,
        max_context_len: int,
        request_timeout_s: float,
        tool_format: ToolFormat,
    ) -> None:
        """``tool_format``: the model's tool-call format (tool turns in chats)."""
        self._pipeline = pipeline
        self._images = images
        self._text = text
        self._served_model_name = served_model_name
        self._max_context_len = max_context_len
        self._request_timeout_s = request_timeout_s
        self._tool_format = tool_format

    async def tokenize(self, body: TokenizeBody) -> TokenizeResponse:
        check_model(body.model, self._served_model_name)
        _check_tokenize_options(body)
        request_id = f"tok-{uuid.uuid4().hex}"
        if body.messages is not None:
            template = template_options(
                body.add_generation_prompt is not False,
                bool(body.continue_final_message),
                body.chat_template_kwargs,
            )
            messages = await chat_messages(body.messages, self._images, style=self._tool_format)
            check_final_message(template, messages)
            request = GenerationRequest(
                request_id,
                messages=messages,
                timeout_s=self._request_timeout_s,
                template=template,
            )
        else:
            assert body.prompt is not None
            prompt = check_text(body.prompt, "prompt")
            request = GenerationRequest(
                request_id, prompt=prompt, timeout_s=self._request_timeout_s
            )
        prompt_ids = await self._pipeline.tokenize(request)
        tokens = list(prompt_ids.token_ids)
        return TokenizeResponse(
            count=len(tokens), max_model_len=self._max_context_len, tokens=tokens
        )

    async def detokenize(self, body: DetokenizeBody) -> DetokenizeResponse:
        check_model(body.model, self._served_model_name)
        if len(body.tokens) > self._max_context_len:
            raise InvalidRequestError(
                f"tokens has {len(body.tokens)} ids; at most max_model_len "
                f"({self._max_context_len}) are decoded",
                param="tokens",
            )
        return DetokenizeResponse(prompt=await asyncio.to_thread(self._decode, body.tokens))

    def _decode(self, token_ids: list[int]) -> str:
        """``token_ids`` checked against the vocabulary and decoded (off the event loop)."""
        vocab_size = self._text.vocab_size
        for i, token_id in enumerate(token_ids):
            if not 0 <= token_id < vocab_size:
                raise InvalidRequestError(
                    f"tokens[{i}] is {token_id}; token ids are in [0, {vocab_size})",
                    param=f"tokens[{i}]",
                )
        return self._text.decode(token_ids)


def _check_tokenize_options(body: TokenizeBody) -> None:
    if (body.prompt is None) == (body.messages is None):
        raise InvalidRequestError("send exactly one of prompt and messages", param="prompt")
    if body.messages is None:
        for field in ("add_generation_prompt", "continue_final_message", "chat_template_kwargs"):
            if getattr(body, field) is not None:
                raise InvalidRequestError(
                    f"{field} applies to messages, not to a prompt", param=field
                )
    if body.return_token_strs:
        raise InvalidRequestError(
            "return_token_strs is not supported yet", param="return_token_strs"
        )
