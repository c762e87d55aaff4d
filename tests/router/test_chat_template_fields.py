"""vLLM's chat template and detokenization fields on the HTTP API, against fake workers:
``add_generation_prompt``, ``continue_final_message`` and ``chat_template_kwargs`` reach the
tokenizer checked (a 400 naming the field, before any worker, when they cannot), and
``skip_special_tokens`` / ``spaces_between_special_tokens`` shape the output text.

What the real tokenizer makes of them (the kwargs in the render, the open last message):
``tests/tokenizer/test_template_options.py``.
"""

from __future__ import annotations

import base64
import json

import pytest

from services.engine.processing.chat import MAX_TEMPLATE_KWARGS, MAX_TEMPLATE_KWARGS_BYTES
from tests.conftest import image_bytes
from tests.router.fakes import EOS_ID, TEXT, char_ids
from tests.router.http_helpers import (
    CHAT,
    CHAT_PATH,
    COMPLETION,
    COMPLETIONS_PATH,
    assert_400,
    stream_chat,
)

PNG_URL = "data:image/png;base64," + base64.b64encode(image_bytes(8, 8)).decode()
IM_START, IM_END = TEXT.encode("<|im_start|>")[0], TEXT.encode("<|im_end|>")[0]
CONTINUED = {
    **CHAT,
    "messages": [
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "One, two,"},
    ],
}


def sent(cluster):
    """The one TokenizeRequest the router sent."""
    [request] = cluster.tokenizer.servicer.requests
    return request


async def test_defaults_render_a_generation_prompt_and_no_kwargs(http, cluster):
    response = await http.post(CHAT_PATH, json=CHAT)
    assert response.status_code == 200, response.text
    request = sent(cluster)
    assert request.add_generation_prompt and not request.continue_final_message
    assert request.chat_template_kwargs == ""


async def test_template_fields_reach_the_tokenizer(http, cluster):
    kwargs = {"enable_thinking": False, "style": {"n": 1, "tags": ["a", "é"]}}
    body = {
        **CONTINUED,
        "add_generation_prompt": False,
        "continue_final_message": True,
        "chat_template_kwargs": kwargs,
    }
    response = await http.post(CHAT_PATH, json=body)
    assert response.status_code == 200, response.text
    request = sent(cluster)
    assert not request.add_generation_prompt and request.continue_final_message
    assert json.loads(request.chat_template_kwargs) == kwargs


async def test_add_generation_prompt_false_alone(http, cluster):
    response = await http.post(CHAT_PATH, json={**CHAT, "add_generation_prompt": False})
    assert response.status_code == 200, response.text
    assert not sent(cluster).add_generation_prompt


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"continue_final_message": True}, "both cannot be true"),  # add_generation_prompt: true
        ({"continue_final_message": True, "add_generation_prompt": True}, "both cannot be true"),
    ],
)
async def test_continuing_and_a_generation_prompt_is_a_400(http, cluster, fields, says):
    message = await assert_400(http, CHAT_PATH, {**CONTINUED, **fields}, "continue_final_message")
    assert says in message
    assert not cluster.tokenizer.servicer.requests


@pytest.mark.parametrize(
    ("messages", "says"),
    [
        ([{"role": "user", "content": "hi"}], "it is a user message"),
        (
            [
                {"role": "user", "content": "hi"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Here:"},
                        {"type": "image_url", "image_url": {"url": PNG_URL}},
                    ],
                },
            ],
            "end with text",
        ),
    ],
)
async def test_continue_needs_a_last_assistant_message_ending_in_text(
    http, cluster, messages, says
):
    body = {**CHAT, "messages": messages, "continue_final_message": True}
    body["add_generation_prompt"] = False
    message = await assert_400(http, CHAT_PATH, body, "continue_final_message")
    assert says in message
    assert not cluster.tokenizer.servicer.requests


@pytest.mark.parametrize(
    "key",
    ["messages", "add_generation_prompt", "tools", "documents", "eos_token", "raise_exception"],
)
async def test_kwargs_colliding_with_the_render_are_a_400_naming_the_key(http, cluster, key):
    body = {**CHAT, "chat_template_kwargs": {"ok": 1, key: "x"}}
    message = await assert_400(http, CHAT_PATH, body, f"chat_template_kwargs.{key}")
    assert "render sets itself" in message
    assert not cluster.tokenizer.servicer.requests


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({f"k{i}": i for i in range(MAX_TEMPLATE_KWARGS + 1)}, "at most 32 keys"),
        ({"big": "x" * MAX_TEMPLATE_KWARGS_BYTES}, "at most 16384"),
        ({"not-a-name": 1}, "template variable names"),
        ({"": 1}, "template variable names"),
    ],
)
async def test_kwargs_past_the_limits_are_a_400(http, cluster, kwargs, says):
    message = await assert_400(
        http, CHAT_PATH, {**CHAT, "chat_template_kwargs": kwargs}, "chat_template_kwargs"
    )
    assert says in message
    assert not cluster.tokenizer.servicer.requests


@pytest.mark.parametrize("value", ["NaN", "Infinity", '"\\ud800"'])
async def test_kwargs_values_must_be_json(http, cluster, value):
    raw = json.dumps(CHAT)[:-1] + f', "chat_template_kwargs": {{"x": {value}}}}}'
    response = await http.post(
        CHAT_PATH, content=raw.encode(), headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "chat_template_kwargs"
    assert not cluster.tokenizer.servicer.requests


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("chat_template_kwargs", {"enable_thinking": False}),
        ("add_generation_prompt", False),
        ("continue_final_message", True),
    ],
)
async def test_completions_take_no_template_fields(http, field, value):
    message = await assert_400(http, COMPLETIONS_PATH, {**COMPLETION, field: value}, field)
    assert "unknown fields are refused" in message


@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETIONS_PATH])
async def test_skip_special_tokens_false_keeps_their_text(http, cluster, path):
    cluster.script.output_ids = [*char_ids("Hi"), IM_START, IM_END, *char_ids("yo"), EOS_ID]
    base = CHAT if path == CHAT_PATH else COMPLETION

    async def text(**fields) -> str:
        response = await http.post(path, json={**base, **fields})
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        return choice["message"]["content"] if path == CHAT_PATH else choice["text"]

    assert await text() == await text(skip_special_tokens=True) == "Hiyo"
    kept = "Hi<|im_start|><|im_end|>yo"  # the EOS that stopped it is not shown, as in vLLM
    assert await text(skip_special_tokens=False) == kept
    # Documented as the same text either way: nothing goes between tokens (byte-level BPE).
    for spaces in (True, False):
        fields = {"skip_special_tokens": False, "spaces_between_special_tokens": spaces}
        assert await text(**fields) == kept
        assert await text(spaces_between_special_tokens=spaces) == "Hiyo"


async def test_skip_special_tokens_false_streams_their_text(http, cluster):
    cluster.script.output_ids = [*char_ids("a"), IM_END, *char_ids("b"), EOS_ID]
    chunks = await stream_chat(http, skip_special_tokens=False)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "a<|im_end|>b"


@pytest.mark.parametrize(
    ("field", "value"),
    [("skip_special_tokens", "false"), ("continue_final_message", 1), ("chat_template_kwargs", [])],
)
async def test_the_new_fields_are_strictly_typed(http, field, value):
    response = await http.post(CHAT_PATH, json={**CHAT, field: value})
    assert response.status_code == 400, response.text
    assert field in response.json()["error"]["param"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                **CONTINUED,
                "continue_final_message": True,
                "add_generation_prompt": False,
                "chat_template_kwargs": {"tone": "dry"},
            },
            None,
        ),
        ({"prompt": "a", "chat_template_kwargs": {"tone": "dry"}}, "chat_template_kwargs"),
        ({**CONTINUED, "continue_final_message": True}, "continue_final_message"),
        ({**CHAT, "chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
    ],
)
async def test_tokenize_takes_the_template_fields(http, cluster, body, param):
    response = await http.post("/tokenize", json=body)
    if param is not None:
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
        return
    assert response.status_code == 200, response.text
    request = sent(cluster)
    assert request.continue_final_message and not request.add_generation_prompt
    assert json.loads(request.chat_template_kwargs) == {"tone": "dry"}


async def test_openapi_documents_the_fields(http):
    components = (await http.get("/openapi.json")).json()["components"]["schemas"]
    chat, completion = components["ChatCompletionBody"], components["CompletionBody"]
    for name in (
        "add_generation_prompt",
        "continue_final_message",
        "chat_template_kwargs",
        "skip_special_tokens",
        "spaces_between_special_tokens",
    ):
        assert name in chat["properties"], name
    for name in ("skip_special_tokens", "spaces_between_special_tokens"):
        assert name in completion["properties"], name
    assert "chat_template_kwargs" not in completion["properties"]
