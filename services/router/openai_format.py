"""OpenAI response bodies: whole responses, stream chunks and error bodies.

Logprobs take OpenAI's shapes: chat ``{"content": [{token, logprob, bytes, top_logprobs}]}``,
completions ``{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}``. A
token's text is its bytes decoded (a character split across tokens shows as U+FFFD; ``bytes``
holds the exact bytes); a logprob of -inf is written as -9999.0, as OpenAI and vLLM do.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

from starlette.responses import JSONResponse

from services.common.errors import MAX_MESSAGE_CHARS, MAX_PARAM_CHARS, StageServeError, clip
from services.common.types import FinishReason, TokenLogprob, Usage

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


def usage_body(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.num_prompt_tokens,
        "completion_tokens": usage.num_completion_tokens,
        "total_tokens": usage.num_prompt_tokens + usage.num_completion_tokens,
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


def _top(entry: TokenLogprob) -> zip[tuple[int, float]]:
    return zip(entry.top_token_ids, entry.top_logprobs, strict=True)


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


_TEXT_MARK = "\x00"  # stands for a chunk's text while its event template is made
_TEXT_MARK_JSON = dump_json(_TEXT_MARK)


class ResponseFormatter:
    """Bodies of one response (one id, one creation time) of a chat or completion endpoint."""

    def __init__(
        self,
        response_id: str,
        model: str,
        created: int,
        *,
        is_chat: bool,
        logprobs: LogprobFormatter | None = None,
    ) -> None:
        """``logprobs``: set when the request asked for logprobs."""
        self.response_id = response_id
        self.model = model
        self.created = created
        self.is_chat = is_chat
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

    def full(
        self,
        text: str,
        finish_reason: FinishReason,
        usage: Usage,
        logprobs: Sequence[TokenLogprob] = (),
    ) -> dict[str, Any]:
        if self.is_chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": self.logprobs_body(logprobs),
                "finish_reason": finish_reason.value,
            }
            body = self._envelope("chat.completion", [choice])
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": self.logprobs_body(logprobs),
                "finish_reason": finish_reason.value,
            }
            body = self._envelope("text_completion", [choice])
        body["usage"] = usage_body(usage)
        return body

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
            body = self._envelope(
                "chat.completion.chunk",
                [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}],
            )
        else:
            body = self._envelope(
                "text_completion",
                [{"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": reason}],
            )
        if with_usage_field:
            body["usage"] = None
        return body

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """The last chunk when the client asked for usage: no choices, the usage."""
        body = self._envelope("chat.completion.chunk" if self.is_chat else "text_completion", [])
        body["usage"] = usage_body(usage)
        return body
