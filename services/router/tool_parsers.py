"""Tool calls in a model's output, found as the text streams in: one incremental parser per
tool-call format, and the same parser, fed the whole text at once, for a whole response.

Formats (``ToolFormat``): ``hermes`` (Qwen2.5 / Qwen2.5-VL / Qwen3-VL) writes each call as
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (``tool_parser_json``);
``qwen3_coder`` (Qwen3-Coder, Qwen3.5) as ``<tool_call><function=NAME><parameter=KEY>VALUE
</parameter>...</function></tool_call>`` (``tool_parser_xml``). ``required`` and named tool
choices make the output a bare JSON call object, or an array of them, whatever the format
(``tool_parser_json.JsonCallsParser``).

Rules every parser follows, so that a stream and a whole response say the same:
- a call counts from its head on: ``<tool_call>`` and ``{"name": "<a requested tool>",
  "arguments": {`` (hermes), ``<tool_call><function=<a requested tool>>`` (qwen3_coder).
  Its arguments are then streamed as the model writes them, verbatim (hermes): as OpenAI
  documents, they may be cut short (``finish_reason: length``) or not be valid JSON;
- a block whose head is not a call's (no JSON object, a tool not requested, the arguments
  not an object, calls past ``max_calls``) stays in the content, tags included, except that
  a hermes block holding a whole call in another key order is that call;
- text that may still become a tag is held back, never sent as content;
- whitespace right before a call, whitespace that opens the content after a call, and
  trailing whitespace of an output with calls are not content.
"""

from __future__ import annotations

import abc
import enum
import uuid
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import msgspec

from services.common.types import FinishReason

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_HEAD_LEN = 256  # a call head still unfinished after this many characters is not one


class ToolFormat(enum.StrEnum):
    HERMES = "hermes"
    QWEN3_CODER = "qwen3_coder"


class ParsedCall(msgspec.Struct, frozen=True):
    name: str
    arguments: str  # the arguments object as JSON text


class ParsedText(msgspec.Struct, frozen=True):
    content: str  # the text that is not a call
    calls: tuple[ParsedCall, ...]


class ToolEvent(msgspec.Struct, frozen=True, tag=True):
    """What a parser learnt from the text fed to it."""


class ContentEvent(ToolEvent, frozen=True):
    text: str


class CallEvent(ToolEvent, frozen=True):
    """Call ``index`` (0, 1, ... in the output) of tool ``name`` starts."""

    index: int
    name: str


class ArgumentsEvent(ToolEvent, frozen=True):
    """The next piece of call ``index``'s arguments text."""

    index: int
    text: str


def held_len(text: str, tags: Iterable[str]) -> int:
    """The length of the longest end of ``text`` that begins one of ``tags`` without being it."""
    longest = 0
    for tag in tags:
        for size in range(min(len(tag) - 1, len(text)), longest, -1):
            if text.endswith(tag[:size]):
                longest = size
                break
    return longest


def first_tag(text: str, tags: Iterable[str], start: int = 0) -> tuple[int, str]:
    """Where the first of ``tags`` occurs in ``text`` from ``start`` on, and which: (-1, "")
    when none does."""
    found = [(i, tag) for tag in tags if (i := text.find(tag, start)) >= 0]
    return min(found) if found else (-1, "")


class BaseToolParser(abc.ABC):
    """Turns an output, fed piece by piece, into content and tool-call events.

    ``feed`` returns what the text so far decides; ``finish`` (once, when the output ended)
    settles the text held back. Subclasses consume ``self._buffer`` in ``_step``.
    """

    def __init__(self, names: Collection[str], max_calls: int | None) -> None:
        self._names = frozenset(names)
        self._max_calls = max_calls
        self._buffer = ""
        self._events: list[ToolEvent] = []
        self.num_calls = 0
        self._space = ""  # whitespace at the content's end, held until text follows it
        self._has_content = False
        self._num_searched = 0  # of the buffer held for an end tag, the part searched in vain

    def feed(self, text: str) -> list[ToolEvent]:
        self._buffer += text
        while self._buffer and self._step():
            pass
        return self._take()

    def finish(self) -> list[ToolEvent]:
        self._end()
        self._buffer = ""
        if self._space and not self.num_calls:
            self._events.append(ContentEvent(self._space))
        self._space = ""
        return self._take()

    @abc.abstractmethod
    def _step(self) -> bool:
        """Consume what can be decided from the front of ``self._buffer``; False when more
        text is needed."""

    @abc.abstractmethod
    def _end(self) -> None:
        """The output ended: settle ``self._buffer``."""

    @property
    def can_call(self) -> bool:
        return self._max_calls is None or self.num_calls < self._max_calls

    def _text_until_block(self) -> bool | None:
        """Content up to the next ``<tool_call>``, which is consumed: True when it may open a
        call, False when it stays text (calls past ``max_calls``), None when more text is
        needed."""
        buffer = self._buffer
        i = buffer.find(OPEN)
        if i < 0:
            keep = len(buffer) - held_len(buffer, (OPEN,))
            self._content(buffer[:keep])
            self._buffer = buffer[keep:]
            return None
        self._content(buffer[:i])
        self._buffer = buffer[i + len(OPEN) :]
        if not self.can_call:
            self._content(OPEN)
        return self.can_call

    def _end_tag(self, tags: Sequence[str]) -> tuple[int, str]:
        """``first_tag`` in the held buffer, searching each of its characters once or so."""
        start = max(0, self._num_searched - max(map(len, tags)))
        i, tag = first_tag(self._buffer, tags, start)
        self._num_searched = len(self._buffer) if i < 0 else 0
        return i, tag

    def _take(self) -> list[ToolEvent]:
        events, self._events = self._events, []
        return events

    def _content(self, text: str) -> None:
        text = self._space + text
        body = text.rstrip()
        self._space = text[len(body) :]
        if self.num_calls and not self._has_content:
            body = body.lstrip()
        if body:
            self._events.append(ContentEvent(body))
            self._has_content = True

    def _start_call(self, name: str) -> None:
        self._space = ""
        self._events.append(CallEvent(self.num_calls, name))
        self.num_calls += 1

    def _arguments(self, text: str) -> None:
        if text:
            self._events.append(ArgumentsEvent(self.num_calls - 1, text))


def parse_text(parser: BaseToolParser, text: str) -> ParsedText:
    """``text`` (a whole output) as content and calls, as ``parser`` streams it."""
    return collect([*parser.feed(text), *parser.finish()])


def collect(events: Sequence[ToolEvent]) -> ParsedText:
    content: list[str] = []
    calls: list[tuple[str, list[str]]] = []
    for event in events:
        if isinstance(event, ContentEvent):
            content.append(event.text)
        elif isinstance(event, CallEvent):
            calls.append((event.name, []))
        elif isinstance(event, ArgumentsEvent):
            calls[event.index][1].append(event.text)
    return ParsedText(
        "".join(content), tuple(ParsedCall(name, "".join(parts)) for name, parts in calls)
    )


def tool_calls_body(calls: tuple[ParsedCall, ...]) -> list[dict[str, Any]]:
    """The ``message.tool_calls`` of a response."""
    return [
        {
            "id": call_id(),
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in calls
    ]


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def choice_finish_reason(reason: FinishReason, has_calls: bool) -> str:
    """A chat choice's ``finish_reason``: ``tool_calls`` when the output holds calls and
    ended by itself; ``length`` stays (a call may be cut short)."""
    return "tool_calls" if has_calls and reason is FinishReason.STOP else reason.value
