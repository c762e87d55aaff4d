"""Tool calls over HTTP against the fake workers: streamed as OpenAI's ``delta.tool_calls``
(which reassemble to the whole response's calls, however decode chunks the tokens), in
both formats, and the qwen3_coder format's prompt."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from services.common.types import FinishReason, TokenLogprob
from services.router.config import FlowConfig
from services.router.openai_format import LogprobFormatter, ResponseFormatter
from services.router.tool_parser_json import HermesParser
from services.router.tool_stream import ToolCallStream
from services.router.types import GenerationDelta
from tests.router.conftest import MODEL_NAME
from tests.router.fakes import EOS_ID, TEXT, char_ids
from tests.router.http_helpers import stream_chat
from tests.router.served import Served, serve
from tests.router.tool_defs import WEATHER

CHAT_PATH = "/v1/chat/completions"
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
TOOLS = [WEATHER, TIME]
HERMES_OUTPUT = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
XML_OUTPUT = (
    "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=get_time>\n</function>\n</tool_call>"
)
CALLS = [("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {})]


@pytest.fixture
async def xml() -> AsyncIterator[Served]:
    """A router started with ``--tool-call-parser qwen3_coder``, over fake workers of its own."""
    async with serve(FlowConfig(), tool_call_parser="qwen3_coder") as served:
        yield served


def body(**fields) -> dict:
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    return {"model": MODEL_NAME, "messages": messages, "max_tokens": 400, "tools": TOOLS, **fields}


def reassembled(chunks: list[dict]) -> tuple[str, list[dict], str]:
    """A stream's content, calls and finish reason; each call's first entry carries its id,
    type and name, the later ones none."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        [choice] = chunk["choices"]
        content += choice["delta"].get("content") or ""
        for entry in choice["delta"].get("tool_calls", []):
            if entry["index"] not in calls:
                assert entry["type"] == "function" and entry["id"].startswith("call_"), entry
                calls[entry["index"]] = {"name": entry["function"]["name"], "arguments": ""}
            else:
                assert set(entry) == {"index", "function"}, entry
                assert set(entry["function"]) == {"arguments"}, entry
            calls[entry["index"]]["arguments"] += entry["function"]["arguments"]
        reason = choice["finish_reason"] or reason
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)], reason


async def whole(http: httpx.AsyncClient, **fields) -> tuple[str | None, list[dict], str]:
    response = await http.post(CHAT_PATH, json=body(**fields))
    assert response.status_code == 200, response.text
    [choice] = response.json()["choices"]
    calls = [c["function"] for c in choice["message"].get("tool_calls", [])]
    return choice["message"]["content"], calls, choice["finish_reason"]


@pytest.mark.parametrize("chunk_size", [1, 3, 1000])
@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder"])
async def test_streamed_calls_reassemble_to_the_whole_responses(
    http, cluster, xml, fmt, chunk_size
):
    client, script = (http, cluster.script) if fmt == "hermes" else (xml.http, xml.cluster.script)
    script.output_ids = [*char_ids(HERMES_OUTPUT if fmt == "hermes" else XML_OUTPUT)]
    script.output_ids.append(EOS_ID)
    script.chunk_size = chunk_size
    chunks = await stream_chat(client, **body())
    content, calls, reason = reassembled(chunks)
    assert "<" not in content and content == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == CALLS
    assert reason == "tool_calls" and chunks[-1]["choices"][0]["delta"] == {}
    if chunk_size == 1:  # the arguments came in pieces, after the call's name
        pieces = [c for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
        assert len(pieces) > 5
    assert await whole(client) == (content, calls, reason)


async def test_each_choice_streams_its_own_calls(http, cluster):
    cluster.script.output_ids = [*char_ids(HERMES_OUTPUT), EOS_ID]
    chunks = await stream_chat(http, **body(n=2))
    for index in (0, 1):
        mine = [c for c in chunks if c["choices"][0]["index"] == index]
        content, calls, reason = reassembled(mine)
        assert (content, reason) == ("Let me check.", "tool_calls")
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == CALLS


async def test_text_with_tools_streams_as_content(http, cluster):
    text = "  No call needed: 1 < 2 and <tool> is not a tag.\n"
    cluster.script.output_ids = [*char_ids(text), EOS_ID]
    cluster.script.chunk_size = 1
    chunks = await stream_chat(http, **body())
    assert reassembled(chunks) == (text, [], "stop")
    assert await whole(http) == (text, [], "stop")


async def test_a_call_cut_by_max_tokens_ends_with_length(http, cluster):
    cluster.script.output_ids = [*char_ids(HERMES_OUTPUT), EOS_ID]
    chunks = await stream_chat(http, **body(max_tokens=74))
    content, calls, reason = reassembled(chunks)
    assert (content, reason) == ("Let me check.", "length")
    assert calls == [{"name": "get_weather", "arguments": '{"city": "O'}]
    assert await whole(http, max_tokens=74) == (content, calls, reason)


@pytest.mark.parametrize(
    ("fields", "output", "calls"),
    [
        (
            {"tool_choice": "required"},
            '[{"name":"get_weather","arguments":{"city":"Oslo"}},{"name":"get_time","arguments":{}}]',
            [("get_weather", '{"city":"Oslo"}'), ("get_time", "{}")],
        ),
        (
            {"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            '{"name": "get_time", "arguments": {}}',
            [("get_time", "{}")],
        ),
    ],
)
async def test_required_and_named_calls_stream(http, cluster, fields, output, calls):
    cluster.script.output_ids = [*char_ids(output), EOS_ID]
    cluster.script.chunk_size = 1
    chunks = await stream_chat(http, **body(**fields))
    content, streamed, reason = reassembled(chunks)
    assert content == "" and reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed] == calls
    assert await whole(http, **fields) == (None, streamed, reason)


async def test_tool_choice_none_streams_the_tags_as_content(http, cluster):
    cluster.script.output_ids = [*char_ids(HERMES_OUTPUT), EOS_ID]
    chunks = await stream_chat(http, **body(tool_choice="none"))
    assert reassembled(chunks) == (HERMES_OUTPUT, [], "stop")


async def test_streamed_calls_end_with_the_usage(http, cluster):
    cluster.script.output_ids = [*char_ids(HERMES_OUTPUT), EOS_ID]
    chunks = await stream_chat(http, **body(stream_options={"include_usage": True}))
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == len(cluster.script.output_ids)
    assert all(c["usage"] is None for c in chunks[:-1])
    assert reassembled(chunks[:-1])[2] == "tool_calls"


def test_a_held_back_delta_still_sends_its_logprobs():
    formatter = ResponseFormatter(
        "chatcmpl-1", MODEL_NAME, 0, is_chat=True, logprobs=LogprobFormatter(TEXT.token_bytes)
    )
    stream = ToolCallStream(HermesParser(["get_time"]), formatter, include_usage=False)
    ids = char_ids("<tool")
    held = stream.chunk(GenerationDelta("<tool", tuple(ids), logprobs=logprobs_of(ids)))
    assert held["choices"][0]["delta"] == {}
    assert [e["token"] for e in held["choices"][0]["logprobs"]["content"]] == list("<tool")
    assert stream.chunk(GenerationDelta("_call>")) is None
    text = '{"name": "get_time", "arguments": {}}</tool_call>'
    last = stream.chunk(GenerationDelta(text, finish_reason=FinishReason.STOP))
    [entry] = last["choices"][0]["delta"]["tool_calls"]
    assert entry["function"] == {"name": "get_time", "arguments": "{}"}
    end = stream.last_chunk(FinishReason.STOP)
    assert end["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "tool_calls",
    }


def logprobs_of(ids: list[int]) -> tuple[TokenLogprob, ...]:
    return tuple(TokenLogprob(i, -0.5, (i,), (-0.5,)) for i in ids)


async def test_the_openai_client_accumulates_the_streamed_calls(http, cluster):
    cluster.script.output_ids = [*char_ids(HERMES_OUTPUT), EOS_ID]
    cluster.script.chunk_size = 1
    state = ChatCompletionStreamState()
    for chunk in await stream_chat(http, **body()):
        state.handle_chunk(openai.types.chat.ChatCompletionChunk.model_validate(chunk))
    [choice] = state.get_final_completion().choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check."
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == CALLS


async def test_qwen3_coder_prompt_lists_the_tools_and_writes_history_calls(xml):
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'},
    }
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [call]},
        {"role": "tool", "content": "rain", "tool_call_id": "c1"},
    ]
    response = await xml.http.post(CHAT_PATH, json=body(messages=messages))
    assert response.status_code == 200, response.text
    chat = xml.cluster.tokenizer.servicer.requests[-1].chat.messages
    assert chat[0].role == "system"
    system = "".join(p.text for p in chat[0].content)
    assert system.startswith("# Tools\n\nYou have access to the following functions:")
    assert "<function=example_function_name>" in system
    assistant = "".join(p.text for p in chat[2].content)
    assert assistant == (
        "Checking.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n"
        "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
    )
    assert chat[3].role == "user"
    assert "".join(p.text for p in chat[3].content) == "<tool_response>\nrain\n</tool_response>"
