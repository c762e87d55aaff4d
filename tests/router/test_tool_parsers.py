"""The tool-call parsers (hermes, qwen3_coder, bare JSON calls): whole outputs, and the same
outputs streamed in every chunking, which must say the same and never send a tag's start as
content."""

from __future__ import annotations

import json
import random

import pytest

from services.common.types import FinishReason
from services.router.tool_parser_json import HermesParser, JsonCallsParser, match_head
from services.router.tool_parser_xml import Qwen3CoderParser, typed_value
from services.router.tool_parsers import (
    CLOSE,
    OPEN,
    ArgumentsEvent,
    CallEvent,
    ContentEvent,
    ParsedCall,
    ParsedText,
    choice_finish_reason,
    collect,
    parse_text,
)

NAMES = ("get_weather", "get_time")
SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "metric": {"type": "boolean"},
            "ratio": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string"}},
            "where": {"type": "object"},
            "note": {"type": ["string", "null"]},
            "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
        },
    },
    "get_time": {"type": "object", "properties": {}},
}
CALL = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'


def hermes(max_calls=None):
    return HermesParser(NAMES, max_calls)


def xml(max_calls=None):
    return Qwen3CoderParser(NAMES, max_calls, SCHEMAS)


def json_calls(max_calls=None):
    return JsonCallsParser(NAMES, max_calls)


def block(text: str) -> str:
    return f"{OPEN}\n{text}\n{CLOSE}"


def function(name: str, *parameters: tuple[str, str]) -> str:
    inner = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in parameters)
    return f"{OPEN}\n<function={name}>\n{inner}</function>\n{CLOSE}"


def streamed(make, text: str, cuts: list[int]) -> tuple[ParsedText, list]:
    """``text`` fed cut at ``cuts``: what the stream says, and its events."""
    parser, events, start = make(), [], 0
    for end in [*cuts, len(text)]:
        events += parser.feed(text[start:end])
        start = end
    events += parser.finish()
    return collect(events), events


def chunkings(text: str, seed: int = 0) -> list[list[int]]:
    """One character at a time, every cut in two, and random cuts."""
    rng = random.Random(seed)
    every_cut = [[i] for i in range(1, len(text))]
    rand = [sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, k))) for k in (3, 9)]
    return [list(range(1, len(text))), *every_cut, *rand]


def assert_stream_says_the_same(make, text: str) -> ParsedText:
    whole = parse_text(make(), text)
    for cuts in chunkings(text):
        assert streamed(make, text, cuts)[0] == whole, cuts
    return whole


HERMES_CASES = [
    ("Just text.", "Just text.", []),
    ("  spaced text \n", "  spaced text \n", []),
    (block(CALL), "", [("get_weather", '{"city": "Oslo"}')]),
    (
        "Let me look.\n" + block(CALL) + "\n" + block('{"name": "get_time", "arguments": {}}'),
        "Let me look.",
        [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")],
    ),
    (block(CALL) + "\nDone.", "Done.", [("get_weather", '{"city": "Oslo"}')]),
    ("A\n" + block(CALL) + "\nB", "A\nB", [("get_weather", '{"city": "Oslo"}')]),
    (  # nested arrays of objects, braces and escapes inside strings, unicode
        block('{"name": "get_weather", "arguments": {"city": [{"a": "é}\\"{"}], "b": {}}}'),
        "",
        [("get_weather", '{"city": [{"a": "é}\\"{"}], "b": {}}')],
    ),
    (  # compact, without the newlines
        '<tool_call>{"name":"get_time","arguments":{}}</tool_call>',
        "",
        [("get_time", "{}")],
    ),
    (block("{not json"), block("{not json"), []),
    (block('{"name": "rm_rf", "arguments": {}}'), block('{"name": "rm_rf", "arguments": {}}'), []),
    (
        block('{"name": "get_time", "arguments": "x"}'),
        block('{"name": "get_time", "arguments": "x"}'),
        [],
    ),
    (  # a whole call in another key order is still the call
        block('{"arguments": {"city": "Oslo"}, "name": "get_weather"}'),
        "",
        [("get_weather", '{"city": "Oslo"}')],
    ),
    (OPEN + "\n" + CALL, "", [("get_weather", '{"city": "Oslo"}')]),  # no closing tag
    (OPEN + "\n" + CALL[:-6], "", [("get_weather", '{"city": "O')]),  # cut short
    (OPEN + '\n{"name": "get_wea', OPEN + '\n{"name": "get_wea', []),  # cut in the head
    ("Almost <tool_ca", "Almost <tool_ca", []),
    ("a < b and <tool> </tool_call>", "a < b and <tool> </tool_call>", []),
    (  # malformed arguments after a good head: the call, its arguments as written
        block('{"name": "get_time", "arguments": {"a": 1,, "b"}}'),
        "",
        [("get_time", '{"a": 1,, "b"}')],
    ),
    (  # unbalanced arguments end at the closing tag
        block('{"name": "get_time", "arguments": {"a": [1}'),
        "",
        [("get_time", '{"a": [1}\n')],
    ),
    (  # text after the call object inside the block is content
        block('{"name": "get_time", "arguments": {}, "extra": 1}'),
        ', "extra": 1}',
        [("get_time", "{}")],
    ),
    (  # a block left open before the next one
        OPEN + '\n{"name": "get_time", "arguments": {}}\n' + block(CALL),
        "",
        [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')],
    ),
    (OPEN + "garbage" + block(CALL), OPEN + "garbage", [("get_weather", '{"city": "Oslo"}')]),
]


@pytest.mark.parametrize(("text", "content", "calls"), HERMES_CASES)
def test_hermes_streams_what_the_whole_output_says(text, content, calls):
    parsed = assert_stream_says_the_same(hermes, text)
    assert parsed == ParsedText(content, tuple(ParsedCall(n, a) for n, a in calls))


def test_hermes_calls_past_max_calls_stay_text():
    text = block(CALL) + "\n" + block('{"name": "get_time", "arguments": {}}')
    parsed = assert_stream_says_the_same(lambda: hermes(1), text)
    assert [c.name for c in parsed.calls] == ["get_weather"]
    assert parsed.content == block('{"name": "get_time", "arguments": {}}')


@pytest.mark.parametrize("make", [hermes, xml])
def test_no_start_of_a_tag_is_ever_sent_as_content(make):
    call = block(CALL) if make is hermes else function("get_time")
    text = "Sure, <b>one</b> moment." + call + " Then <tool_c more."
    content = "Sure, <b>one</b> moment. Then <tool_c more."
    parser, sent = make(), ""
    for char in text:  # what was sent is never taken back: it begins the content
        for event in parser.feed(char):
            if isinstance(event, CallEvent):
                assert sent == "Sure, <b>one</b> moment."
            if isinstance(event, ContentEvent):
                sent += event.text
        assert content.startswith(sent), sent
    sent += "".join(e.text for e in parser.finish() if isinstance(e, ContentEvent))
    assert sent == content


def test_hermes_streams_the_name_first_then_the_arguments_in_pieces():
    text = "Hi " + block('{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}')
    _, events = streamed(hermes, text, list(range(1, len(text))))
    start = next(i for i, e in enumerate(events) if isinstance(e, CallEvent))
    assert events[start] == CallEvent(0, "get_weather")
    pieces = [e.text for e in events[start + 1 :] if isinstance(e, ArgumentsEvent)]
    assert len(pieces) > 10 and "".join(pieces) == '{"city": "Oslo", "days": 3}'
    assert all(not isinstance(e, ContentEvent) for e in events[start:])


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (CALL, "", [("get_weather", '{"city": "Oslo"}')]),
        (
            '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
            '{"name": "get_time", "arguments": {}}]',
            "",
            [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")],
        ),
        ('[{"name":"get_time","arguments":{"a":"]}"}}]', "", [("get_time", '{"a":"]}"}')]),
        ("[" + CALL + ", " + CALL[:20], CALL[:20], [("get_weather", '{"city": "Oslo"}')]),
        (CALL[:-4], "", [("get_weather", '{"city": "Osl')]),  # cut by max_tokens
        ('{"name": "rm_rf", "arguments": {}}', '{"name": "rm_rf", "arguments": {}}', []),
        ("not json", "not json", []),
    ],
)
def test_json_calls_stream_what_the_whole_output_says(text, content, calls):
    parsed = assert_stream_says_the_same(json_calls, text)
    assert parsed == ParsedText(content, tuple(ParsedCall(n, a) for n, a in calls))


XML_CASES = [
    ("Just text.", "Just text.", []),
    (
        "Let me look.\n" + function("get_weather", ("city", "Oslo"), ("days", "3")),
        "Let me look.",
        [("get_weather", '{"city": "Oslo", "days": 3}')],
    ),
    (function("get_time"), "", [("get_time", "{}")]),
    (  # two calls
        function("get_time") + "\n" + function("get_weather", ("city", "Oslo")),
        "",
        [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')],
    ),
    (  # strings keep their inner newlines, quotes and tags; only the format's newlines go
        function("get_weather", ("city", '\n  "Oslo" <b>\\n\n')),
        "",
        [("get_weather", json.dumps({"city": '\n  "Oslo" <b>\\n\n'}))],
    ),
    (  # each value typed by the schema
        function(
            "get_weather",
            ("days", "3"),
            ("metric", "True"),
            ("ratio", "0.5"),
            ("tags", '["a", "b"]'),
            ("where", '{"lat": 1}'),
            ("note", "null"),
            ("limit", "7"),
            ("other", "12"),
        ),
        "",
        [
            (
                "get_weather",
                '{"days": 3, "metric": true, "ratio": 0.5, "tags": ["a", "b"], '
                '"where": {"lat": 1}, "note": null, "limit": 7, "other": "12"}',
            )
        ],
    ),
    (  # a value its type does not read stays a string; the call stays
        function("get_weather", ("days", "three"), ("metric", "maybe")),
        "",
        [("get_weather", '{"days": "three", "metric": "maybe"}')],
    ),
    (  # compact, without the newlines, and a missing </parameter>
        "<tool_call><function=get_weather><parameter=city>Oslo<parameter=days>2</function>"
        "</tool_call>",
        "",
        [("get_weather", '{"city": "Oslo", "days": 2}')],
    ),
    (function("rm_rf", ("path", "/")), function("rm_rf", ("path", "/")), []),
    (OPEN + "\nnot a function\n" + CLOSE, OPEN + "\nnot a function\n" + CLOSE, []),
    (  # cut short inside a string value, then a typed one
        function("get_weather", ("city", "Oslo"))[:54],
        "",
        [("get_weather", '{"city": "Os')],
    ),
    (
        OPEN + "\n<function=get_weather>\n<parameter=days>\n12",
        "",
        [("get_weather", '{"days": 12')],
    ),
    (OPEN + "\n<function=get_wea", OPEN + "\n<function=get_wea", []),
    (  # text between parameters and after the function is content
        OPEN + "\n<function=get_time>\nhmm\n</function>\nok\n" + CLOSE,
        "hmm\nok",
        [("get_time", "{}")],
    ),
]


@pytest.mark.parametrize(("text", "content", "calls"), XML_CASES)
def test_qwen3_coder_streams_what_the_whole_output_says(text, content, calls):
    parsed = assert_stream_says_the_same(xml, text)
    assert parsed == ParsedText(content, tuple(ParsedCall(n, a) for n, a in calls))


def test_qwen3_coder_streams_string_values_and_holds_typed_ones():
    text = function("get_weather", ("city", "Rio de Janeiro"), ("days", "10"))
    _, events = streamed(xml, text, list(range(1, len(text))))
    pieces = [e.text for e in events if isinstance(e, ArgumentsEvent)]
    assert "".join(pieces) == '{"city": "Rio de Janeiro", "days": 10}'
    assert {"R", "i", "o"} <= set(pieces)  # the string came a character at a time
    assert "10" in pieces  # the integer came whole, converted


def test_qwen3_coder_calls_past_max_calls_stay_text():
    second = function("get_weather", ("city", "Oslo"))
    parsed = assert_stream_says_the_same(lambda: xml(1), function("get_time") + "\n" + second)
    assert [c.name for c in parsed.calls] == ["get_time"] and parsed.content == second


@pytest.mark.parametrize(
    ("text", "schema", "value"),
    [
        ("3", {"type": "integer"}, 3),
        (" 3\n", {"type": "number"}, 3),
        ("2.5", {"type": "integer"}, "2.5"),
        ("1e3", {"type": "number"}, 1000.0),
        ("FALSE", {"type": "boolean"}, False),
        ("None", {"type": ["integer", "null"]}, None),
        ("true", {"type": "string"}, "true"),
        ("[1]", {"type": "object"}, "[1]"),
        ("[1]", {"type": ["object", "array"]}, [1]),
        ("5", None, "5"),
        ("5", {"enum": [5, 6]}, "5"),  # no declared type: text, as vLLM and SGLang take it
    ],
)
def test_typed_value(text, schema, value):
    assert typed_value(text, schema) == value
    assert type(typed_value(text, schema)) is type(value)


@pytest.mark.parametrize(
    ("text", "result"),
    [
        ("", True),
        ('  {\n "name" : "get_ti', True),
        ('{"name": "get_time", "arguments": ', True),
        ('{"name": "get_time", "arguments": {', ("get_time", 34)),
        ('{"name": "rm", "arguments": {', False),
        ('{"name": "get_time", "arguments": [', False),
        ('{"arguments": {}, "name": "get_time"}', False),
        ("[", False),
    ],
)
def test_match_head(text, result):
    assert match_head(text, NAMES) == result


@pytest.mark.parametrize(
    ("reason", "has_calls", "wanted"),
    [
        (FinishReason.STOP, True, "tool_calls"),
        (FinishReason.STOP, False, "stop"),
        (FinishReason.LENGTH, True, "length"),
    ],
)
def test_choice_finish_reason(reason, has_calls, wanted):
    assert choice_finish_reason(reason, has_calls) == wanted


FRAGMENTS = {
    "hermes": [OPEN, CLOSE, CALL, '{"name": "get_time", "arguments": ', "{", "}", '"', "\\"],
    "xml": [
        OPEN,
        CLOSE,
        "<function=get_weather>",
        "<function=get_time>",
        "</function>",
        "<parameter=city>",
        "<parameter=days>",
        "</parameter>",
        "12",
    ],
    "json": [CALL, "[", "]", ", ", '{"name": "get_time", "arguments": {', "}"],
}
COMMON = ["\n", " ", "text", "<", "<tool", "</", "é", '"x"']


@pytest.mark.parametrize(("kind", "make"), [("hermes", hermes), ("xml", xml), ("json", json_calls)])
def test_random_outputs_stream_what_the_whole_output_says(kind, make):
    rng = random.Random(kind)
    fragments = FRAGMENTS[kind] + COMMON
    for _ in range(300):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(1, 14)))
        whole = parse_text(make(), text)
        cut_sets = [list(range(1, len(text)))]
        cut_sets += [sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, 4)))]
        for cuts in cut_sets:
            assert streamed(make, text, cuts)[0] == whole, (text, cuts)
