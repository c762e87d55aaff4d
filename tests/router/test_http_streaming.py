"""The OpenAI HTTP API's streams (SSE), stop strings and line-breaking text, over fake workers."""

from __future__ import annotations

import json

import pytest

from tests.router.conftest import (
    MODEL_NAME,
    wait_until,
)
from tests.router.fakes import EOS_ID, TEXT, char_ids
from tests.router.http_helpers import (
    CHAT,
    EXPECTED,
    prompt_len,
    stream_chat,
)


async def test_stream_chat(http, cluster):
    chunks = await stream_chat(http, max_tokens=100)
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == MODEL_NAME for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == EXPECTED
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert all("usage" not in c for c in chunks)


async def test_stream_chat_with_usage(http, cluster):
    chunks = await stream_chat(http, max_tokens=6, stream_options={"include_usage": True})
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 6
    assert chunks[-1]["usage"]["prompt_tokens"] == prompt_len(cluster)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert (
        "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        == EXPECTED[:6]
    )


@pytest.mark.parametrize("chunk_size", [1, 3, 100])
@pytest.mark.parametrize("stream", [False, True])
async def test_stop_strings(http, cluster, chunk_size, stream):
    cluster.script.chunk_size = chunk_size
    body = {**CHAT, "stop": ["zzz", "ere, wo"], "max_tokens": 100}
    if stream:
        chunks = await stream_chat(http, **body)
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    else:
        reply = (await http.post("/v1/chat/completions", json=body)).json()
        text = reply["choices"][0]["message"]["content"]
        assert reply["choices"][0]["finish_reason"] == "stop"
        assert reply["usage"]["completion_tokens"] == len("Hello there, wo")
    assert text == "Hello th"
    if chunk_size < 100:  # decode was still generating: the router stops it
        await wait_until(lambda: cluster.aborted() == list(cluster.decode.reserved))
        assert cluster.is_kv_written() == dict.fromkeys(cluster.decode.reserved, True)
    else:  # the stop string came in decode's last message: nothing to abort
        assert not cluster.aborted()


async def test_stop_string_partial_match_is_released_at_the_end(http, cluster):
    cluster.script.output_ids = [*char_ids("abc STO"), EOS_ID]
    reply = (await http.post("/v1/chat/completions", json={**CHAT, "stop": "STOP"})).json()
    assert reply["choices"][0]["message"]["content"] == "abc STO"
    assert reply["choices"][0]["finish_reason"] == "stop"


LINE_BREAKING_TEXT = "one\u2028two\u2029three\x85four\nfive"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_stream_survives_str_splitlines(http, cluster, path):
    """U+2028, U+2029 and U+0085 are line breaks to str.splitlines (httpx aiter_lines): escaped."""
    cluster.script.output_ids = [*TEXT.encode(LINE_BREAKING_TEXT), EOS_ID]
    body = (
        {**CHAT, "stream": True}
        if "chat" in path
        else {"model": MODEL_NAME, "prompt": "x", "stream": True}
    )
    response = await http.post(path, json=body)
    assert response.status_code == 200, response.text
    lines = [line for line in response.text.splitlines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: ") :]) for line in lines[:-1]]
    choices = [c["choices"][0] for c in chunks]
    text = "".join(c["delta"].get("content", "") if "delta" in c else c["text"] for c in choices)
    assert text == LINE_BREAKING_TEXT


async def test_full_response_keeps_line_breaking_text(http, cluster):
    cluster.script.output_ids = [*TEXT.encode(LINE_BREAKING_TEXT), EOS_ID]
    response = await http.post("/v1/chat/completions", json=CHAT)
    assert "\u2028" not in response.text and "\x85" not in response.text
    assert response.json()["choices"][0]["message"]["content"] == LINE_BREAKING_TEXT
