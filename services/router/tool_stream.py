"""A chat stream with tools in OpenAI's shape: content deltas until a call starts, then
``delta.tool_calls`` entries, the first of a call ``{index, id, type: "function", function:
{name, arguments}}``, the next ones ``{index, function: {arguments}}`` with the following
pieces of its arguments; ``finish_reason: tool_calls`` when the output held calls and ended
by itself. Text that may still be part of a tag is held back (``tool_parsers``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from services.common.types import FinishReason
from services.router.openai_format import ResponseFormatter
from services.router.tool_parsers import (
    ArgumentsEvent,
    BaseToolParser,
    CallEvent,
    ContentEvent,
    ToolEvent,
    call_id,
    choice_finish_reason,
)
from services.router.types import GenerationDelta


class ToolCallStream:
    """The chunks of one chat stream whose output ``parser`` reads for calls."""

    def __init__(
        self, parser: BaseToolParser, formatter: ResponseFormatter, include_usage: bool
    ) -> None:
        self._parser = parser
        self._formatter = formatter
        self._include_usage = include_usage

    def chunk(self, delta: GenerationDelta) -> dict[str, Any] | None:
        """The chunk of ``delta`` (its output's end settled with the last one); None when the
        delta decides nothing yet and carries no logprobs."""
        events = self._parser.feed(delta.text)
        if delta.finish_reason is not None:
            events += self._parser.finish()
        fields = delta_fields(events)
        logprobs = self._formatter.logprobs_body(delta.logprobs) if delta.logprobs else None
        if not fields and logprobs is None:
            return None
        body = self._formatter.chunk(None, with_usage_field=self._include_usage, logprobs=logprobs)
        body["choices"][0]["delta"].update(fields)
        return body

    def last_chunk(self, finish_reason: FinishReason) -> dict[str, Any]:
        """The empty chunk with the finish reason, after the last delta's."""
        body = self._formatter.chunk(None, finish_reason, with_usage_field=self._include_usage)
        has_calls = self._parser.num_calls > 0
        body["choices"][0]["finish_reason"] = choice_finish_reason(finish_reason, has_calls)
        return body


def delta_fields(events: Sequence[ToolEvent]) -> dict[str, Any]:
    """A chunk's ``delta`` fields for ``events``: ``content`` and ``tool_calls``, each when
    there is some."""
    content = "".join(e.text for e in events if isinstance(e, ContentEvent))
    calls: dict[int, dict[str, Any]] = {}
    for event in events:
        if isinstance(event, CallEvent):
            calls[event.index] = {
                "index": event.index,
                "id": call_id(),
                "type": "function",
                "function": {"name": event.name, "arguments": ""},
            }
        elif isinstance(event, ArgumentsEvent):
            entry = calls.setdefault(
                event.index, {"index": event.index, "function": {"arguments": ""}}
            )
            entry["function"]["arguments"] += event.text
    fields: dict[str, Any] = {}
    if content:
        fields["content"] = content
    if calls:
        fields["tool_calls"] = list(calls.values())
    return fields
