"""The ``common.proto`` conversions of ``services.common.wire``: each value survives the round
trip, and the proto bytes are the ones the servicers and clients sent before they shared them."""

from __future__ import annotations

import pytest

from services.common.pb.stageserve.v1 import common_pb2
from services.common.types import FinishReason, ImageSpanRef, SamplingParams, Usage
from services.common.wire import (
    finish_reason_from_proto,
    finish_reason_to_proto,
    image_span_from_proto,
    image_span_to_proto,
    sampling_params_from_proto,
    sampling_params_to_proto,
    usage_from_proto,
    usage_to_proto,
)


@pytest.mark.parametrize(
    ("reason", "code"),
    [
        (None, common_pb2.FINISH_REASON_UNSPECIFIED),
        (FinishReason.STOP, common_pb2.FINISH_REASON_STOP),
        (FinishReason.LENGTH, common_pb2.FINISH_REASON_LENGTH),
    ],
)
def test_finish_reason_round_trip(reason: FinishReason | None, code: int) -> None:
    assert finish_reason_to_proto(reason) == code
    assert finish_reason_from_proto(code) is reason


def test_an_unknown_finish_reason_code_reads_as_none() -> None:
    assert finish_reason_from_proto(max(common_pb2.FinishReason.values()) + 1) is None


def test_every_finish_reason_has_a_code() -> None:
    codes = {finish_reason_to_proto(reason) for reason in FinishReason}
    assert len(codes) == len(FinishReason)
    assert common_pb2.FINISH_REASON_UNSPECIFIED not in codes


def test_image_span_round_trip() -> None:
    span = ImageSpanRef(offset=7, length=64, content_hash="ab" * 32, grid_thw=(1, 16, 16))
    message = image_span_to_proto(span)
    assert (message.grid_t, message.grid_h, message.grid_w) == (1, 16, 16)
    assert image_span_from_proto(message) == span


@pytest.mark.parametrize(
    "field",
    ["num_cached_image_tokens", "num_prefix_cached_tokens", "num_prefix_cached_image_tokens"],
)
def test_usage_round_trip_keeps_each_cached_count(field: str) -> None:
    usage = Usage(90, 12, **{field: 48})
    message = usage_to_proto(usage)
    assert getattr(message, field) == 48
    assert usage_from_proto(message) == usage


def test_usage_without_cached_image_tokens_has_the_old_wire_bytes() -> None:
    old = common_pb2.Usage(num_prompt_tokens=5, num_completion_tokens=3)
    assert usage_to_proto(Usage(5, 3)).SerializeToString() == old.SerializeToString()


@pytest.mark.parametrize("num_prompt_logprobs", [-1, 0, 20])
def test_num_prompt_logprobs_round_trip(num_prompt_logprobs: int) -> None:
    params = SamplingParams(num_prompt_logprobs=num_prompt_logprobs)
    message = sampling_params_to_proto(params)
    assert message.HasField("num_prompt_logprobs") == (num_prompt_logprobs >= 0)
    assert sampling_params_from_proto(message) == params
