"""Tools and tool turns in the prompt as each tool-call format's chat template writes them, and
the format ``--tool-call-parser auto`` picks from the chat template."""

from __future__ import annotations

import json
import shutil

import pytest

from services.common.types import ChatMessage, TextPart
from services.router.config import RouterConfig
from services.router.tool_parser_xml import Qwen3CoderParser
from services.router.tool_parsers import ToolFormat, parse_text
from services.router.tool_prompt import tool_call, tool_calls, with_tools
from services.router.tools import resolve_tool_format
from tests.conftest import TINY_MODEL_DIR
from tests.router.fakes import TEXT
from tests.router.tool_defs import WEATHER

XML_TOOLS_HEAD = "# Tools\n\nYou have access to the following functions:\n\n<tools>\n"


def render(messages) -> str:
    return TEXT.render_chat(
        [
            {"role": m.role, "content": [{"type": "text", "text": p.text} for p in m.content]}
            for m in messages
        ]
    )


def test_qwen3_coder_tools_open_the_system_message_before_its_text():
    system = ChatMessage("system", (TextPart("  Be brief. "),))
    user = ChatMessage("user", (TextPart("Weather?"),))
    rendered = render(with_tools([system, user], [WEATHER], ToolFormat.QWEN3_CODER))
    head = "<|im_start|>system\n" + XML_TOOLS_HEAD + json.dumps(WEATHER) + "\n</tools>\n\n"
    assert rendered.startswith(head + "If you choose to call a function ONLY reply in the ")
    assert rendered.endswith(
        "</IMPORTANT>\n\nBe brief.<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert "<tool_call>\n<function=example_function_name>\n<parameter=" in rendered


def test_qwen3_coder_tools_without_a_system_message_have_no_default_text():
    user = ChatMessage("user", (TextPart("Weather?"),))
    [system, _] = with_tools([user], [WEATHER], ToolFormat.QWEN3_CODER)
    assert system.content[0].text.startswith(XML_TOOLS_HEAD)
    assert system.content[0].text.endswith("</IMPORTANT>")


def test_hermes_keeps_an_empty_system_message_empty():
    system = ChatMessage("system", ())
    [first] = with_tools([system], [WEATHER], ToolFormat.HERMES)
    assert first.content[0].text.startswith("\n\n# Tools\n\nYou may call one or more")


def test_qwen3_coder_calls_render_as_qwen35_writes_them():
    calls = [("get_weather", {"city": "Oslo", "days": 3}), ("get_time", {})]
    assert tool_calls(calls, after_text=True, style=ToolFormat.QWEN3_CODER) == (
        "\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
    )
    assert tool_calls(calls[1:], after_text=False) == (
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )


def test_a_rendered_qwen3_coder_call_parses_back_to_its_arguments():
    arguments = {
        "city": "São Paulo\n<b>",
        "days": 3,
        "metric": True,
        "where": {"lat": 1.5, "tags": ["a"]},
        "tags": [1, "x"],
        "note": None,
    }
    text = tool_call("get_weather", arguments, ToolFormat.QWEN3_CODER)
    schemas = {"get_weather": WEATHER["function"]["parameters"]}
    parsed = parse_text(Qwen3CoderParser(["get_weather"], None, schemas), text)
    assert [c.name for c in parsed.calls] == ["get_weather"] and not parsed.content
    assert json.loads(parsed.calls[0].arguments) == arguments


@pytest.mark.parametrize(
    ("template", "choice", "wanted"),
    [
        (None, "auto", ToolFormat.HERMES),  # the tiny model's template writes no calls
        ("{{ '<tool_call>\\n<function=' + name + '>' }}", "auto", ToolFormat.QWEN3_CODER),
        ("{{ '<tool_call>\\n{\"name\": ' }}", "auto", ToolFormat.HERMES),
        (None, "qwen3_coder", ToolFormat.QWEN3_CODER),
        ("{{ '<function=' }}", "hermes", ToolFormat.HERMES),
    ],
)
def test_resolve_tool_format(tmp_path, template, choice, wanted):
    model_dir = TINY_MODEL_DIR
    if template is not None:
        model_dir = tmp_path / "model"
        shutil.copytree(TINY_MODEL_DIR, model_dir)
        (model_dir / "chat_template.jinja").write_text(template)
    assert resolve_tool_format(choice, model_dir) is wanted


def test_an_unknown_tool_call_parser_is_refused():
    with pytest.raises(ValueError, match="--tool-call-parser"):
        RouterConfig(model=TINY_MODEL_DIR, tool_call_parser="mistral")
