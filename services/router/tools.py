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

Both APIs plan through ``plan_tools``: HTTP from the chat body (``tool_plan``), gRPC from
``GenerateRequest.tools`` (the servicer), each naming its own fields in errors (``ToolParams``).
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

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


class FunctionTool(msgspec.Struct, frozen=True):
    """One function tool of a request, whichever API it came through."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # the JSON schema of its arguments object
    strict: bool | None = None

    def listing(self) -> dict[str, Any]:
        """The tool object as the prompt lists it: OpenAI's shape, unset fields left out."""
        function = {
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "strict": self.strict,
        }
        kept = {key: value for key, value in function.items() if value is not None}
        return {"type": "function", "function": kept}


@dataclass(frozen=True)
class ToolParams:
    """Where an API keeps its tool fields, as its errors name them."""

    tool: str  # the i-th tool's function fields, a format of i
    mode: str  # tool_choice none / auto / required
    named: str  # tool_choice naming a function


HTTP_TOOL_PARAMS = ToolParams("tools[{i}].function", "tool_choice", "tool_choice")


def tool_plan(body: ChatCompletionBody, style: ToolFormat = ToolFormat.HERMES) -> ToolPlan | None:
    """The chat request's plan, None without tools; ``InvalidRequestError`` naming the field.
    ``style``: the model's tool-call format."""
    tools = None if body.tools is None else _function_tools(body.tools)
    choice, named = body.tool_choice, None
    if choice is not None and not isinstance(choice, str):
        if choice.type != "function":
            raise InvalidRequestError(
                f"tool_choice type must be function, got {choice.type!r}", param="tool_choice"
            )
        choice, named = None, choice.function.name
    constrained = constraint_fields(body)  # response_format, structured_outputs, guided_*
    return plan_tools(tools, choice, named, body.parallel_tool_calls, constrained, style)


def plan_tools(
    tools: list[FunctionTool] | None,
    mode: str | None,
    named: str | None,
    parallel_tool_calls: bool | None,
    constrained: list[str],
    style: ToolFormat,
    params: ToolParams = HTTP_TOOL_PARAMS,
) -> ToolPlan | None:
    """The plan of a request's tools (None: it has none), tool choice (``mode``: none / auto /
    required, or the ``named`` function; neither: auto) and ``parallel_tool_calls``;
    ``constrained``: the request's fields that constrain the output (a required call cannot
    join them). ``InvalidRequestError`` naming the field as ``params`` locate it."""
    if tools is None:
        given = [
            (params.mode, mode not in (None, "none")),
            (params.named, named is not None),
            ("parallel_tool_calls", parallel_tool_calls is not None),
        ]
        for field, is_set in given:
            if is_set:
                raise InvalidRequestError(f"{field} needs tools", param=field)
        return None
    _check_tools(tools, params)
    tool_mode, names = _choice(mode, named, tuple(t.name for t in tools), params)
    is_parallel = parallel_tool_calls is not False
    grammar = None
    if tool_mode in (ToolMode.REQUIRED, ToolMode.NAMED):
        if constrained:
            raise InvalidRequestError(
                f"{constrained[0]} cannot be combined with tool_choice required or a named "
                "function",
                param=constrained[0],
            )
        chosen = [t for t in tools if t.name in names]
        grammar = _grammar(chosen, is_array=tool_mode is ToolMode.REQUIRED and is_parallel)
    listed = tuple(t.listing() for t in tools)
    return ToolPlan(tool_mode, listed, names, is_parallel, grammar, style)


def _function_tools(tools: list[ToolBody]) -> list[FunctionTool]:
    for i, tool in enumerate(tools):
        if tool.type != "function":
            raise InvalidRequestError(
                f"unsupported tool type {tool.type!r}; expected function",
                param=f"tools[{i}].type",
            )
    return [
        FunctionTool(f.name, f.description, f.parameters, f.strict)
        for f in (tool.function for tool in tools)
    ]


def _check_tools(tools: list[FunctionTool], params: ToolParams) -> None:
    if not tools:
        raise InvalidRequestError("tools must hold at least one tool", param="tools")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(
            f"tools holds {len(tools)} tools; at most {MAX_TOOLS} are allowed", param="tools"
        )
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        if not _NAME.fullmatch(tool.name) or tool.name in seen:
            raise InvalidRequestError(
                f"tool names must be unique and match [A-Za-z0-9_-]{{1,64}}, got {tool.name!r}",
                param=f"{params.tool.format(i=i)}.name",
            )
        seen.add(tool.name)


def _choice(
    mode: str | None, named: str | None, names: tuple[str, ...], params: ToolParams
) -> tuple[ToolMode, tuple[str, ...]]:
    if named is not None:
        if named not in names:
            raise InvalidRequestError(
                f"tool_choice names no function of tools: {named!r}", param=params.named
            )
        return ToolMode.NAMED, (named,)
    if mode is None:
        return ToolMode.AUTO, names
    if mode not in ("none", "auto", "required"):
        raise InvalidRequestError(
            f"tool_choice must be none, auto, required or a named function, got {mode!r}",
            param=params.mode,
        )
    return ToolMode(mode), names


def _grammar(tools: list[FunctionTool], *, is_array: bool) -> Grammar:
    defs: dict[str, Any] = {}
    calls = []
    for tool in tools:
        parameters = dict(tool.parameters or {"type": "object", "properties": {}})
        for key, value in parameters.pop("$defs", {}).items():
            if defs.setdefault(key, value) != value:
                raise InvalidRequestError(
                    f"tools define $defs/{key} differently; the call grammar merges them",
                    param="tools",
                )
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, "arguments": parameters},
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
