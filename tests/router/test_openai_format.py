"""Stream chunks from the per-response template: byte for byte what the dict path writes."""

from __future__ import annotations

import json

import pytest

from services.common.types import FinishReason, TokenLogprob
from services.router.openai_format import (
    LogprobFormatter,
    PromptLogprobs,
    ResponseFormatter,
    sse,
)

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


def _token_bytes(token_id: int) -> bytes:
    return f"<{token_id}>".encode()


PROMPT = PromptLogprobs(
    (7, 8, 9),
    (
        TokenLogprob(8, -0.5, (8, 3), (-0.5, -1.5)),
        TokenLogprob(9, float("-inf"), (4, 5), (-0.1, -2.0)),
    ),
)


def test_echo_logprobs_come_first_and_the_first_prompt_token_has_none():
    formatter = ResponseFormatter(
        "cmpl-1",
        "m",
        0,
        is_chat=False,
        logprobs=LogprobFormatter(_token_bytes),
        echo_top=1,
        token_bytes=_token_bytes,
    )
    generated = [TokenLogprob(6, -0.25, (6,), (-0.25,))]
    choice = formatter.choice("x", FinishReason.LENGTH, generated, prompt=PROMPT)
    assert choice["logprobs"] == {
        "tokens": ["<7>", "<8>", "<9>", "<6>"],
        "token_logprobs": [None, -0.5, -9999.0, -0.25],
        "top_logprobs": [None, {"<8>": -0.5}, {"<4>": -0.1}, {"<6>": -0.25}],
        "text_offset": [0, 3, 6, 9],
    }
    assert "prompt_logprobs" not in choice


def test_vllm_prompt_logprobs_hold_the_token_and_the_top_ones():
    formatter = ResponseFormatter(
        "cmpl-1", "m", 0, is_chat=False, prompt_top=1, token_bytes=_token_bytes
    )
    choice = formatter.choice("x", FinishReason.LENGTH, prompt=PROMPT)
    assert choice["logprobs"] is None
    assert choice["prompt_logprobs"] == [
        None,
        {"8": {"logprob": -0.5, "decoded_token": "<8>"}},
        {
            "4": {"logprob": -0.1, "decoded_token": "<4>"},
            "9": {"logprob": -9999.0, "decoded_token": "<9>"},
        },
    ]
