"""``/tokenize``, ``/detokenize`` (vLLM's shapes) and ``/version`` over fake workers."""

from __future__ import annotations

import importlib.metadata
import json

import pytest

from services.router.tokenize_api import MAX_DETOKENIZE_IDS
from tests.conftest import image_bytes
from tests.router.conftest import MODEL_NAME
from tests.router.fakes import NUM_IMAGE_TOKENS, TEXT
from tests.router.http_helpers import CHAT, _data_url, _image_chat


async def test_tokenize_a_prompt_counts_what_completions_count(http, cluster):
    reply = await http.post("/tokenize", json={"model": MODEL_NAME, "prompt": "Once upon a time"})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body == {
        "count": len(TEXT.encode("Once upon a time")),
        "max_model_len": 4096,
        "tokens": TEXT.encode("Once upon a time"),
        "token_strs": None,
    }
    completion = await http.post(
        "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 2}
    )
    assert completion.json()["usage"]["prompt_tokens"] == body["count"]
    assert not cluster.decode.reserved or len(cluster.decode.reserved) == 1  # only the completion


async def test_tokenize_a_chat_with_an_image_counts_what_chat_counts(http, cluster):
    chat = _image_chat(_data_url(image_bytes(40, 30)))
    tokenized = (await http.post("/tokenize", json={"messages": chat["messages"]})).json()
    assert tokenized["tokens"].count(TEXT.image_token_id) == NUM_IMAGE_TOKENS
    assert cluster.tokenizer.servicer.requests[-1].add_generation_prompt
    reply = await http.post("/v1/chat/completions", json={**chat, "max_tokens": 2})
    assert reply.json()["usage"]["prompt_tokens"] == tokenized["count"]
    [reserve] = cluster.decode.reserved.values()
    assert list(reserve.prompt_token_ids) == tokenized["tokens"]


async def test_tokenize_options(http, cluster):
    body = {**CHAT, "add_generation_prompt": False, "add_special_tokens": True}
    reply = await http.post("/tokenize", json=body)
    assert reply.status_code == 200, reply.text
    assert cluster.tokenizer.servicer.requests[-1].add_generation_prompt is False
    for value in (True, False):
        same = await http.post("/tokenize", json={"prompt": "abc", "add_special_tokens": value})
        assert same.json()["tokens"] == TEXT.encode("abc")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "a", "messages": CHAT["messages"]}, "prompt"),
        ({"model": MODEL_NAME}, "prompt"),
        ({"prompt": "a", "add_generation_prompt": True}, "add_generation_prompt"),
        ({"prompt": "a", "continue_final_message": False}, "continue_final_message"),
        (  # CHAT ends with a user message: nothing to continue
            {**CHAT, "continue_final_message": True, "add_generation_prompt": False},
            "continue_final_message",
        ),
        ({**CHAT, "continue_final_message": True}, "continue_final_message"),  # both true
        ({"prompt": "a", "chat_template_kwargs": {}}, "chat_template_kwargs"),
        ({"prompt": "a", "return_token_strs": True}, "return_token_strs"),
        ({"prompt": "a", "tools": []}, "tools"),
        ({"prompt": "a", "chat_template": "x"}, "chat_template"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "a\ud800"}, "prompt"),
        ({"prompt": "a", "model": "other"}, "model"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ],
)
async def test_bad_tokenize_requests_are_400s(http, cluster, body, param):
    raw = json.dumps(body).encode()  # lone surrogates as \\ud800 escapes, as a client may send
    response = await http.post(
        "/tokenize", content=raw, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text[:300]
    assert response.json()["error"]["param"] == param


async def test_detokenize_round_trips_and_keeps_special_tokens(http):
    ids = TEXT.encode("Hello there") + [TEXT.eos_token_ids[-1]]
    reply = await http.post("/detokenize", json={"model": MODEL_NAME, "tokens": ids})
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"prompt": TEXT.decode(ids)}
    text = reply.json()["prompt"]
    assert text.startswith("Hello there") and len(text) > len("Hello there")  # the EOS text is kept
    assert (await http.post("/detokenize", json={"tokens": []})).json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("tokens", "param"),
    [
        ([1, TEXT.vocab_size], "tokens[1]"),
        ([-1], "tokens[0]"),
        ([2**70], "tokens[0]"),
        ([1.0], "tokens[0]"),
        (["1"], "tokens[0]"),
        ("12", "tokens"),
    ],
)
async def test_detokenize_refuses_ids_outside_the_vocabulary(http, tokens, param):
    response = await http.post("/detokenize", json={"tokens": tokens})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


async def test_detokenize_takes_at_most_the_context_of_ids(http, router):
    max_len = router.cfg.max_context_len
    assert (await http.post("/detokenize", json={"tokens": [1] * max_len})).status_code == 200
    response = await http.post("/detokenize", json={"tokens": [1] * (max_len + 1)})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tokens"
    assert error["message"] == (
        f"tokens has {max_len + 1} ids; at most max_model_len ({max_len}) are decoded"
    )


async def test_detokenize_refuses_a_huge_list_before_checking_its_ids(http):
    tokens = [-1] * (MAX_DETOKENIZE_IDS + 1)  # every id bad: no id was looked at
    response = await http.post("/detokenize", json={"tokens": tokens})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "tokens"
    assert f"{MAX_DETOKENIZE_IDS + 1} ids; at most {MAX_DETOKENIZE_IDS}" in error["message"]


async def test_version(http):
    reply = await http.get("/version")
    assert reply.status_code == 200 and reply.json() == {
        "version": importlib.metadata.version("stageserve")
    }


async def test_openapi_documents_the_new_routes(http):
    schema = (await http.get("/openapi.json")).json()
    paths, components = schema["paths"], schema["components"]["schemas"]
    for path, body, answer in (
        ("/tokenize", "TokenizeBody", "TokenizeResponse"),
        ("/detokenize", "DetokenizeBody", "DetokenizeResponse"),
    ):
        operation = paths[path]["post"]
        assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
            body
        )
        ok = operation["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
        assert ok.endswith(answer) and "422" not in operation["responses"]
        assert operation["responses"]["400"]["content"]["application/json"]["schema"][
            "$ref"
        ].endswith("ErrorResponse")
    fields = set(components["TokenizeResponse"]["properties"])
    assert fields == {"count", "max_model_len", "tokens", "token_strs"}
    version = paths["/version"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert version["$ref"].endswith("VersionResponse")
