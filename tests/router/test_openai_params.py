"""Every OpenAI field is honoured or refused with a 400 naming it; nothing is ignored.

Fake workers: these tests check what the client gets and that a refused request reaches no
worker. The fields' effects: ``test_openai_sampling.py`` (logit_bias, min_tokens,
stop_token_ids) and ``test_openai_logprobs.py`` (logprobs, echo).
"""

from __future__ import annotations

import pytest

from tests.router.http_helpers import (
    CHAT,
    CHAT_PATH,
    COMPLETION,
    COMPLETIONS_PATH,
    assert_400,
    body_for,
)

# (path, field, a value that asks for what is not built); each must be a 400 naming the field.
REFUSED = [
    (CHAT_PATH, "response_format", {"type": "regex", "regex": "a+"}),
    (COMPLETIONS_PATH, "response_format", {"type": "json_object", "extra": 1}),
    (CHAT_PATH, "functions", [{"name": "f"}]),
    (CHAT_PATH, "function_call", "auto"),
    (CHAT_PATH, "audio", {"voice": "alloy", "format": "wav"}),
    (CHAT_PATH, "modalities", ["text", "audio"]),
    (CHAT_PATH, "prediction", {"type": "content", "content": "x"}),
    (CHAT_PATH, "reasoning_effort", "low"),
    (CHAT_PATH, "verbosity", "low"),
    (CHAT_PATH, "web_search_options", {}),
    (CHAT_PATH, "store", True),
    (CHAT_PATH, "metadata", {"k": "v"}),
    (CHAT_PATH, "prompt_cache_key", "k"),
    (CHAT_PATH, "service_tier", "flex"),
    (COMPLETIONS_PATH, "best_of", 2),
    (COMPLETIONS_PATH, "suffix", " the end"),
    (COMPLETIONS_PATH, "service_tier", "priority"),
]

# Values that ask for exactly what the server does: accepted.
HONOURED = [
    (
        CHAT_PATH,
        {
            "n": 1,
            "logprobs": False,
            "response_format": {"type": "text"},
            "tool_choice": "none",
            "store": False,
            "modalities": ["text"],
            "service_tier": "auto",
            "user": "u-1",
            "safety_identifier": "s-1",
            "top_logprobs": None,
            "tools": None,
        },
    ),
    (CHAT_PATH, {"logprobs": True, "top_logprobs": 20}),
    (CHAT_PATH, {"logprobs": True}),
    (COMPLETIONS_PATH, {"logprobs": 0}),
    (COMPLETIONS_PATH, {"logprobs": 20, "stream": True}),
    (
        COMPLETIONS_PATH,
        {
            "n": 1,
            "best_of": 1,
            "suffix": "",
            "logprobs": None,
            "echo": False,
            "service_tier": "default",
            "user": "u-2",
        },
    ),
    # vLLM's and SGLang's benchmark clients send these.
    (
        COMPLETIONS_PATH,
        {
            "repetition_penalty": 1.0,
            "logprobs": None,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "best_of": 1,
            "temperature": 0.0,
        },
    ),
]


@pytest.mark.parametrize(("path", "field", "value"), REFUSED)
async def test_what_is_not_built_is_a_400_naming_the_field(http, cluster, path, field, value):
    message = await assert_400(http, path, body_for(path, **{field: value}), field)
    assert message.startswith(f"{field}: ") and "support" in message
    assert not cluster.decode.reserved and not cluster.tokenizer.servicer.requests


@pytest.mark.parametrize(("path", "fields"), HONOURED)
async def test_values_that_ask_for_what_the_server_does_are_accepted(http, cluster, path, fields):
    response = await http.post(path, json=body_for(path, max_tokens=4, **fields))
    assert response.status_code == 200, response.text


UNKNOWN = [
    ({**CHAT, "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ({**CHAT, "chat_template": "{{ messages }}"}, "chat_template"),  # vLLM's; not built
    ({**CHAT, "echo": True}, "echo"),  # completions only
    (
        {
            **CHAT,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
        "stream_options.continuous_usage_stats",
    ),
    (
        {**CHAT, "messages": [{"role": "assistant", "content": "hi", "function_call": {}}]},
        "messages[0].function_call",
    ),
    (
        {
            **CHAT,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a", "cache": 1}]}],
        },
        "messages[0].content[0].cache",
    ),
    (
        {
            **CHAT,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image_url",
                            "image_url": {"url": "data:image/png;base64,AA", "size": 1},
                        }
                    ],
                }
            ],
        },
        "messages[0].content[0].image_url.size",
    ),
]


@pytest.mark.parametrize(("body", "param"), UNKNOWN)
async def test_unknown_fields_are_refused_not_ignored(http, cluster, body, param):
    message = await assert_400(http, CHAT_PATH, body, param)
    assert "unknown fields are refused" in message
    assert not cluster.tokenizer.servicer.requests


async def test_unknown_completion_field_is_refused(http):
    await assert_400(
        http, COMPLETIONS_PATH, {**COMPLETION, "use_beam_search": True}, "use_beam_search"
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {**CHAT, "messages": [{"role": "user", "content": "hi", "name": "bob"}]},
            "messages[0].name",
        ),
        (
            {
                **CHAT,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image_url",
                                "image_url": {"url": "data:image/png;base64,AA", "detail": "low"},
                            }
                        ],
                    }
                ],
            },
            "messages[0].content[0].image_url.detail",
        ),
        (
            {
                **CHAT,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "a", "image_url": "data:image/png;base64,AA"}
                        ],
                    }
                ],
            },
            "messages[0].content[0].image_url",
        ),
        (
            {
                **CHAT,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image_url",
                                "image_url": "data:image/png;base64,AA",
                                "text": "a",
                            }
                        ],
                    }
                ],
            },
            "messages[0].content[0].text",
        ),
        ({**CHAT, "max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
    ],
)
async def test_message_fields_with_no_effect_here_are_refused(http, cluster, body, param):
    await assert_400(http, CHAT_PATH, body, param)


@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETIONS_PATH])
@pytest.mark.parametrize("stream", [False, None])
async def test_stream_options_without_stream_is_a_400(http, path, stream):
    body = body_for(path, stream_options={"include_usage": True})
    if stream is not None:
        body["stream"] = stream
    message = await assert_400(http, path, body, "stream_options")
    assert "stream is true" in message
    ok = await http.post(path, json=body_for(path, stream_options=None, max_tokens=2))
    assert ok.status_code == 200, ok.text


async def test_openapi_documents_the_new_fields(http):
    components = (await http.get("/openapi.json")).json()["components"]["schemas"]
    chat, completion = components["ChatCompletionBody"], components["CompletionBody"]
    for name in ("logit_bias", "min_tokens", "stop_token_ids", "response_format", "tools"):
        assert name in chat["properties"], name
    for name in ("echo", "suffix", "best_of", "logit_bias"):
        assert name in completion["properties"], name
    assert chat["additionalProperties"] is False and completion["additionalProperties"] is False
