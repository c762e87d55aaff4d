"""Logprobs through the whole system, checked against transformers' log-softmax: chat's and
completions' sampled and top tokens, echo with the prompt's, vLLM's ``prompt_logprobs``."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from services.common.types import SamplingParams
from tests.e2e.openai_api.helpers import assert_400, chat

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
LOGPROB_TOLERANCE = 1e-4  # fp32 on both sides


def tokenize(system, prompt: str) -> list[int]:
    url = f"http://127.0.0.1:{system.http_port}/tokenize"
    return httpx.post(url, json={"prompt": prompt}, timeout=30).json()["tokens"]


def reference_logprobs(hf_model, prompt_ids: list[int], max_new_tokens: int):
    """transformers' greedy tokens after ``prompt_ids`` and the log-softmax at each of them."""
    with torch.no_grad():
        out = hf_model.generate(
            input_ids=torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False
        )
        logits = hf_model(input_ids=out[:, :-1]).logits[0].float()
    tokens = out[0, len(prompt_ids) :].tolist()
    return tokens, logits[len(prompt_ids) - 1 :].log_softmax(dim=-1)  # [len(tokens), V]


def check_token_logprobs(pipeline, tokens, reference, got, num_top):
    """``got``: (bytes, logprob, [(bytes, logprob)] top) per token, as the API returned them."""
    token_bytes = pipeline.text.token_bytes
    assert len(got) == len(tokens)
    for i, (token_id, (raw, logprob, top)) in enumerate(zip(tokens, got, strict=True)):
        assert raw == token_bytes(token_id), i
        assert abs(logprob - reference[i, token_id].item()) < LOGPROB_TOLERANCE, i
        values, ids = reference[i].topk(num_top)
        assert [t for t, _ in top] == [token_bytes(t) for t in ids.tolist()], i
        assert all(
            abs(a - b) < LOGPROB_TOLERANCE for (_, a), b in zip(top, values.tolist(), strict=True)
        )
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)
        assert top[0] == (raw, logprob)  # greedy: the sampled token leads


def chat_entries(content) -> list:
    return [
        (bytes(c.bytes), c.logprob, [(bytes(t.bytes), t.logprob) for t in c.top_logprobs])
        for c in content
    ]


def test_chat_logprobs_match_transformers(client, model_name, pipeline, hf_model):
    text = "Tell me about the moon."
    request = pipeline.build_request(
        [{"role": "user", "content": [{"type": "text", "text": text}]}], [], SamplingParams()
    )
    tokens, reference = reference_logprobs(hf_model, list(request.prompt_ids), 8)
    call = dict(model=model_name, messages=chat(text), max_tokens=8, temperature=0)
    reply = client.chat.completions.create(**call, logprobs=True, top_logprobs=5)
    content = reply.choices[0].logprobs.content
    check_token_logprobs(pipeline, tokens, reference, chat_entries(content), 5)
    stream = client.chat.completions.create(**call, logprobs=True, top_logprobs=5, stream=True)
    streamed = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    # the same tokens and top tokens; the values within the tolerance: the second request
    # reads the first's prompt pages from the prefix cache, a different float path
    assert_same_entries(chat_entries(streamed), chat_entries(content))
    assert client.chat.completions.create(**call).choices[0].logprobs is None


def assert_same_entries(got: list, want: list) -> None:
    assert [(t, [b for b, _ in top]) for t, _, top in got] == [
        (t, [b for b, _ in top]) for t, _, top in want
    ]
    for (_, value, top), (_, ref, ref_top) in zip(got, want, strict=True):
        assert abs(value - ref) < LOGPROB_TOLERANCE
        assert all(
            abs(a - b) < LOGPROB_TOLERANCE for (_, a), (_, b) in zip(top, ref_top, strict=True)
        )


def test_completion_logprobs_match_transformers(system, client, model_name, pipeline, hf_model):
    prompt = "Once upon a time"
    tokens, reference = reference_logprobs(hf_model, tokenize(system, prompt), 6)
    reply = client.completions.create(
        model=model_name, prompt=prompt, max_tokens=6, temperature=0, logprobs=3
    )
    logprobs = reply.choices[0].logprobs
    token_bytes = pipeline.text.token_bytes
    as_text = [token_bytes(t).decode("utf-8", errors="replace") for t in tokens]
    assert logprobs.tokens == as_text
    assert logprobs.text_offset == [sum(map(len, as_text[:i])) for i in range(len(tokens))]
    for i, token_id in enumerate(tokens):
        assert abs(logprobs.token_logprobs[i] - reference[i, token_id].item()) < LOGPROB_TOLERANCE
        values, ids = reference[i].topk(3)
        top = logprobs.top_logprobs[i]
        assert list(top) == [token_bytes(t).decode("utf-8", errors="replace") for t in ids.tolist()]
        assert all(
            abs(a - b) < LOGPROB_TOLERANCE
            for a, b in zip(top.values(), values.tolist(), strict=True)
        )


ECHO_PROMPT = " ".join(f"The {i}th cat sat on the mat." for i in range(20))


def test_echo_logprobs_match_transformers(system, model_name, pipeline, hf_model):
    # ~200 tokens: under cp2 the prompt spans both ranks' blocks
    prompt_ids = tokenize(system, ECHO_PROMPT)
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([prompt_ids])).logits[0].float()
    reference = logits.log_softmax(dim=-1)  # [n, V]: row i predicts token i + 1
    body = dict(
        model=model_name, prompt=ECHO_PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=2
    )
    url = f"{system.base_url}/completions"
    reply = httpx.post(url, json={**body, "prompt_logprobs": 3}, timeout=120).json()
    choice = reply["choices"][0]
    token_bytes = pipeline.text.token_bytes
    n = len(prompt_ids)
    as_text = [token_bytes(t).decode("utf-8", errors="replace") for t in prompt_ids]
    got = choice["logprobs"]
    assert got["tokens"][:n] == as_text and len(got["tokens"]) == n + 1
    assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
    assert got["text_offset"][: n + 1] == [sum(map(len, as_text[:i])) for i in range(n + 1)]
    generated = int(reference[n - 1].argmax())
    for i, token_id in enumerate([*prompt_ids[1:], generated], start=1):
        assert abs(got["token_logprobs"][i] - reference[i - 1, token_id].item()) < 1e-4, i
        values, top_ids = reference[i - 1].topk(2)
        top = got["top_logprobs"][i]
        assert list(top) == [token_bytes(t).decode("utf-8", errors="replace") for t in top_ids]
        assert all(abs(a - b) < 1e-4 for a, b in zip(top.values(), values.tolist(), strict=True))
    assert choice["text"].startswith(ECHO_PROMPT)
    vllm = choice["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == n
    for i, entry in enumerate(vllm[1:], start=1):
        values, top_ids = reference[i - 1].topk(3)
        wanted = {*map(str, top_ids.tolist()), str(prompt_ids[i])}
        assert set(entry) == wanted, i
        for token_id, value in entry.items():
            assert abs(value["logprob"] - reference[i - 1, int(token_id)].item()) < 1e-4
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
    streamed = [json.loads(e)["choices"][0]["logprobs"] for e in events]
    assert streamed[0]["token_logprobs"] == got["token_logprobs"][:n]
    assert streamed[1]["text_offset"] == got["text_offset"][n:]
    # lm-eval's max_tokens 0: the prompt part of the max_tokens 1 reply, nothing generated
    alone = httpx.post(url, json={**body, "prompt_logprobs": 3, "max_tokens": 0}, timeout=120)
    (prompt_only,) = alone.json()["choices"]
    assert prompt_only["text"] == ECHO_PROMPT and prompt_only["finish_reason"] == "length"
    assert prompt_only["logprobs"] == {key: value[:n] for key, value in got.items()}
    assert prompt_only["prompt_logprobs"] == vllm
    assert alone.json()["usage"]["completion_tokens"] == 0


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
        ("completions", {"prompt_logprobs": -1}, "prompt_logprobs"),
        ("completions", {"echo": True, "logprobs": 21}, "logprobs"),
        ("completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ("completions", {"max_tokens": 0}, "max_tokens"),  # 0 needs echo
        ("chat/completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ],
)
def test_bad_prompt_logprobs_are_a_400(system, model_name, path, extra, param):
    body = {"model": model_name, "max_tokens": 1, **extra}
    if path == "completions":
        body["prompt"] = "Hello"
    else:
        body["messages"] = chat("Hello")
    assert assert_400(system, path, body)["param"] == param
