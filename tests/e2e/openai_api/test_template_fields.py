"""vLLM's chat template and detokenization fields on the real system (the tiny model, greedy):
``continue_final_message`` leaves the assistant's turn open, ``skip_special_tokens: false``
keeps the special tokens' text, and a ``chat_template_kwargs`` key the bundled template does
not read is refused by the tokenizer with a 400 naming it."""

from __future__ import annotations

import httpx
import pytest

from services.common.paths import BUNDLED_MODEL
from services.engine.processing import TextProcessor
from tests.e2e.openai_api.helpers import assert_400, only_on

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TEXT = TextProcessor.from_dir(BUNDLED_MODEL)
IM_START = TEXT.encode("<|im_start|>")[0]  # a special token that is not an EOS
MESSAGES = [
    {"role": "user", "content": "Count to three."},
    {"role": "assistant", "content": "One, two,"},
]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


def tokenize(system, **body) -> dict:
    response = httpx.post(f"http://127.0.0.1:{system.http_port}/tokenize", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_template_and_special_token_fields(system, client, model_name, request):
    only_on(request, "dp2", "router and tokenizer fields: one layout shows them")
    continued = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=2, temperature=0, extra_body=CONTINUE
    )
    prompt = tokenize(system, messages=MESSAGES, **CONTINUE)
    assert continued.usage.prompt_tokens == prompt["count"]
    assert TEXT.decode(prompt["tokens"]).endswith("<|im_start|>assistant\nOne, two,")
    closed = tokenize(system, messages=MESSAGES, add_generation_prompt=False)
    assert closed["tokens"] == prompt["tokens"] + TEXT.encode("<|im_end|>\n")

    forced = {"model": model_name, "prompt": "Once upon", "max_tokens": 3, "temperature": 0}
    forced["logit_bias"] = {str(IM_START): 100}
    kept = client.completions.create(**forced, extra_body={"skip_special_tokens": False})
    assert kept.choices[0].text == "<|im_start|>" * 3
    assert client.completions.create(**forced).choices[0].text == ""

    body = {"model": model_name, "messages": MESSAGES[:1], "max_tokens": 2}
    error = assert_400(system, "chat/completions", {**body, "chat_template_kwargs": {"k": 1}})
    assert error["param"] == "chat_template_kwargs.k" and "does not read" in error["message"]
