"""Qwen3-Coder's (and Qwen3.5's) XML tool calls, streamed as OpenAI's JSON arguments.

A call is ``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...
</function>\\n</tool_call>``. The values are text; each is given the JSON type its tool's
schema declares for the parameter (``typed_value``): a string value streams as it comes, one
of another type is held to its end, converted, and kept as a string when it does not convert
(a bad number never drops the call). One newline after the parameter's tag and one before its
end tag are the format's, not the value's. A value also ends where the next parameter, the
function or the block begins (a missing ``</parameter>``). Text between the parameters of a
call, or after its ``</function>``, is content. The rules shared with the other formats are
in ``tool_parsers``.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Collection, Mapping
from typing import Any

from services.router.tool_parsers import (
    CLOSE,
    MAX_HEAD_LEN,
    OPEN,
    BaseToolParser,
    first_tag,
    held_len,
)

FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_VALUE_ENDS = (PARAMETER_END, PARAMETER, FUNCTION_END, CLOSE)
_BETWEEN_TAGS = (PARAMETER, FUNCTION_END, CLOSE)
_TYPE_ORDER = ("null", "boolean", "integer", "number", "object", "array")


def schema_types(schema: Mapping[str, Any] | None) -> frozenset[str]:
    """The JSON types ``schema`` declares (``type``, or its ``anyOf`` / ``oneOf`` members');
    empty when it declares none."""
    if not isinstance(schema, Mapping):
        return frozenset()
    declared = schema.get("type")
    if isinstance(declared, str):
        return frozenset((declared,))
    if isinstance(declared, list):
        return frozenset(t for t in declared if isinstance(t, str))
    members = [*schema.get("anyOf", ()), *schema.get("oneOf", ())]
    return frozenset(t for m in members for t in schema_types(m))


def is_text_value(schema: Mapping[str, Any] | None) -> bool:
    """Whether a parameter's value is a string whatever it reads: its schema declares no type
    but string (or none at all, as vLLM and SGLang also take it)."""
    return schema_types(schema) <= {"string"}


def typed_value(text: str, schema: Mapping[str, Any] | None) -> Any:
    """A parameter's text as the JSON value its schema's type asks for: the first declared
    non-string type it reads as (in ``_TYPE_ORDER``), else the text itself."""
    types = schema_types(schema)
    stripped = text.strip()
    for kind in _TYPE_ORDER:
        if kind in types and (value := _as_type(stripped, kind)) is not _NO_VALUE:
            return value
    return text


_NO_VALUE = object()


def _as_type(text: str, kind: str) -> Any:
    if kind == "null":
        return None if text.lower() in ("null", "none") else _NO_VALUE
    if kind == "boolean":
        return {"true": True, "false": False}.get(text.lower(), _NO_VALUE)
    try:
        value = json.loads(text)
    except ValueError:
        return _NO_VALUE
    wanted = {"integer": int, "number": (int, float), "object": dict, "array": list}[kind]
    if isinstance(value, bool) or not isinstance(value, wanted):
        return _NO_VALUE
    return value


def _escaped(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


class _Value:
    """One parameter's value, written as JSON text while its text comes in."""

    def __init__(self, schema: Mapping[str, Any] | None) -> None:
        self._schema = schema
        self._is_text = is_text_value(schema)
        self._text = ""  # a typed value's text, held to its end
        self._is_open = False  # a string value's opening quote is out
        self._newline = ""  # a string value's last newline: the format's, if the end follows

    def feed(self, text: str) -> str:
        if not self._is_text:
            self._text += text
            return ""
        if not text:
            return ""
        head = ""
        if not self._is_open:
            head, self._is_open = '"', True
            text = text.removeprefix("\n")
        text = self._newline + text
        self._newline = "\n" if text.endswith("\n") else ""
        return head + _escaped(text.removesuffix(self._newline))

    def end(self) -> str:
        if not self._is_text:
            text = self._text.removeprefix("\n").removesuffix("\n")
            return json.dumps(typed_value(text, self._schema), ensure_ascii=False)
        return '"' if self._is_open else '""'

    def cut(self) -> str:
        """The value's text held back, when the output ended inside it."""
        if not self._is_text:
            return self.end()
        return _escaped(self._newline)


class _Xml(enum.Enum):
    TEXT = "text"  # content, until a <tool_call>
    HEAD = "head"  # after <tool_call>: <function=NAME>, or not a call
    PARAMETERS = "parameters"  # inside a function, between its parameters
    VALUE = "value"  # a parameter's value
    TAIL = "tail"  # after </function>, until </tool_call>
    BLOCK = "block"  # a block that did not open as a call, held to its end


class Qwen3CoderParser(BaseToolParser):
    """``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>``
    blocks; ``schemas``: each tool's ``parameters`` schema."""

    def __init__(
        self,
        names: Collection[str],
        max_calls: int | None = None,
        schemas: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        super().__init__(names, max_calls)
        self._schemas = schemas or {}
        self._state = _Xml.TEXT
        self._properties: Mapping[str, Any] = {}
        self._num_parameters = 0
        self._value = _Value(None)

    def _step(self) -> bool:
        return {
            _Xml.TEXT: self._text,
            _Xml.HEAD: self._head,
            _Xml.PARAMETERS: self._parameters,
            _Xml.VALUE: self._value_text,
            _Xml.TAIL: self._tail,
            _Xml.BLOCK: self._block,
        }[self._state]()

    def _text(self) -> bool:
        is_opened = self._text_until_block()
        if is_opened:
            self._state = _Xml.HEAD
        return is_opened is not None

    def _head(self) -> bool:
        given = self._buffer.lstrip()
        end = given.find(">")
        if not given or (FUNCTION.startswith(given) and len(given) < len(FUNCTION)):
            is_call: bool | None = None if len(self._buffer) <= MAX_HEAD_LEN else False
        elif not given.startswith(FUNCTION):
            is_call = False
        elif end < 0:
            is_call = None if len(given) <= MAX_HEAD_LEN else False
        else:
            is_call = given[len(FUNCTION) : end].strip() in self._names
        if is_call is None:
            return False
        if not is_call:
            self._state = _Xml.BLOCK
            return True
        name = given[len(FUNCTION) : end].strip()
        self._start_call(name)
        properties = self._schemas.get(name, {}).get("properties")
        self._properties = properties if isinstance(properties, Mapping) else {}
        self._num_parameters = 0
        self._buffer = given[end + 1 :]
        self._state = _Xml.PARAMETERS
        return True

    def _parameters(self) -> bool:
        given = self._buffer
        space = len(given) - len(given.lstrip())
        i, tag = first_tag(given, _BETWEEN_TAGS)
        if i != space:  # no tag next: text, or what may begin a tag, or whitespace
            held = held_len(given, _BETWEEN_TAGS)
            if held == len(given) - space:  # whitespace and the start of a tag, perhaps
                return False
            # Text between the parameters is content; whitespace before a tag is not.
            stray = len(given[: i if i >= 0 else len(given) - held].rstrip())
            self._content(given[:stray])
            self._buffer = given[stray:]
            return i >= 0
        given = self._buffer = given[space:]
        if tag == PARAMETER:
            end = given.find(">")
            if end < 0:
                return False
            key = given[len(PARAMETER) : end].strip()
            self._arguments(("{" if not self._num_parameters else ", ") + _key(key))
            self._num_parameters += 1
            self._value = _Value(self._properties.get(key))
            self._buffer = given[end + 1 :]
            self._state = _Xml.VALUE
            return True
        self._close_arguments()
        self._buffer = given[len(tag) :]
        self._state = _Xml.TAIL if tag == FUNCTION_END else _Xml.TEXT
        return True

    def _value_text(self) -> bool:
        buffer = self._buffer
        i, tag = first_tag(buffer, _VALUE_ENDS)
        if i < 0:
            keep = len(buffer) - held_len(buffer, _VALUE_ENDS)
            self._arguments(self._value.feed(buffer[:keep]))
            self._buffer = buffer[keep:]
            return False
        self._arguments(self._value.feed(buffer[:i]) + self._value.end())
        self._buffer = buffer[i + len(tag) if tag == PARAMETER_END else i :]
        self._state = _Xml.PARAMETERS
        return True

    def _close_arguments(self) -> None:
        self._arguments("}" if self._num_parameters else "{}")

    def _tail(self) -> bool:
        i, tag = self._end_tag((CLOSE, OPEN))
        if i < 0:
            return False
        if self._buffer[:i].strip():
            self._content(self._buffer[:i])
        self._buffer = self._buffer[i + len(tag) if tag == CLOSE else i :]
        self._state = _Xml.TEXT
        return True

    def _block(self) -> bool:
        i, tag = self._end_tag((CLOSE, OPEN))
        if i < 0:
            return False
        self._content(OPEN + self._buffer[: i + len(tag) if tag == CLOSE else i])
        self._buffer = self._buffer[i + len(tag) if tag == CLOSE else i :]
        self._state = _Xml.TEXT
        return True

    def _end(self) -> None:
        state, buffer = self._state, self._buffer
        if state is _Xml.TEXT or (state is _Xml.TAIL and buffer.strip()):
            self._content(buffer)
        elif state in (_Xml.HEAD, _Xml.BLOCK):
            self._content(OPEN + buffer)
        elif state is _Xml.VALUE:  # cut short
            self._arguments(self._value.feed(buffer) + self._value.cut())
        # PARAMETERS: at most a tag cut short, the call's arguments with it


def _key(key: str) -> str:
    return json.dumps(key, ensure_ascii=False) + ": "
