"""Prompt embeddings overriding the token embeddings, through the prefill service on two CP ranks.

The embeddings of a prompt's own tokens, given as ``prompt_embeds`` with placeholder token
ids, give the same first token and decode KV as the prompt itself; a wrong hidden size or
dtype is INVALID_ARGUMENT naming ``prompt_embeds``; an override request and an image request
queued together run in different batches.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import torch

from services.common.errors import InvalidRequestError
from services.common.types import SamplingParams, TokenizedPrompt
from tests.prefill.conftest import (
    gate_worker,
    make_case,
    prefill_config,
    reference,
    standard_cases,
    start_harness,
    stop_harness,
    wait_until,
    wait_until_ready,
)
from tests.prefill.test_service import assert_matches

pytestmark = pytest.mark.slow


def embeds_of(language_model, token_ids, dtype=torch.float32) -> bytes:
    with torch.no_grad():
        rows = language_model.model.embed_tokens(torch.tensor(token_ids)).to(dtype).contiguous()
    return rows.view(torch.uint8).numpy().tobytes()


def override_prompt(language_model, case, dtype=torch.float32, name="float32") -> TokenizedPrompt:
    ids = case.prompt.token_ids
    return TokenizedPrompt(
        (0,) * len(ids),
        prompt_embeds=embeds_of(language_model, ids, dtype),
        prompt_embeds_dtype=name,
    )


async def prefill(h, request_id, prompt, params):
    dst = h.decode.reserve(request_id, len(prompt.token_ids))
    result = await h.client.prefill(
        request_id, prompt, params, h.decode.kv_ref(dst), time.time() + 30
    )
    return result, dst


async def test_prompt_embeds_through_two_cp_ranks(pipeline, language_model) -> None:
    h = await start_harness(pipeline, language_model, prefill_config(devices=("cpu", "cpu")))
    try:
        case = standard_cases(pipeline)[0]
        ref = reference(pipeline, case)
        result, dst = await prefill(
            h, "embeds", override_prompt(language_model, case), case.request.params
        )
        assert_matches(h, case, result, dst, ref)
        text = case.prompt.token_ids
        bad = {
            "hidden size 32": TokenizedPrompt(
                (0,) * len(text),
                prompt_embeds=b"\0" * (len(text) * 32 * 4),
                prompt_embeds_dtype="float32",
            ),
            "not one of float32": TokenizedPrompt(
                (0,) * len(text),
                prompt_embeds=b"\0" * (len(text) * 64 * 8),
                prompt_embeds_dtype="float64",
            ),
            "either prompt_embeds or images": msgspec.structs.replace(
                standard_cases(pipeline)[1].prompt,
                prompt_embeds=b"\0" * 4,
                prompt_embeds_dtype="float32",
            ),
        }
        for i, (message, prompt) in enumerate(bad.items()):
            with pytest.raises(InvalidRequestError, match=message) as caught:
                await prefill(h, f"bad-{i}", prompt, case.request.params)
            assert caught.value.param == "prompt_embeds"
        await check_kinds_never_share_a_batch(h, pipeline, language_model)
        h.assert_all_free()
    finally:
        await stop_harness(h)


async def check_kinds_never_share_a_batch(h, pipeline, language_model) -> None:
    release, plans = gate_worker(h)
    greedy = SamplingParams(temperature=0.0)
    blocker = asyncio.create_task(h.prefill(make_case(pipeline, "first", "Hi.", [], greedy)))
    await wait_until(lambda: bool(plans))
    image, text = standard_cases(pipeline)[1], standard_cases(pipeline)[0]
    embeds = override_prompt(language_model, text, torch.bfloat16, "bfloat16")
    tasks = []
    for job in (  # queued one at a time: the image's Encode must not let the override pass it
        h.prefill(image),
        prefill(h, "override", embeds, greedy),
        h.prefill(make_case(pipeline, "plain", "Sea.", [], greedy)),
    ):
        tasks.append(asyncio.create_task(job))
        await wait_until_ready(h, len(tasks))
    release()
    results = await asyncio.gather(*tasks)
    await blocker
    assert plans[1] == ["one-image", "plain"] and plans[2] == ["override"]  # FCFS, kinds apart
    assert_matches(h, image, *results[0], reference(pipeline, image))
    assert results[1][0].first_token_id >= 0
