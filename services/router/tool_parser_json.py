"""The tool-call formats whose calls are JSON objects: hermes blocks
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in free text, and the bare call
objects (or arrays of them) that ``required`` and named tool choices constrain the output to.
A call's head ``{"name": "<a requested tool>", "arguments": {`` starts it; its arguments then
stream verbatim up to the brace that closes them. The rules shared with the other formats
are in ``tool_parsers``.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Collection
from typing import Any

from services.router.tool_parsers import (
    CLOSE,
    MAX_HEAD_LEN,
    OPEN,
    BaseToolParser,
    ParsedCall,
    ParsedText,
    held_len,
    parse_text,
)


def as_call(value: Any, names: Collection[str]) -> ParsedCall | None:
    """``value`` (decoded JSON) as a call of one of ``names``; None when it is not one."""
    if not isinstance(value, dict) or set(value) != {"name", "arguments"}:
        return None
    name, arguments = value["name"], value["arguments"]
    if name not in names or not isinstance(arguments, dict):
        return None
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


_HEAD_PARTS = ("{", '"name"', ":", None, ",", '"arguments"', ":", "{")  # None: the name
_NAME = re.compile(r'"([A-Za-z0-9_-]{0,64})(")?')
_SPACE = re.compile(r"\s*")


def match_head(text: str, names: Collection[str]) -> tuple[str, int] | bool:
    """Whether ``text`` opens with a call's head ``{"name": "<one of names>", "arguments": {``:
    (name, where its arguments start) when it does, True while it still may, else False."""
    pos, name = 0, ""
    for k, part in enumerate(_HEAD_PARTS):
        pos = _SPACE.match(text, pos).end()  # type: ignore[union-attr]
        if pos == len(text):
            return True
        if part is None:
            match = _NAME.match(text, pos)
            if match is None or (match.group(2) is None and match.end() < len(text)):
                return False
            if match.group(2) is None:
                return True
            name, pos = match.group(1), match.end()
            if name not in names:
                return False
            continue
        given = text[pos : pos + len(part)]
        if not part.startswith(given):
            return False
        if len(given) < len(part):
            return True
        if k == len(_HEAD_PARTS) - 1:  # the arguments' brace: it belongs to them
            return name, pos
        pos += len(part)
    raise AssertionError("the head ends with the arguments' brace")


class ObjectEnd:
    """Finds where a JSON object ends in text fed piece by piece (strings and nesting
    followed; nothing else checked)."""

    _SPECIAL = re.compile(r'[{}\[\]"\\]')

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def scan(self, text: str) -> int | None:
        """The length of ``text`` up to and with the object's last brace; None while it is
        still open."""
        pos = 0
        if self._escaped and text:
            self._escaped, pos = False, 1
        while (match := self._SPECIAL.search(text, pos)) is not None:
            char, pos = match.group(), match.end()
            if char == "\\":
                if self._in_string:
                    if pos == len(text):
                        self._escaped = True
                    pos += 1
            elif char == '"':
                self._in_string = not self._in_string
            elif not self._in_string:
                self._depth += 1 if char in "{[" else -1
                if self._depth == 0:
                    return pos
        return None


class _Hermes(enum.Enum):
    TEXT = "text"  # content, until a <tool_call>
    HEAD = "head"  # after <tool_call>: a call's head, or not
    ARGUMENTS = "arguments"  # a call's arguments object, streamed
    TAIL = "tail"  # after the arguments: the call object's brace, then </tool_call>
    BLOCK = "block"  # a block that did not open as a call, held to its end


class HermesParser(BaseToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks."""

    def __init__(self, names: Collection[str], max_calls: int | None = None) -> None:
        super().__init__(names, max_calls)
        self._state = _Hermes.TEXT
        self._object_end = ObjectEnd()

    def _step(self) -> bool:
        return {
            _Hermes.TEXT: self._text,
            _Hermes.HEAD: self._head,
            _Hermes.ARGUMENTS: self._argument_text,
            _Hermes.TAIL: self._tail,
            _Hermes.BLOCK: self._block,
        }[self._state]()

    def _text(self) -> bool:
        is_opened = self._text_until_block()
        if is_opened:
            self._state = _Hermes.HEAD
        return is_opened is not None

    def _head(self) -> bool:
        head = match_head(self._buffer, self._names)
        if head is True and len(self._buffer) <= MAX_HEAD_LEN:
            return False
        if isinstance(head, bool):
            self._state = _Hermes.BLOCK
            return True
        name, start = head
        self._start_call(name)
        self._buffer = self._buffer[start:]
        self._object_end = ObjectEnd()
        self._state = _Hermes.ARGUMENTS
        return True

    def _argument_text(self) -> bool:
        buffer = self._buffer
        close = buffer.find(CLOSE)
        size = close if close >= 0 else len(buffer) - held_len(buffer, (CLOSE,))
        end = self._object_end.scan(buffer[:size])
        if end is not None:
            self._arguments(buffer[:end])
            self._buffer = buffer[end:]
            self._state = _Hermes.TAIL
            return True
        self._arguments(buffer[:size])
        if close < 0:
            self._buffer = buffer[size:]
            return False
        self._buffer = buffer[close + len(CLOSE) :]  # unbalanced arguments, as written
        self._state = _Hermes.TEXT
        return True

    def _tail(self) -> bool:
        i, tag = self._end_tag((CLOSE, OPEN))
        if i < 0:
            return False
        self._settle_tail(self._buffer[:i])
        self._buffer = self._buffer[i + len(tag) if tag == CLOSE else i :]
        self._state = _Hermes.TEXT
        return True

    def _settle_tail(self, tail: str) -> None:
        if not re.fullmatch(r"\s*\}\s*", tail):
            self._content(tail)

    def _block(self) -> bool:
        i, tag = self._end_tag((CLOSE, OPEN))
        if i < 0:
            return False
        self._settle_block(self._buffer[:i], tag == CLOSE)
        self._buffer = self._buffer[i + len(tag) if tag == CLOSE else i :]
        self._state = _Hermes.TEXT
        return True

    def _settle_block(self, inner: str, is_closed: bool) -> None:
        try:
            call = as_call(json.loads(inner), self._names)
        except ValueError:
            call = None
        if call is None:
            self._content(OPEN + inner + (CLOSE if is_closed else ""))
            return
        self._start_call(call.name)
        self._arguments(call.arguments)

    def _end(self) -> None:
        buffer = self._buffer
        if self._state is _Hermes.TEXT:
            self._content(buffer)
        elif self._state is _Hermes.HEAD:
            self._content(OPEN + buffer)
        elif self._state is _Hermes.ARGUMENTS:
            self._arguments(buffer)  # cut short
        elif self._state is _Hermes.TAIL:
            self._settle_tail(buffer)
        else:
            self._settle_block(buffer, False)


class _Json(enum.Enum):
    START = "start"  # before the first call: an array or a call object
    HEAD = "head"
    ARGUMENTS = "arguments"
    TAIL = "tail"  # the call object's closing brace
    NEXT = "next"  # in an array: a comma or its end
    DONE = "done"
    TEXT = "text"  # not calls: content from here on


class JsonCallsParser(BaseToolParser):
    """A bare call object ``{"name": ..., "arguments": {...}}`` or an array of them: the
    output ``tool_choice`` ``required`` or a named function constrains to."""

    def __init__(self, names: Collection[str], max_calls: int | None = None) -> None:
        super().__init__(names, max_calls)
        self._state = _Json.START
        self._is_array = False
        self._object_end = ObjectEnd()

    def _step(self) -> bool:
        if self._state is _Json.TEXT:
            self._content(self._buffer)
            self._buffer = ""
            return False
        if self._state is _Json.HEAD:
            return self._head()
        if self._state is _Json.ARGUMENTS:
            return self._argument_text()
        self._buffer = self._buffer.lstrip()
        if not self._buffer:
            return False
        char = self._buffer[0]
        expected = {
            _Json.START: "[{",
            _Json.TAIL: "}",
            _Json.NEXT: ",]" if self._is_array else "",
            _Json.DONE: "",
        }[self._state]
        if char not in expected:
            self._state = _Json.TEXT
            return True
        if self._state is _Json.START:
            self._is_array = char == "["
            if char == "{":
                self._state = _Json.HEAD
                return True
        self._buffer = self._buffer[1:]
        if self._state is _Json.TAIL:
            self._state = _Json.NEXT if self._is_array else _Json.DONE
        elif char == "]":
            self._state = _Json.DONE
        else:
            self._state = _Json.HEAD
        return True

    def _head(self) -> bool:
        head = match_head(self._buffer, self._names)
        if head is True and len(self._buffer) <= MAX_HEAD_LEN:
            return False
        if isinstance(head, bool) or not self.can_call:
            self._state = _Json.TEXT
            return True
        name, start = head
        self._start_call(name)
        self._buffer = self._buffer[start:]
        self._object_end = ObjectEnd()
        self._state = _Json.ARGUMENTS
        return True

    def _argument_text(self) -> bool:
        end = self._object_end.scan(self._buffer)
        if end is None:
            self._arguments(self._buffer)
            self._buffer = ""
            return False
        self._arguments(self._buffer[:end])
        self._buffer = self._buffer[end:]
        self._state = _Json.TAIL
        return True

    def _end(self) -> None:
        if self._state in (_Json.HEAD, _Json.TEXT):
            self._content(self._buffer)
        elif self._state is _Json.ARGUMENTS:
            self._arguments(self._buffer)


def parse_hermes(text: str, names: Collection[str], max_calls: int | None = None) -> ParsedText:
    """The calls of ``names`` in ``text`` (at most ``max_calls``; later blocks stay text)."""
    return parse_text(HermesParser(names, max_calls), text)
