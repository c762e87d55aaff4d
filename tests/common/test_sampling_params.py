"""SamplingParams (ranges, vocabulary, msgpack) and the one stop rule, ``finish_reason``."""

from __future__ import annotations

import math

import msgspec
import pytest

from services.common.errors import InvalidRequestError
from services.common.types import FinishReason, SamplingParams, finish_reason

EOS_IDS = (2, 0)  # the tiny model's: config.json's, then generation_config.json's
MAX_MODEL_LEN = 100
STOP, LENGTH = FinishReason.STOP, FinishReason.LENGTH


@pytest.mark.parametrize(
    ("fields", "token_id", "num_prompt_tokens", "num_output_tokens", "reason"),
    [
        ({}, 7, 10, 1, None),
        ({}, 2, 10, 1, STOP),  # an EOS id
        ({}, 0, 10, 5, STOP),  # every EOS id, not just the first
        ({"ignore_eos": True}, 2, 10, 5, None),
        ({"stop_token_ids": (9,)}, 9, 10, 2, STOP),
        ({"stop_token_ids": (9,), "ignore_eos": True}, 9, 10, 2, STOP),  # not an EOS
        ({"stop_token_ids": (9,)}, 8, 10, 2, None),
        ({"max_new_tokens": 3}, 7, 10, 2, None),
        ({"max_new_tokens": 3}, 7, 10, 3, LENGTH),
        ({"max_new_tokens": 1}, 7, 10, 1, LENGTH),  # the first token can end it
        ({}, 7, 97, 2, None),
        ({}, 7, 98, 2, LENGTH),  # prompt + output fill the context
        ({}, 7, 99, 1, LENGTH),
        # STOP wins over LENGTH
        ({"max_new_tokens": 3}, 2, 10, 3, STOP),
        ({"stop_token_ids": (9,)}, 9, 98, 2, STOP),
        ({"max_new_tokens": 3, "ignore_eos": True}, 2, 10, 3, LENGTH),
        # min_tokens: the first min_tokens tokens never stop (the sampler masks them)
        ({"min_tokens": 3}, 2, 10, 3, None),
        ({"min_tokens": 3}, 2, 10, 4, STOP),
        ({"min_tokens": 1, "stop_token_ids": (9,)}, 9, 10, 1, None),
        ({"min_tokens": 1, "stop_token_ids": (9,)}, 9, 10, 2, STOP),
        # ... but never hold back LENGTH
        ({"min_tokens": 3, "max_new_tokens": 3}, 2, 10, 3, LENGTH),
        ({"min_tokens": 5, "max_new_tokens": 50}, 7, 98, 2, LENGTH),
    ],
)
def test_finish_reason(fields, token_id, num_prompt_tokens, num_output_tokens, reason) -> None:
    params = SamplingParams(**fields)
    got = finish_reason(
        params, token_id, num_prompt_tokens, num_output_tokens, EOS_IDS, MAX_MODEL_LEN
    )
    assert got is reason


def test_finish_reason_without_eos_ids_stops_only_on_stop_tokens() -> None:
    params = SamplingParams(stop_token_ids=(9,))
    assert finish_reason(params, 2, 10, 1, (), MAX_MODEL_LEN) is None
    assert finish_reason(params, 9, 10, 1, (), MAX_MODEL_LEN) is STOP


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": -2.1}, "presence_penalty"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"seed": -1}, "seed"),
        ({"stop_token_ids": (3, -4)}, "stop_token_ids"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": math.nan}, "top_p"),
        ({"min_p": math.inf}, "min_p"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"repetition_penalty": math.nan}, "repetition_penalty"),
        ({"frequency_penalty": -math.inf}, "frequency_penalty"),
        ({"presence_penalty": math.nan}, "presence_penalty"),
        ({"top_k": 2**31}, "top_k"),
        ({"top_k": 2**40}, "top_k"),
        ({"max_new_tokens": 2**32}, "max_new_tokens"),
        ({"seed": 2**64}, "seed"),
        ({"stop_token_ids": (2**32,)}, "stop_token_ids"),
        ({"num_prompt_logprobs": -2}, "num_prompt_logprobs"),
        ({"num_prompt_logprobs": 21}, "num_prompt_logprobs"),
    ],
)
def test_validate_rejects(kwargs: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequestError, match=param) as info:
        SamplingParams(**kwargs).validate()  # type: ignore[arg-type]
    assert info.value.param == param


def test_validate_accepts_edges() -> None:
    SamplingParams().validate()
    SamplingParams(
        temperature=0.0,
        top_p=1.0,
        top_k=0,
        min_p=1.0,
        frequency_penalty=-2.0,
        presence_penalty=2.0,
        seed=0,
    ).validate()
    SamplingParams(
        temperature=2.0,
        top_p=1e-9,
        top_k=2**31 - 1,
        min_p=0.0,
        repetition_penalty=0.01,
        frequency_penalty=2.0,
        presence_penalty=-2.0,
        seed=2**64 - 1,
        max_new_tokens=2**32 - 1,
        stop_token_ids=(0, 2**32 - 1),
    ).validate()
    SamplingParams(repetition_penalty=2.0).validate()


def test_msgpack_round_trip() -> None:
    params = SamplingParams(
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        repetition_penalty=1.1,
        frequency_penalty=0.3,
        presence_penalty=-0.2,
        seed=42,
        max_new_tokens=128,
        stop_token_ids=(2, 151645),
        ignore_eos=True,
    )
    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams)
    assert decoded == params
    assert decoded.stop_token_ids == (2, 151645)
    with pytest.raises(AttributeError):
        params.temperature = 1.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": ((3, 100.5),)}, "logit_bias"),
        ({"logit_bias": ((3, float("nan")),)}, "logit_bias"),
        ({"logit_bias": ((3, 1.0), (3, 2.0))}, "logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"min_tokens": 17, "max_new_tokens": 16}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
    ],
)
def test_bad_bias_and_min_tokens_are_refused(fields, param) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**fields).validate()
    assert info.value.param == param


def test_token_ids_outside_the_vocabulary_are_refused() -> None:
    SamplingParams(logit_bias=((9, 1.0),), stop_token_ids=(9,)).check_vocab(10)
    for fields, param in (
        ({"logit_bias": ((10, 1.0),)}, "logit_bias"),
        ({"stop_token_ids": (10,)}, "stop_token_ids"),
    ):
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**fields).check_vocab(10)
        assert info.value.param == param
