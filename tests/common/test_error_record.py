"""``ErrorRecord``: an error crosses a process as data and becomes its own class again."""

from __future__ import annotations

import msgspec
import pytest

from services.common.errors import (
    ErrorRecord,
    InvalidRequestError,
    NotFoundError,
    StageServeError,
    UnavailableError,
)
from services.common.ranks.errors import StepFailedError
from services.common.ranks.outcome import agreed_error
from services.common.wire import stream_error_from_proto, stream_error_to_proto


def test_an_error_comes_back_as_its_class_with_message_and_param() -> None:
    record = ErrorRecord.of(InvalidRequestError("top_k is negative", param="top_k"))
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(record), type=ErrorRecord)
    error = wire.to_error()
    assert type(error) is InvalidRequestError
    assert (error.message, error.param) == ("top_k is negative", "top_k")


@pytest.mark.parametrize("error_type", ["", "NoSuchError", "ValueError"])
def test_a_class_this_process_lacks_becomes_the_fallback(error_type: str) -> None:
    error = ErrorRecord(error_type, "went wrong", "p").to_error(UnavailableError)
    assert type(error) is UnavailableError
    assert (error.message, error.param) == ("went wrong", "p")


def test_a_class_under_another_status_code_becomes_the_fallback() -> None:
    record = ErrorRecord("NotFoundError", "gone")
    assert record.error_class("NOT_FOUND") is NotFoundError
    assert record.error_class("INTERNAL") is None
    assert type(record.to_error(grpc_code="INTERNAL")) is StageServeError


def test_a_failed_steps_agreed_error_is_the_ranks_class_else_step_failed() -> None:
    assert type(agreed_error("InvalidRequestError", "rank 1: bad")) is InvalidRequestError
    assert type(agreed_error("", "rank 1: bad")) is StepFailedError


def test_a_stream_error_keeps_its_class_across_the_proto() -> None:
    error = stream_error_from_proto(stream_error_to_proto(NotFoundError("no r1", param="id")))
    assert type(error) is NotFoundError
    assert (error.message, error.param) == ("no r1", "id")
    unknown = stream_error_to_proto(UnavailableError("decode rank 2 died"))
    unknown.error_type = "FutureError"
    assert type(stream_error_from_proto(unknown)) is UnavailableError
