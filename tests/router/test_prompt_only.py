"""``max_tokens: 0`` with ``echo`` (lm-eval's loglikelihood) over fake workers: the response is
the prompt alone (its text, and with ``logprobs`` its tokens' logprobs, the first null),
finish ``length``, ``completion_tokens`` 0; prefill is asked for one token, which reaches
nothing the client gets. Without echo, and on chat, 0 is a 400 (vLLM's rule)."""

from __future__ import annotations

import json

import pytest

from services.common.wire import sampling_params_from_proto
from tests.router.conftest import wait_until
from tests.router.fakes import TEXT, fake_logprob
from tests.router.http_helpers import (
    CHAT_PATH,
    COMPLETION,
    COMPLETIONS_PATH,
    assert_400,
    body_for,
    sse_events,
)

PROMPT = "Once upon"
PROMPT_IDS = TEXT.encode(PROMPT)
ECHO = {**COMPLETION, "max_tokens": 0, "echo": True}


def _text(token_id: int) -> str:
    return TEXT.token_bytes(token_id).decode("utf-8", errors="replace")


def echoed(ids: list[int], num_top: int) -> dict:
    """The completions logprobs body of the prompt ``ids`` alone (the fake prefill's values)."""
    texts = [_text(t) for t in ids]
    entries = [fake_logprob(t, i, num_top) for i, t in enumerate(ids)][1:]
    tops = [
        {_text(t): lp for t, lp in zip(e.top_token_ids, e.top_logprobs, strict=True)}
        for e in entries
    ]
    return {
        "tokens": texts,
        "token_logprobs": [None, *(e.logprob for e in entries)],
        "top_logprobs": [None, *tops],
        "text_offset": [sum(map(len, texts[:i])) for i in range(len(ids))],
    }


def prompt_only(index: int, text: str, logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": "length"}


def assert_no_generation(cluster, num_requests: int = 1) -> None:
    """Prefill was asked for one token per request; decode never streamed, its pages freed."""
    assert len(cluster.prefill.requests) == num_requests
    for sent in cluster.prefill.requests:
        assert sampling_params_from_proto(sent.sampling_params).max_new_tokens == 1
    assert not cluster.decode.generate_started.is_set()


@pytest.mark.parametrize("num_top", [0, 2])
async def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs(http, cluster, num_top):
    # the first generated token is "H": a stop string on it must not change the finish reason
    body = {**ECHO, "logprobs": num_top, "stop": ["H"]}
    response = await http.post(COMPLETIONS_PATH, json=body)
    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["choices"] == [prompt_only(0, PROMPT, echoed(PROMPT_IDS, num_top))]
    assert reply["usage"]["completion_tokens"] == 0
    assert reply["usage"]["prompt_tokens"] == reply["usage"]["total_tokens"] == len(PROMPT_IDS)
    assert_no_generation(cluster)
    sent = sampling_params_from_proto(cluster.prefill.requests[0].sampling_params)
    assert sent.num_prompt_logprobs == num_top
    rid = next(iter(cluster.decode.reserved))
    await wait_until(lambda: cluster.aborted() == [rid])  # sent in the background
    assert cluster.is_kv_written() == {rid: True}


async def test_echo_without_logprobs_and_vllm_prompt_logprobs(http, cluster):
    reply = (await http.post(COMPLETIONS_PATH, json=ECHO)).json()
    assert reply["choices"] == [prompt_only(0, PROMPT, None)]
    assert reply["usage"]["completion_tokens"] == 0
    reply = (await http.post(COMPLETIONS_PATH, json={**ECHO, "prompt_logprobs": 1})).json()
    (choice,) = reply["choices"]
    assert choice["text"] == PROMPT and choice["logprobs"] is None
    assert choice["finish_reason"] == "length"
    assert choice["prompt_logprobs"][0] is None
    assert len(choice["prompt_logprobs"]) == len(PROMPT_IDS)


async def test_streamed_echo_with_max_tokens_0(http, cluster):
    body = {**ECHO, "logprobs": 1, "stream": True, "stream_options": {"include_usage": True}}
    response = await http.post(COMPLETIONS_PATH, json=body)
    assert response.status_code == 200, response.text
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    assert choices == [
        {"index": 0, "text": PROMPT, "logprobs": echoed(PROMPT_IDS, 1), "finish_reason": None},
        {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"},
    ]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 0
    assert chunks[-1]["usage"]["prompt_tokens"] == len(PROMPT_IDS)
    assert_no_generation(cluster)


@pytest.mark.parametrize("stream", [False, True])
async def test_every_choice_is_the_prompt_alone(http, cluster, stream):
    body = {**ECHO, "logprobs": 1, "n": 2, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    response = await http.post(COMPLETIONS_PATH, json=body)
    assert response.status_code == 200, response.text
    if stream:
        chunks = [json.loads(e) for e in sse_events(response.text)[:-1]]
        by_index: dict[int, list] = {}
        for chunk in chunks:
            for choice in chunk["choices"]:
                by_index.setdefault(choice["index"], []).append(choice)
        assert sorted(by_index) == [0, 1]
        for choices in by_index.values():
            assert "".join(c["text"] for c in choices) == PROMPT
            assert [c["finish_reason"] for c in choices] == [None, "length"]
            assert choices[0]["logprobs"] == echoed(PROMPT_IDS, 1)
        usage = chunks[-1]["usage"]
    else:
        reply = response.json()
        wanted = [prompt_only(i, PROMPT, echoed(PROMPT_IDS, 1)) for i in (0, 1)]
        assert reply["choices"] == wanted
        usage = reply["usage"]
    assert usage["completion_tokens"] == 0 and usage["prompt_tokens"] == len(PROMPT_IDS)
    assert_no_generation(cluster, 2)


async def test_token_id_prompt(http, cluster):
    body = {**ECHO, "prompt": PROMPT_IDS, "logprobs": 1}
    reply = (await http.post(COMPLETIONS_PATH, json=body)).json()
    assert reply["choices"] == [prompt_only(0, PROMPT, echoed(PROMPT_IDS, 1))]
    assert reply["usage"]["completion_tokens"] == 0
    assert not cluster.tokenizer.servicer.requests  # the ids go to prefill as they are
    assert list(cluster.prefill.requests[0].token_ids) == PROMPT_IDS


@pytest.mark.parametrize("as_ids", [False, True])
async def test_batched_prompts(http, cluster, as_ids):
    prompts = [PROMPT, "a time"]
    ids = [TEXT.encode(p) for p in prompts]
    body = {**ECHO, "prompt": ids if as_ids else prompts, "logprobs": 1, "n": 2}
    response = await http.post(COMPLETIONS_PATH, json=body)
    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["choices"] == [
        prompt_only(2 * p + i, prompts[p], echoed(ids[p], 1)) for p in (0, 1) for i in (0, 1)
    ]
    assert reply["usage"]["prompt_tokens"] == sum(map(len, ids))
    assert reply["usage"]["completion_tokens"] == 0
    assert_no_generation(cluster, 4)
    assert sorted(list(r.token_ids) for r in cluster.prefill.requests) == sorted(2 * ids)


async def test_max_tokens_0_without_echo_is_a_400_saying_it_needs_echo(http, cluster):
    message = await assert_400(
        http, COMPLETIONS_PATH, {**COMPLETION, "max_tokens": 0}, "max_tokens"
    )
    assert "echo" in message, message
    assert not cluster.tokenizer.servicer.requests and not cluster.decode.reserved


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (COMPLETIONS_PATH, {"echo": True, "max_tokens": -1}, "max_tokens"),
        (COMPLETIONS_PATH, {"echo": True, "max_tokens": 0, "min_tokens": 1}, "min_tokens"),
        (CHAT_PATH, {"max_tokens": 0}, "max_tokens"),
        (CHAT_PATH, {"max_completion_tokens": 0}, "max_completion_tokens"),
    ],
)
async def test_other_budgets_of_0_or_less_are_a_400(http, cluster, path, fields, param):
    await assert_400(http, path, body_for(path, **fields), param)
    assert not cluster.tokenizer.servicer.requests and not cluster.decode.reserved
