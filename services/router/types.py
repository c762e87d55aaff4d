"""The router's internal request and output types (both APIs convert to and from these)."""

from __future__ import annotations

import msgspec

from services.common.types import ChatMessage, FinishReason, SamplingParams, TokenLogprob, Usage
from services.router.prompt_embeds import PromptEmbeds


class ChatTemplateOptions(msgspec.Struct, frozen=True):
    """How a chat's template renders: vLLM's fields, checked (``chat_template.py``)."""

    add_generation_prompt: bool = True  # end with the assistant turn's header
    continue_final_message: bool = False  # leave the last (assistant) message open
    kwargs: str = ""  # chat_template_kwargs as a JSON object's compact text; "" = none


class GenerationRequest(msgspec.Struct, frozen=True):
    """One request, already validated. Exactly one of ``prompt``, ``prompt_token_ids``,
    ``messages`` and ``prompt_embeds`` is set."""

    request_id: str
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None
    prompt_embeds: PromptEmbeds | None = None
    # max_new_tokens is ignored here: ``max_tokens`` below decides it against the context.
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    # None = the router's default (up to the context limit); 0 = the prompt alone
    # (``is_prompt_only``)
    max_tokens: int | None = None
    # The request field that set max_tokens: more than the context leaves is a 400 naming it.
    # None: max_tokens is a default (gRPC's unset max_new_tokens), fitted to the context.
    max_tokens_param: str | None = "max_tokens"
    stop: tuple[str, ...] = ()
    timeout_s: float = 300.0
    prompt_token_ids: tuple[int, ...] | None = None  # a completion prompt given as token ids
    template: ChatTemplateOptions = msgspec.field(default_factory=ChatTemplateOptions)  # chats
    # False: the model's special tokens stay in the output text (vLLM's skip_special_tokens)
    skip_special_tokens: bool = True

    @property
    def is_prompt_only(self) -> bool:
        """max_tokens 0 (completions' echo): the workers are asked for one token, which the
        pipeline drops; the one delta holds the prompt's ids and logprobs, no token, and
        finishes with LENGTH."""
        return self.max_tokens == 0

    @property
    def prompt_param(self) -> str:
        """The request field a prompt-length error points at."""
        if self.prompt_embeds is not None:
            return "prompt_embeds"
        return "messages" if self.messages is not None else "prompt"


class GenerationDelta(msgspec.Struct, frozen=True):
    """Output since the previous delta; the last one carries finish_reason and usage."""

    text: str
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # parallel to token_ids when the request asked
    # first delta, when the request asked (num_prompt_logprobs): the prompt's token ids and the
    # logprobs of tokens 1..n-1 (the first has none)
    prompt_token_ids: tuple[int, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
