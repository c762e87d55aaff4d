"""Logprobs and echo over fake workers: what reaches prefill and decode, what the client gets
and the 400s naming the field.
"""

from __future__ import annotations

import json

import pytest

from services.common.wire import sampling_params_from_proto
from tests.router.fakes import TEXT
from tests.router.http_helpers import (
    CHAT_PATH,
    COMPLETION,
    COMPLETIONS_PATH,
    EXPECTED,
    assert_400,
    body_for,
    sse_events,
)


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
