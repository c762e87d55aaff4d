"""OpenAI response bodies: whole responses, stream chunks and error bodies.

Logprobs take OpenAI's shapes: chat ``{"content": [{token, logprob, bytes, top_logprobs}]}``,
completions ``{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}``
(with echo the prompt's tokens come first, the first one's logprob and top ones null), and
vLLM's ``prompt_logprobs`` ``[null, {token_id: {logprob, decoded_token}}, ...]``. A
token's text is its bytes decoded (a character split across tokens shows as U+FFFD; ``bytes``
holds the exact bytes); a logprob of -inf is written as -9999.0, as OpenAI and vLLM do.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse

from services.common.errors import MAX_MESSAGE_CHARS, MAX_PARAM_CHARS, StageServeError, clip
from services.common.types import FinishReason, TokenLogprob, Usage
from services.router.tool_parsers import ParsedText, choice_finish_reason, tool_calls_body

# What json.dumps(ensure_ascii=False) leaves raw that breaks clients: the line breaks that
# str.splitlines() splits on besides \n and \r (U+0085, U+2028, U+2029; json escapes the
# others) and lone surrogates (not encodable as UTF-8). They only occur inside JSON strings.
_UNSAFE_IN_JSON = re.compile("[\u0085\u2028\u2029\ud800-\udfff]")


def dump_json(payload: Any) -> str:
    """Compact JSON, non-ASCII text kept, with the characters above written as ``\\uXXXX``."""
    text = json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return _UNSAFE_IN_JSON.sub(lambda match: f"\\u{ord(match.group()):04x}", text)


class OpenAIJSONResponse(JSONResponse):
    """A JSON response written by ``dump_json``."""

    def render(self, content: Any) -> bytes:
        return dump_json(content).encode("utf-8")


def usage_body(usage: Usage) -> dict[str, Any]:
    """OpenAI's usage; ``cached_image_tokens``: the image tokens among ``cached_tokens``."""
    return {
        "prompt_tokens": usage.num_prompt_tokens,
        "completion_tokens": usage.num_completion_tokens,
        "total_tokens": usage.num_prompt_tokens + usage.num_completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": usage.num_prefix_cached_tokens,
            "cached_image_tokens": usage.num_prefix_cached_image_tokens,
        },
    }


def error_body(
    message: str, error_type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """Every HTTP error body and SSE error event; message and param clipped (``clip``)."""
    if param is not None:
        param = clip(param, MAX_PARAM_CHARS)
    message = clip(message, MAX_MESSAGE_CHARS)
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_body_of(error: StageServeError) -> dict[str, Any]:
    return error_body(error.message, error.openai_type, error.param, getattr(error, "code", None))


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event carrying ``payload`` (JSON) or a literal like ``[DONE]``."""
    data = payload if isinstance(payload, str) else dump_json(payload)
    return f"data: {data}\n\n"


LOGPROB_FLOOR = -9999.0  # what JSON gets for -inf


def _logprob(value: float) -> float:
    return value if math.isfinite(value) else LOGPROB_FLOOR


def _top(entry: TokenLogprob, num_top: int | None = None) -> zip[tuple[int, float]]:
    ids, logprobs = entry.top_token_ids[:num_top], entry.top_logprobs[:num_top]
    return zip(ids, logprobs, strict=True)


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt's tokens and the logprobs of tokens 1..n-1 (prefill computed them)."""

    token_ids: Sequence[int]
    logprobs: Sequence[TokenLogprob]


class LogprobFormatter:
    """Logprob bodies of one response; completions' ``text_offset`` runs on across chunks."""

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._token_bytes = token_bytes
        self._text_offset = 0

    def _token(self, token_id: int) -> tuple[str, list[int]]:
        raw = self._token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), list(raw)

    def _chat_entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = self._token(token_id)
        return {"token": text, "logprob": _logprob(logprob), "bytes": raw}

    def chat(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        content = []
        for entry in logprobs:
            body = self._chat_entry(entry.token_id, entry.logprob)
            body["top_logprobs"] = [self._chat_entry(t, lp) for t, lp in _top(entry)]
            content.append(body)
        return {"content": content}

    def completion(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
        tokens, offsets = [], []
        for entry in logprobs:
            text = self._token(entry.token_id)[0]
            tokens.append(text)
            offsets.append(self._text_offset)
            self._text_offset += len(text)
        top = [{self._token(t)[0]: _logprob(lp) for t, lp in _top(e)} for e in logprobs]
        return {
            "tokens": tokens,
            "token_logprobs": [_logprob(e.logprob) for e in logprobs],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def echoed(self, prompt: PromptLogprobs, num_top: int) -> dict[str, Any]:
        """``completion``'s body of the prompt's tokens, the first one without logprobs."""
        first = self._token(prompt.token_ids[0])[0]
        rest = [
            TokenLogprob(e.token_id, e.logprob, *zip(*_top(e, num_top), strict=True) or ((), ()))
            for e in prompt.logprobs
        ]
        offset = self._text_offset
        self._text_offset += len(first)
        body = self.completion(rest)
        return {
            "tokens": [first, *body["tokens"]],
            "token_logprobs": [None, *body["token_logprobs"]],
            "top_logprobs": [None, *body["top_logprobs"]],
            "text_offset": [offset, *body["text_offset"]],
        }

    def vllm_prompt(self, prompt: PromptLogprobs, num_top: int) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs``: per prompt token its own and the top ones' entries."""
        out: list[dict[str, Any] | None] = [None]
        for entry in prompt.logprobs:
            pairs = [*_top(entry, num_top), (entry.token_id, entry.logprob)]
            out.append(
                {
                    str(t): {"logprob": _logprob(lp), "decoded_token": self._token(t)[0]}
                    for t, lp in pairs
                }
            )
        return out


_TEXT_MARK = "\x00"  # stands for a chunk's text while its event template is made
_TEXT_MARK_JSON = dump_json(_TEXT_MARK)


class ResponseFormatter:
    """Bodies of one choice of a response (one id, one creation time) of a chat or completion
    endpoint; a response of ``n`` choices has one formatter per choice."""

    def __init__(
        self,
        response_id: str,
        model: str,
        created: int,
        *,
        is_chat: bool,
        logprobs: LogprobFormatter | None = None,
        echo_top: int | None = None,
        prompt_top: int | None = None,
        token_bytes: Callable[[int], bytes] | None = None,
        index: int = 0,
    ) -> None:
        """``logprobs``: set when the request asked for logprobs; ``echo_top``: the top
        logprobs per echoed prompt token (None: echo without logprobs); ``prompt_top``: vLLM's
        ``prompt_logprobs`` (None: not asked); ``token_bytes`` is needed with it; ``index``:
        the choice's."""
        self._prompt = None if token_bytes is None else LogprobFormatter(token_bytes)
        self._echo_top, self._prompt_top = echo_top, prompt_top
        self.response_id = response_id
        self.model = model
        self.created = created
        self.is_chat = is_chat
        self.index = index
        self._logprobs = logprobs
        self._text_events: dict[bool, tuple[str, str]] = {}  # with_usage_field -> (head, tail)

    def text_event(self, text: str, with_usage_field: bool = False) -> str:
        """``sse(self.chunk(text, ...))`` from a template made once: per token only the text is
        JSON-encoded."""
        template = self._text_events.get(with_usage_field)
        if template is None:
            event = sse(self.chunk(_TEXT_MARK, with_usage_field=with_usage_field))
            head, _, tail = event.rpartition(
                _TEXT_MARK_JSON
            )  # the text comes after the id and model
            template = self._text_events[with_usage_field] = (head, tail)
        return template[0] + dump_json(text) + template[1]

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    @property
    def has_logprobs(self) -> bool:
        return self._logprobs is not None

    def logprobs_body(self, logprobs: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        """The choice's ``logprobs``: None unless the request asked."""
        if self._logprobs is None:
            return None
        return (
            self._logprobs.chat(logprobs) if self.is_chat else self._logprobs.completion(logprobs)
        )

    def full(self, choices: Sequence[dict[str, Any]], usage: Usage) -> dict[str, Any]:
        """The whole response: ``choices`` (each choice's formatter's ``choice``) and ``usage``."""
        body = self._envelope("chat.completion" if self.is_chat else "text_completion", [*choices])
        body["usage"] = usage_body(usage)
        return body

    def choice(
        self,
        text: str,
        finish_reason: FinishReason,
        logprobs: Sequence[TokenLogprob] = (),
        tools: ParsedText | None = None,
        prompt: PromptLogprobs | None = None,
    ) -> dict[str, Any]:
        """The choice in the whole response; ``tools``: the chat's text parsed for tool calls
        (calls found: ``tool_calls``, the rest as content or null, finish reason
        ``tool_calls`` unless ``length``)."""
        if not self.is_chat:
            return self._completion_choice(text, finish_reason, logprobs, prompt)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        reason = finish_reason.value
        if tools is not None and tools.calls:
            message = {
                "role": "assistant",
                "content": tools.content or None,
                "tool_calls": tool_calls_body(tools.calls),
            }
            reason = choice_finish_reason(finish_reason, True)
        return {
            "index": self.index,
            "message": message,
            "logprobs": self.logprobs_body(logprobs),
            "finish_reason": reason,
        }

    def echo_body(self, prompt: PromptLogprobs) -> dict[str, Any] | None:
        """The echoed prompt's ``logprobs`` (before the generated tokens' bodies: their
        ``text_offset`` runs on from it); None unless echo asked for logprobs."""
        if self._echo_top is None or self._logprobs is None:
            return None
        return self._logprobs.echoed(prompt, self._echo_top)

    def _completion_choice(
        self,
        text: str,
        finish_reason: FinishReason,
        logprobs: Sequence[TokenLogprob],
        prompt: PromptLogprobs | None,
    ) -> dict[str, Any]:
        echoed = None if prompt is None else self.echo_body(prompt)
        body = self.logprobs_body(logprobs)
        if echoed is not None and body is not None:
            body = {key: [*echoed[key], *body[key]] for key in body}
        reason = finish_reason.value
        choice = {"index": self.index, "text": text, "logprobs": body, "finish_reason": reason}
        if self._prompt_top is not None and prompt is not None and self._prompt is not None:
            choice["prompt_logprobs"] = self._prompt.vllm_prompt(prompt, self._prompt_top)
        return choice

    def chunk(
        self,
        text: str | None,
        finish_reason: FinishReason | None = None,
        *,
        role: bool = False,
        with_usage_field: bool = False,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A stream chunk with ``text`` (chat: as a delta; ``None`` = empty delta) and the
        ``logprobs`` body of its tokens (``logprobs_body``)."""
        reason = None if finish_reason is None else finish_reason.value
        if self.is_chat:
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            object_name, content = "chat.completion.chunk", {"delta": delta}
        else:
            object_name, content = "text_completion", {"text": text or ""}
        choice = {"index": self.index, **content, "logprobs": logprobs, "finish_reason": reason}
        body = self._envelope(object_name, [choice])
        if with_usage_field:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The last chunk when the client asked for usage: no choices, the usage."""
        body = self._envelope("chat.completion.chunk" if self.is_chat else "text_completion", [])
        body["usage"] = usage_body(usage)
        return body
