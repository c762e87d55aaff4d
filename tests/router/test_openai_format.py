"""Stream chunks from the per-response template: byte for byte what the dict path writes."""

from __future__ import annotations

import json

import pytest

from services.router.openai_format import ResponseFormatter, sse

TEXTS = [
    "hello",
    "",
    ' "quoted" \\ back',
    "naïve 你好 🙂",
    "line\u2028sep\u0085",
    "\ud800 lone",
    "\x00 nul",
    "\n\t",
]


@pytest.mark.parametrize("is_chat", [True, False])
@pytest.mark.parametrize("with_usage_field", [True, False])
@pytest.mark.parametrize("response_id", ["chatcmpl-1", "\x00", 'x"\x00"y'])
def test_text_events_equal_the_dict_path(is_chat, with_usage_field, response_id):
    formatter = ResponseFormatter(response_id, "tiny-\x00model", 1_700_000_000, is_chat=is_chat)
    for text in TEXTS:
        event = formatter.text_event(text, with_usage_field)
        assert event == sse(formatter.chunk(text, with_usage_field=with_usage_field))
        body = json.loads(event.removeprefix("data: "))
        assert (
            body["choices"][0]["delta"]["content"] if is_chat else body["choices"][0]["text"]
        ) == text
        assert body["id"] == response_id
