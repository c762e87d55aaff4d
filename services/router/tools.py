"""``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request: checked, turned
into a grammar where a call is required, and the output turned into ``tool_calls``.

``none``: the tools are listed in the prompt, the output is text. ``auto`` (the default with
tools): the output is free text, parsed for calls in the model's format (``tool_parsers``).
``required`` and a named function: the output is constrained to JSON calls (xgrammar, strict
mode), ``{"name": ..., "arguments": ...}`` with the arguments following that tool's
``parameters``: one call object for a named function or ``parallel_tool_calls: false``, else
an array of at least one call. This is the JSON fallback vLLM uses, not the model's own
``<tool_call>`` envelope.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from typing import Any

from services.common.errors import InvalidRequestError
from services.common.types import MAX_GRAMMAR_SPEC_LEN, Grammar, GrammarKind
from services.router.openai_schema import ChatCompletionBody, ToolBody
from services.router.tool_parsers import TOOL_PARSERS, ParsedText, as_call

MAX_TOOLS = 128
TOOL_PARSER = "hermes"  # the format of the Qwen2.5-VL family, whose chats the router writes
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class ToolMode(enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools ask of the output."""

    mode: ToolMode
    tools: tuple[dict[str, Any], ...]  # the tool objects, as the prompt lists them
    names: tuple[str, ...]  # the names calls may use (the named one only, for NAMED)
    is_parallel: bool
    grammar: Grammar | None  # REQUIRED and NAMED

    def parse(self, text: str) -> ParsedText:
        """The output's calls and the text that is not a call."""
        max_calls = None if self.is_parallel else 1
        if self.mode is ToolMode.AUTO:
            return TOOL_PARSERS[TOOL_PARSER](text, self.names, max_calls)
        if self.mode is ToolMode.NONE:
            return ParsedText(text, ())
        try:
            value = json.loads(text)
        except ValueError:  # cut short by max_tokens
            return ParsedText(text, ())
        calls = [as_call(v, self.names) for v in (value if isinstance(value, list) else [value])]
        if not calls or None in calls:
            return ParsedText(text, ())
        return ParsedText("", tuple(c for c in calls if c is not None))


def tool_plan(body: ChatCompletionBody) -> ToolPlan | None:
    """The request's plan, None without tools; ``InvalidRequestError`` naming the field."""
    if body.tools == []:
        raise InvalidRequestError("tools must hold at least one tool", param="tools")
    if body.tools is None:
        for field in ("tools", "tool_choice", "parallel_tool_calls"):
            if getattr(body, field) not in (None, "none"):
                raise InvalidRequestError(f"{field} needs tools", param=field)
        return None
    tools = _checked_tools(body.tools)
    names = tuple(t.function.name for t in tools)
    mode, names = _choice(body.tool_choice, names)
    is_parallel = body.parallel_tool_calls is not False
    if mode is not ToolMode.NONE and body.stream:
        raise InvalidRequestError("stream with tools is not supported yet", param="stream")
    grammar = None
    if mode in (ToolMode.REQUIRED, ToolMode.NAMED):
        if body.response_format is not None and body.response_format.get("type") != "text":
            raise InvalidRequestError(
                "response_format cannot be combined with tool_choice required or a named function",
                param="response_format",
            )
        chosen = [t for t in tools if t.function.name in names]
        grammar = _grammar(chosen, is_array=mode is ToolMode.REQUIRED and is_parallel)
    dumped = tuple(t.model_dump(exclude_none=True) for t in tools)
    return ToolPlan(mode, dumped, names, is_parallel, grammar)


def _checked_tools(tools: list[ToolBody]) -> list[ToolBody]:
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(
            f"tools holds {len(tools)} tools; at most {MAX_TOOLS} are allowed", param="tools"
        )
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise InvalidRequestError(
                f"unsupported tool type {tool.type!r}; expected function",
                param=f"tools[{i}].type",
            )
        name = tool.function.name
        if not _NAME.fullmatch(name) or name in seen:
            raise InvalidRequestError(
                f"tool names must be unique and match [A-Za-z0-9_-]{{1,64}}, got {name!r}",
                param=f"tools[{i}].function.name",
            )
        seen.add(name)
    return tools


def _choice(choice: Any, names: tuple[str, ...]) -> tuple[ToolMode, tuple[str, ...]]:
    if choice is None:
        return ToolMode.AUTO, names
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequestError(
                f"tool_choice must be none, auto, required or a named function, got {choice!r}",
                param="tool_choice",
            )
        return ToolMode(choice), names
    if choice.type != "function" or choice.function.name not in names:
        raise InvalidRequestError(
            f"tool_choice names no function of tools: {choice.function.name!r}",
            param="tool_choice",
        )
    return ToolMode.NAMED, (choice.function.name,)


def _grammar(tools: list[ToolBody], *, is_array: bool) -> Grammar:
    defs: dict[str, Any] = {}
    calls = []
    for tool in tools:
        parameters = dict(tool.function.parameters or {"type": "object", "properties": {}})
        for key, value in parameters.pop("$defs", {}).items():
            if defs.setdefault(key, value) != value:
                raise InvalidRequestError(
                    f"tools define $defs/{key} differently; the call grammar merges them",
                    param="tools",
                )
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.function.name}, "arguments": parameters},
                "required": ["name", "arguments"],
            }
        )
    schema: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if is_array:
        schema = {"type": "array", "items": schema, "minItems": 1}
    if defs:
        schema = {**schema, "$defs": defs}
    text = json.dumps(schema, separators=(",", ":"))
    if len(text) > MAX_GRAMMAR_SPEC_LEN:
        raise InvalidRequestError(
            f"tools: the call schema is longer than {MAX_GRAMMAR_SPEC_LEN} characters as JSON",
            param="tools",
        )
    return Grammar(GrammarKind.JSON_SCHEMA, text, is_strict=True)
