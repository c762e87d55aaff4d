"""``/v1/completions`` prompts as token ids and in batches over fake workers: ids skip the
tokenizer, a batch gives each prompt its n choices in vLLM's order (index ``p * n + i``) and
usage adds the prompts up; bad ids and batches over ``--max-n`` are 400s naming the field."""

from __future__ import annotations

import json

import pytest

from tests.router.fakes import TEXT
from tests.router.http_helpers import COMPLETION, COMPLETIONS_PATH, EXPECTED, assert_400, sse_events

IDS = TEXT.encode("Once upon")


@pytest.mark.parametrize("prompt", [IDS, [IDS]])
async def test_token_ids_go_to_prefill_as_they_are(http, cluster, prompt):
    body = {**COMPLETION, "prompt": prompt, "max_tokens": 5, "echo": True}
    response = await http.post(COMPLETIONS_PATH, json=body)
    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["choices"][0]["text"] == "Once upon" + EXPECTED[:5]  # echo: the ids decoded
    assert reply["usage"]["prompt_tokens"] == len(IDS)
    assert not cluster.tokenizer.servicer.requests
    assert list(cluster.prefill.requests[0].token_ids) == IDS


@pytest.mark.parametrize("stream", [False, True])
async def test_a_batch_gives_each_prompt_its_choices(http, cluster, stream):
    prompts = ["Once upon", "a time"]
    body = {**COMPLETION, "prompt": prompts, "max_tokens": 3, "n": 2, "echo": True}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    response = await http.post(COMPLETIONS_PATH, json=body)
    assert response.status_code == 200, response.text
    if stream:
        chunks = [json.loads(e) for e in sse_events(response.text)[:-1]]
        texts: dict[int, str] = {}
        for chunk in chunks:
            for choice in chunk["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        ids = {chunk["id"] for chunk in chunks}
        usage = chunks[-1]["usage"]
    else:
        reply = response.json()
        texts = {c["index"]: c["text"] for c in reply["choices"]}
        ids, usage = {reply["id"]}, reply["usage"]
    assert texts == {2 * p + i: prompts[p] + EXPECTED[:3] for p in (0, 1) for i in (0, 1)}
    assert len(ids) == 1  # one response id over every prompt's choices
    assert usage["prompt_tokens"] == sum(len(TEXT.encode(p)) for p in prompts)
    assert usage["completion_tokens"] == 4 * 3
    (rid,) = ids
    assert sorted(cluster.decode.reserved) == [f"{rid}-{p}-{i}" for p in (0, 1) for i in (0, 1)]


@pytest.mark.parametrize(
    ("prompt", "param", "said"),
    [
        ([], "prompt", "empty"),
        ([[]], "prompt[0]", "at least one"),
        ([IDS, [1, -1]], "prompt[1][1]", "token ids are in"),
        ([TEXT.vocab_size], "prompt[0]", "token ids are in"),
        ([*IDS, TEXT.image_token_id], f"prompt[{len(IDS)}]", "placeholder"),
        ([1] * 4096, "prompt", "context"),
        (["a", "b", "c"], "prompt", "--max-n"),  # 3 prompts of n=3: 9 choices, over 8
    ],
)
async def test_bad_prompts_are_a_400_naming_the_field(http, cluster, prompt, param, said):
    body = {**COMPLETION, "prompt": prompt, "n": 3, "max_tokens": 1}
    message = await assert_400(http, COMPLETIONS_PATH, body, param)
    assert said in message, message
    assert not cluster.tokenizer.servicer.requests and not cluster.decode.reserved
