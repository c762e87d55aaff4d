"""A generation's deltas as a Responses API response: its output items, the stream events that
build them, and the response object.

One ``OutputBuilder`` serves both ways of answering: a streamed response sends the events
``feed`` returns, a whole one keeps only the items, so both say the same. Without tools (or
with ``tool_choice: none``) the output is one ``message`` item; with tools the text is read for
calls (the chat path's parser): text becomes ``message`` items, each call a ``function_call``
item, in the order the model wrote them. An item's events, in order: ``output_item.added``;
for a message ``content_part.added``, ``output_text.delta``..., ``output_text.done``,
``content_part.done``; for a call ``function_call_arguments.delta``...,
``function_call_arguments.done``; then ``output_item.done``. The last item of an output cut by
``max_output_tokens`` is ``incomplete``, as is the response.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.common.errors import StageServeError
from services.common.types import FinishReason, TokenLogprob, Usage
from services.router.openai_format import LogprobFormatter, error_body_of, usage_body
from services.router.tool_parsers import (
    ArgumentsEvent,
    BaseToolParser,
    CallEvent,
    ContentEvent,
    ToolEvent,
    call_id,
)
from services.router.types import GenerationDelta

Event = dict[str, Any]  # one stream event, before its sequence number


@dataclass
class _Item:
    """One output item: a message (its text) or a function call (its arguments)."""

    item_id: str
    output_index: int
    is_call: bool
    name: str = ""
    call_id: str = ""
    pieces: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    status: str = "in_progress"

    def part(self) -> dict[str, Any]:
        text = "".join(self.pieces)
        return {
            "type": "output_text",
            "text": text,
            "annotations": [],
            "logprobs": [*self.logprobs],
        }

    def body(self) -> dict[str, Any]:
        """The item as it is now (a message holds its part once done)."""
        if self.is_call:
            return {
                "id": self.item_id,
                "type": "function_call",
                "status": self.status,
                "call_id": self.call_id,
                "name": self.name,
                "arguments": "".join(self.pieces),
            }
        content = [] if self.status == "in_progress" else [self.part()]
        return {
            "id": self.item_id,
            "type": "message",
            "status": self.status,
            "role": "assistant",
            "content": content,
        }


class OutputBuilder:
    """The output items of one response, built from its deltas."""

    def __init__(self, parser: BaseToolParser | None, logprobs: LogprobFormatter | None) -> None:
        """``parser``: reads the text for calls (None: the text is the message);
        ``logprobs``: set when the request asked for them (never with a parser)."""
        assert parser is None or logprobs is None
        self._parser = parser
        self._logprobs = logprobs
        self.items: list[_Item] = []
        self._open: _Item | None = None

    def output(self) -> list[dict[str, Any]]:
        return [item.body() for item in self.items]

    def feed(self, delta: GenerationDelta) -> list[Event]:
        """The events of ``delta``; with the last delta, those that close the output."""
        events: list[Event] = []
        if self._parser is None:
            if delta.text or delta.logprobs:
                events += self._text(delta.text, delta.logprobs)
        else:
            pieces = self._parser.feed(delta.text)
            if delta.finish_reason is not None:
                pieces += self._parser.finish()
            for piece in pieces:
                events += self._piece(piece)
        if delta.finish_reason is not None:
            if not self.items:  # nothing was written: the output is an empty message
                events += self._start_message()
            is_cut = delta.finish_reason is FinishReason.LENGTH
            events += self._close("incomplete" if is_cut else "completed")
        return events

    def _piece(self, piece: ToolEvent) -> list[Event]:
        if isinstance(piece, ContentEvent):
            return self._text(piece.text)
        if isinstance(piece, CallEvent):
            events = self._close()
            item = _Item(f"fc_{uuid.uuid4().hex}", len(self.items), True, piece.name, call_id())
            return events + self._start(item)
        assert isinstance(piece, ArgumentsEvent) and self._open is not None
        self._open.pieces.append(piece.text)
        return [
            {
                "type": "response.function_call_arguments.delta",
                **self._where(self._open),
                "delta": piece.text,
            }
        ]

    def _text(self, text: str, logprobs: Sequence[TokenLogprob] = ()) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open.is_call:
            events += self._close() + self._start_message()
        item = self._open
        assert item is not None
        entries = [] if self._logprobs is None else self._logprobs.chat(logprobs)["content"]
        item.pieces.append(text)
        item.logprobs += entries
        events.append(
            {
                "type": "response.output_text.delta",
                **self._where(item),
                "content_index": 0,
                "delta": text,
                "logprobs": entries,
            }
        )
        return events

    def _where(self, item: _Item) -> dict[str, Any]:
        return {"item_id": item.item_id, "output_index": item.output_index}

    def _start_message(self) -> list[Event]:
        return self._start(_Item(f"msg_{uuid.uuid4().hex}", len(self.items), False))

    def _start(self, item: _Item) -> list[Event]:
        self.items.append(item)
        self._open = item
        events = [
            {
                "type": "response.output_item.added",
                "output_index": item.output_index,
                "item": item.body(),
            }
        ]
        if not item.is_call:
            events.append(
                {
                    "type": "response.content_part.added",
                    **self._where(item),
                    "content_index": 0,
                    "part": item.part(),
                }
            )
        return events

    def _close(self, status: str = "completed") -> list[Event]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        where = self._where(item)
        body = item.body()
        if item.is_call:
            events = [
                {
                    "type": "response.function_call_arguments.done",
                    **where,
                    "name": item.name,
                    "arguments": body["arguments"],
                }
            ]
        else:
            part = item.part()
            events = [
                {
                    "type": "response.output_text.done",
                    **where,
                    "content_index": 0,
                    "text": part["text"],
                    "logprobs": part["logprobs"],
                },
                {"type": "response.content_part.done", **where, "content_index": 0, "part": part},
            ]
        done = {
            "type": "response.output_item.done",
            "output_index": item.output_index,
            "item": body,
        }
        events.append(done)
        return events


@dataclass(frozen=True)
class ResponseShape:
    """The response object's fixed fields: its id, creation time and model, and what it
    echoes of its request (``echoed``: instructions, tools, sampling, metadata, ...)."""

    response_id: str
    created_at: int
    model: str
    echoed: dict[str, Any]

    def body(
        self,
        output: list[dict[str, Any]],
        finish_reason: FinishReason | None = None,
        usage: Usage | None = None,
    ) -> dict[str, Any]:
        """The response; ``finish_reason`` None: still in progress."""
        status = "in_progress"
        if finish_reason is not None:
            status = "incomplete" if finish_reason is FinishReason.LENGTH else "completed"
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "model": self.model,
            "output": output,
            **self.echoed,
            "usage": None if usage is None else responses_usage(usage),
        }


def responses_usage(usage: Usage) -> dict[str, Any]:
    """Chat's usage (``usage_body``) in the Responses API's names."""
    chat = usage_body(usage)
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": chat["prompt_tokens_details"],
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat["total_tokens"],
    }


def error_event(error: StageServeError) -> Event:
    """The ``error`` event of a stream that failed after it started: the Responses API's
    fields, and the ``error`` object every stream of this server ends with when it fails."""
    body = error_body_of(error)
    detail = body["error"]
    return {
        "type": "error",
        "code": detail["code"],
        "message": detail["message"],
        "param": detail["param"],
        **body,
    }
