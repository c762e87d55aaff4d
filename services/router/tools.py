"""``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request: checked, turned
into a grammar where a call is required, and the output turned into ``tool_calls``, whole or
as a stream.

``none``: the tools are listed in the prompt, the output is text. ``auto`` (the default with
tools): the output is free text, parsed for calls in the model's format (``tool_parsers``,
chosen by ``--tool-call-parser``, ``resolve_tool_format``). ``required`` and a named function:
the output is constrained to JSON calls (xgrammar, strict mode), ``{"name": ...,
"arguments": ...}`` with the arguments following that tool's ``parameters``: one call object
for a named function or ``parallel_tool_calls: false``, else an array of at least one call.
This is the JSON fallback vLLM uses, not the model's own ``<tool_call>`` envelope.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.common.errors import InvalidRequestError
from services.common.types import MAX_GRAMMAR_SPEC_LEN, Grammar, GrammarKind
from services.engine.processing.chat import find_chat_template, read_json
from services.router.config import AUTO_TOOL_CALL_PARSER
from services.router.openai_format import ResponseFormatter
from services.router.openai_params import constraint_fields
from services.router.openai_schema import ChatCompletionBody, ToolBody
from services.router.tool_parser_json import HermesParser, JsonCallsParser
from services.router.tool_parser_xml import Qwen3CoderParser
from services.router.tool_parsers import BaseToolParser, ParsedText, ToolFormat, parse_text
from services.router.tool_stream import ToolCallStream

MAX_TOOLS = 128
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def resolve_tool_format(choice: str, model_dir: Path) -> ToolFormat:
    """The tool-call format ``--tool-call-parser`` names; ``auto``: the one the checkpoint's
    chat template writes calls in, ``qwen3_coder`` when it writes ``<function=...>`` calls,
    else ``hermes`` (the format of every model family the engine runs)."""
    if choice != AUTO_TOOL_CALL_PARSER:
        return ToolFormat(choice)
    template = find_chat_template(model_dir, read_json(model_dir / "tokenizer_config.json"))
    return ToolFormat.QWEN3_CODER if "<function=" in template else ToolFormat.HERMES


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
    style: ToolFormat  # the model's tool-call format

    def parser(self) -> BaseToolParser | None:
        """A parser for one output's calls; None for NONE (the output is text)."""
        max_calls = None if self.is_parallel else 1
        if self.mode is ToolMode.NONE:
            return None
        if self.mode is not ToolMode.AUTO:
            return JsonCallsParser(self.names, max_calls)
        if self.style is ToolFormat.HERMES:
            return HermesParser(self.names, max_calls)
        schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in self.tools}
        return Qwen3CoderParser(self.names, max_calls, schemas)

    def parse(self, text: str) -> ParsedText:
        """The output's calls and the text that is not a call."""
        parser = self.parser()
        return ParsedText(text, ()) if parser is None else parse_text(parser, text)

    def stream(self, formatter: ResponseFormatter, include_usage: bool) -> ToolCallStream | None:
        """The chunks of a streamed output's calls; None for NONE (a plain text stream)."""
        parser = self.parser()
        return None if parser is None else ToolCallStream(parser, formatter, include_usage)


def tool_plan(body: ChatCompletionBody, style: ToolFormat = ToolFormat.HERMES) -> ToolPlan | None:
    """The request's plan, None without tools; ``InvalidRequestError`` naming the field.
    ``style``: the model's tool-call format."""
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
    grammar = None
    if mode in (ToolMode.REQUIRED, ToolMode.NAMED):
        constrained = constraint_fields(body)  # response_format, structured_outputs, guided_*
        if constrained:
            raise InvalidRequestError(
                f"{constrained[0]} cannot be combined with tool_choice required or a named "
                "function",
                param=constrained[0],
            )
        chosen = [t for t in tools if t.function.name in names]
        grammar = _grammar(chosen, is_array=mode is ToolMode.REQUIRED and is_parallel)
    dumped = tuple(t.model_dump(exclude_none=True) for t in tools)
    return ToolPlan(mode, dumped, names, is_parallel, grammar, style)


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
