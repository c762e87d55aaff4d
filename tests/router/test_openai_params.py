"""Every OpenAI field is honoured or refused with a 400 naming it; nothing is ignored.

Fake workers: these tests check what reaches prefill and decode (the sampling parameters
on the wire) and what the client gets. What the real sampler does with logit_bias and
min_tokens is checked on the tiny model in ``test_parameters_e2e.py``.
"""

from __future__ import annotations

import json

import pytest

from services.common.types import MAX_LOGIT_BIAS
from services.common.wire import sampling_params_from_proto
from tests.router.conftest import MODEL_NAME
from tests.router.fakes import TEXT
from tests.router.http_helpers import CHAT, EXPECTED, sse_events

COMPLETION = {"model": MODEL_NAME, "prompt": "Once upon"}
CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"

# (path, field, a value that asks for what is not built); each must be a 400 naming the field.
REFUSED = [
    (CHAT_PATH, "n", 2),
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
    (COMPLETIONS_PATH, "n", 3),
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


def body_for(path: str, **fields) -> dict:
    return {**(CHAT if path == CHAT_PATH else COMPLETION), **fields}


async def assert_400(http, path: str, body: dict, param: str) -> str:
    response = await http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    return error["message"]


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
    ({**CHAT, "guided_json": {}}, "guided_json"),
    ({**CHAT, "chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
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


async def test_logit_bias_min_tokens_and_stop_token_ids_reach_prefill_and_decode(http, cluster):
    body = {
        **CHAT,
        "max_tokens": 9,
        "logit_bias": {"7": 100, "0012": -100, "2047": 0.5},
        "min_tokens": 3,
        "stop_token_ids": [11, 12],
    }
    response = await http.post(CHAT_PATH, json=body)
    assert response.status_code == 200, response.text
    params = next(iter(cluster.decode.reserved.values())).sampling_params
    assert [(b.token_id, b.bias) for b in params.logit_bias] == [
        (7, 100.0),
        (12, -100.0),
        (2047, 0.5),
    ]
    assert params.min_tokens == 3 and list(params.stop_token_ids) == [11, 12]
    assert cluster.prefill.requests[0].sampling_params == params


BAD_LOGIT_BIAS = [
    ({"abc": 1}, "abc"),
    ({"-1": 1}, "-1"),
    ({" 1": 1}, " 1"),
    ({"1.5": 1}, "1.5"),
    ({"": 1}, "''"),
    ({"1_0": 1}, "1_0"),
    ({"\u0661": 1}, "decimal"),
    ({"7": 101}, "[-100, 100]"),
    ({"7": -100.5}, "[-100, 100]"),
    ({"7": 1, "07": 2}, "twice"),
    ({str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}, "at most"),
    ({"99999999999": 1}, "decimal"),
]


@pytest.mark.parametrize(("bias", "said"), BAD_LOGIT_BIAS)
async def test_malformed_logit_bias_is_a_400(http, cluster, bias, said):
    for path in (CHAT_PATH, COMPLETIONS_PATH):
        message = await assert_400(http, path, body_for(path, logit_bias=bias), "logit_bias")
        assert said in message, message
    assert not cluster.tokenizer.servicer.requests


@pytest.mark.parametrize(
    "raw",
    [b'{"7": NaN}', b'{"7": Infinity}', b'{"7": "1"}', b'{"7": true}', b"[[7, 1]]", b'{"7": null}'],
)
async def test_logit_bias_values_must_be_finite_numbers(http, raw):
    body = json.dumps(CHAT)[:-1].encode() + b', "logit_bias": ' + raw + b"}"
    response = await http.post(
        CHAT_PATH, content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "logit_bias"


@pytest.mark.parametrize(
    ("fields", "param", "said"),
    [
        ({"min_tokens": 6, "max_tokens": 5}, "min_tokens", "must not exceed max_tokens (5)"),
        (
            {"min_tokens": 6, "max_completion_tokens": 5},
            "min_tokens",
            "must not exceed max_completion_tokens",
        ),
        ({"min_tokens": -1}, "min_tokens", "min_tokens"),
        ({"min_tokens": 5000}, "min_tokens", "max_new_tokens"),  # more than the context leaves
        ({"min_tokens": 1.5}, "min_tokens", "integer"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "stop_token_ids"),
        ({"stop_token_ids": [2**32]}, "stop_token_ids", "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids", "list"),
    ],
)
async def test_bad_min_tokens_and_stop_token_ids(http, cluster, fields, param, said):
    message = await assert_400(http, CHAT_PATH, {**CHAT, **fields}, param)
    assert said in message, message
    assert not cluster.decode.reserved


async def test_echo_puts_the_prompt_before_the_output(http, cluster):
    body = {**COMPLETION, "max_tokens": 5, "echo": True}
    reply = (await http.post(COMPLETIONS_PATH, json=body)).json()
    assert reply["choices"][0]["text"] == "Once upon" + EXPECTED[:5]
    assert reply["usage"]["completion_tokens"] == 5
    assert reply["usage"]["prompt_tokens"] == len(TEXT.encode("Once upon"))

    listed = (await http.post(COMPLETIONS_PATH, json={**body, "prompt": ["Once upon"]})).json()
    assert listed["choices"][0]["text"] == "Once upon" + EXPECTED[:5]

    response = await http.post(
        COMPLETIONS_PATH, json={**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    chunks = [json.loads(e) for e in sse_events(response.text)[:-1]]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert texts[0] == "Once upon" and "".join(texts) == "Once upon" + EXPECTED[:5]
    assert chunks[-1]["usage"]["completion_tokens"] == 5

    plain = (await http.post(COMPLETIONS_PATH, json={**body, "echo": False})).json()
    assert plain["choices"][0]["text"] == EXPECTED[:5]


async def test_openapi_documents_the_new_fields(http):
    components = (await http.get("/openapi.json")).json()["components"]["schemas"]
    chat, completion = components["ChatCompletionBody"], components["CompletionBody"]
    for name in ("logit_bias", "min_tokens", "stop_token_ids", "response_format", "tools"):
        assert name in chat["properties"], name
    for name in ("echo", "suffix", "best_of", "logit_bias"):
        assert name in completion["properties"], name
    assert chat["additionalProperties"] is False and completion["additionalProperties"] is False


@pytest.mark.parametrize(
    ("path", "fields", "wanted"),
    [
        (CHAT_PATH, {"logprobs": True, "top_logprobs": 4}, (True, 4)),
        (CHAT_PATH, {"logprobs": True}, (True, 0)),
        (CHAT_PATH, {"logprobs": False}, (False, 0)),
        (COMPLETIONS_PATH, {"logprobs": 3}, (True, 3)),
        (COMPLETIONS_PATH, {"logprobs": 0}, (True, 0)),
        (COMPLETIONS_PATH, {}, (False, 0)),
    ],
)
async def test_logprobs_reach_prefill_and_decode(http, cluster, path, fields, wanted):
    response = await http.post(path, json=body_for(path, max_tokens=3, **fields))
    assert response.status_code == 200, response.text
    params = next(iter(cluster.decode.reserved.values())).sampling_params
    assert (params.return_logprobs, params.num_top_logprobs) == wanted
    assert cluster.prefill.requests[0].sampling_params == params


@pytest.mark.parametrize(
    ("fields", "wanted"),
    [
        ({"logprobs": 3}, -1),
        ({"echo": True}, -1),
        ({"echo": True, "logprobs": 3}, 3),
        ({"echo": True, "logprobs": 0}, 0),
        ({"prompt_logprobs": 0}, 0),
        ({"echo": True, "logprobs": 2, "prompt_logprobs": 5}, 5),
        ({"echo": True, "logprobs": 4, "prompt_logprobs": 1}, 4),
    ],
)
async def test_prompt_logprobs_reach_prefill(http, cluster, fields, wanted):
    response = await http.post(COMPLETIONS_PATH, json={**COMPLETION, "max_tokens": 3, **fields})
    assert response.status_code == 200, response.text
    sent = sampling_params_from_proto(cluster.prefill.requests[0].sampling_params)
    assert sent.num_prompt_logprobs == wanted


@pytest.mark.parametrize(
    ("path", "fields", "param", "said"),
    [
        (CHAT_PATH, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
        (CHAT_PATH, {"logprobs": True, "top_logprobs": -1}, "top_logprobs", "[0, 20]"),
        (CHAT_PATH, {"top_logprobs": 2}, "top_logprobs", "needs logprobs: true"),
        (CHAT_PATH, {"logprobs": False, "top_logprobs": 0}, "top_logprobs", "needs logprobs"),
        (CHAT_PATH, {"logprobs": 1}, "logprobs", "boolean"),
        (COMPLETIONS_PATH, {"logprobs": 21}, "logprobs", "[0, 20]"),
        (COMPLETIONS_PATH, {"logprobs": -1}, "logprobs", "[0, 20]"),
        (COMPLETIONS_PATH, {"logprobs": True}, "logprobs", "integer"),
        (COMPLETIONS_PATH, {"prompt_logprobs": 21}, "prompt_logprobs", "[0, 20]"),
        (COMPLETIONS_PATH, {"prompt_logprobs": -1}, "prompt_logprobs", "[0, 20]"),
        (COMPLETIONS_PATH, {"prompt_logprobs": 1.5}, "prompt_logprobs", "integer"),
        (COMPLETIONS_PATH, {"prompt_logprobs": 0, "stream": True}, "prompt_logprobs", "stream"),
        (COMPLETIONS_PATH, {"echo": True, "logprobs": 21}, "logprobs", "[0, 20]"),
        (CHAT_PATH, {"prompt_logprobs": 1}, "prompt_logprobs", "unknown fields"),
        (CHAT_PATH, {"echo": True}, "echo", "unknown fields"),
    ],
)
async def test_bad_logprobs_are_a_400_naming_the_field(http, cluster, path, fields, param, said):
    message = await assert_400(http, path, body_for(path, **fields), param)
    assert said in message, message
    assert not cluster.decode.reserved and not cluster.tokenizer.servicer.requests
