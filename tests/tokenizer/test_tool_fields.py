"""The tokenizer refuses ``ChatMessage.tool_calls`` and ``tool_call_id``: they are
``Router.Generate``'s, and the router writes tool turns into the text before tokenizing."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidRequestError
from services.common.pb.stageserve.v1 import common_pb2, tokenizer_pb2
from tests.tokenizer.conftest import TEST_LIMITS


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"role": "assistant", "tool_calls": [common_pb2.ToolCall(id="c1", name="f")]},
            "messages[1].tool_calls",
        ),
        ({"role": "tool", "tool_call_id": "c1"}, "messages[1].tool_call_id"),
    ],
)
def test_tool_fields_are_refused(fields, param) -> None:
    from services.tokenizer.servicer import job_from_proto

    request = tokenizer_pb2.TokenizeRequest()
    request.chat.messages.add(role="user").content.add(text="x")
    request.chat.messages.add(**fields).content.add(text="y")
    with pytest.raises(InvalidRequestError, match="writes tool turns") as info:
        job_from_proto(request, TEST_LIMITS)
    assert info.value.param == param
