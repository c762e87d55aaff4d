"""The request parameters on the real system (the package's system on one layout, the tiny
model, greedy).

What the fake workers cannot show: that logit_bias, min_tokens and stop_token_ids
change what the model generates, that decode refuses token ids outside the model's
vocabulary, and that ``/tokenize`` counts what generation counts with the real
tokenizer (chat template and image placeholders).
"""

from __future__ import annotations

import base64

import httpx
import pytest

from tests.conftest import image_bytes
from tests.e2e.openai_api.helpers import only_on
from tests.router.fakes import TEXT

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
PROMPT = "Once upon a time"
Z_ID = TEXT.encode("z")[0]
EOS_ID = TEXT.eos_token_ids[-1]


@pytest.fixture(autouse=True)
def _one_layout(request):
    only_on(request, "cp2", "the parameters run once, on the cp2 layout")


@pytest.fixture(scope="module")
def http(system):
    base_url = f"http://127.0.0.1:{system.http_port}"
    with httpx.Client(base_url=base_url, timeout=120, trust_env=False) as client:
        yield client


def complete(http: httpx.Client, **fields) -> dict:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, **fields}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_logit_bias_forces_and_bans_tokens(http):
    plain = complete(http)["choices"][0]["text"]
    forced = complete(http, logit_bias={str(Z_ID): 100})
    assert forced["choices"][0]["text"] == "z" * 6 != plain
    first_id = http.post("/tokenize", json={"prompt": plain}).json()["tokens"][0]
    banned = complete(http, logit_bias={str(first_id): -100})["choices"][0]["text"]
    assert http.post("/tokenize", json={"prompt": banned}).json()["tokens"][0] != first_id


def test_min_tokens_delays_a_forced_eos(http):
    eos_first = complete(http, max_tokens=20, logit_bias={str(EOS_ID): 100})
    assert (
        eos_first["usage"]["completion_tokens"] == 1
        and eos_first["choices"][0]["finish_reason"] == "stop"
    )
    delayed = complete(http, max_tokens=20, min_tokens=5, logit_bias={str(EOS_ID): 100})
    assert (
        delayed["usage"]["completion_tokens"] == 6
        and delayed["choices"][0]["finish_reason"] == "stop"
    )
    assert delayed["choices"][0]["text"]  # five generated tokens before the EOS


def test_stop_token_ids_end_generation_and_are_not_shown(http):
    stopped = complete(http, max_tokens=20, logit_bias={str(Z_ID): 100}, stop_token_ids=[Z_ID])
    assert (
        stopped["usage"]["completion_tokens"] == 1
        and stopped["choices"][0]["finish_reason"] == "stop"
    )
    assert stopped["choices"][0]["text"] == ""
    later = complete(
        http, max_tokens=20, min_tokens=3, logit_bias={str(Z_ID): 100}, stop_token_ids=[Z_ID]
    )
    assert later["usage"]["completion_tokens"] == 4 and "z" not in later["choices"][0]["text"]


def test_echo_and_the_context_check(http):
    echoed = complete(http, echo=True)["choices"][0]["text"]
    assert (
        echoed.startswith(PROMPT) and echoed[len(PROMPT) :] == complete(http)["choices"][0]["text"]
    )
    room = 4096 - http.post("/tokenize", json={"prompt": PROMPT}).json()["count"]
    too_many = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": room + 1})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "max_tokens"
    assert (
        complete(http, max_tokens=room, logit_bias={str(EOS_ID): 100})["usage"]["completion_tokens"]
        == 1
    )


def test_token_ids_outside_the_vocabulary_are_refused_by_the_workers(http):
    for field, value in (("logit_bias", {"1000000": 5}), ("stop_token_ids", [1000000])):
        response = http.post(
            "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, field: value}
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == field


def test_tokenize_counts_what_generation_counts(http):
    image = base64.b64encode(image_bytes(120, 90, seed=3)).decode()
    content = [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
        {"type": "text", "text": "What is it?"},
    ]
    messages = [{"role": "user", "content": content}]
    tokenized = http.post("/tokenize", json={"messages": messages}).json()
    assert TEXT.image_token_id in tokenized["tokens"]
    reply = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert reply.json()["usage"]["prompt_tokens"] == tokenized["count"]
    text = http.post("/detokenize", json={"tokens": tokenized["tokens"]}).json()["prompt"]
    assert text.startswith("<|im_start|>")  # special tokens kept
    too_long = http.post("/tokenize", json={"prompt": "7 " * 5000})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "prompt"
