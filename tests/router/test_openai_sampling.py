"""logit_bias, min_tokens and stop_token_ids: what reaches prefill and decode (the sampling
parameters on the wire, fake workers) and the 400s naming the field. What the real sampler
does with them is checked on the tiny model in ``tests/e2e/openai_api/test_parameters.py``.
"""

from __future__ import annotations

import json

import pytest

from services.common.types import MAX_LOGIT_BIAS
from tests.router.http_helpers import CHAT, CHAT_PATH, COMPLETIONS_PATH, assert_400, body_for


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
