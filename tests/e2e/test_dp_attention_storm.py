"""The seed system's deadlock, as a test: health-check-sized generates by the hundred, real
traffic with images, streams cut off by their clients and prefix-cache evictions, all at once,
through ``stageserve up`` with context-parallel prefill (CP = 2) and decode with DP attention
(D = 2, the tiny MoE's experts split over both ranks).

There, a health-check admission decided from rank-local state (cache drain queues) let one
rank start a step the others skipped. Here every decode step of the group is started by its
rank 0 from gathered state and shaped by agreed rows, and every prefill plan is the leader's,
so whatever each rank holds, no step waits on a collective that will not come: every request
ends with its own outcome within the bound, and neither group ever has to re-form.
"""

from __future__ import annotations

import asyncio
import base64
import re

import openai
import pytest

from tests.conftest import TINY_MODEL_DIR, image_bytes
from tests.e2e.system import running_system

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MOE_DIR = TINY_MODEL_DIR.parent / "tiny-qwen3-vl-moe"
NUM_CHECKS = 200  # health-check-sized generates (the router's are 2 tokens)
BOUND_S = 240.0


def image_part(seed: int) -> dict:
    data = base64.b64encode(image_bytes(96, 64, seed=seed)).decode()
    return {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{data}"}}


async def storm(client: openai.AsyncOpenAI, model: str) -> tuple[list, list, list]:
    async def check(i: int):
        reply = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"ping {i % 37}"}],  # repeats: cache hits
            max_tokens=2,
            temperature=0,
        )
        return reply.usage.completion_tokens

    async def real(i: int):
        content = [{"type": "text", "text": f"Describe scene {i} in detail, please."}]
        if i % 2:
            content.insert(0, image_part(i))
        reply = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": content}],
            max_tokens=48,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return reply.usage.completion_tokens, reply.choices[0].finish_reason

    async def cut_off(i: int):
        stream = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": f"Tell a very long story number {i}."}],
            max_tokens=200,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 3:
                break  # the client goes away: the router aborts the request everywhere
        await stream.close()
        return seen

    reals = [asyncio.ensure_future(real(i)) for i in range(8)]
    cuts = [asyncio.ensure_future(cut_off(i)) for i in range(6)]
    checks = []
    for wave in range(0, NUM_CHECKS, 20):
        checks += await asyncio.gather(*(check(i) for i in range(wave, wave + 20)))
    return checks, await asyncio.gather(*reals), await asyncio.gather(*cuts)


def test_health_check_storm_with_traffic_aborts_and_evictions(tmp_path) -> None:
    flags = (
        *("--model", str(MOE_DIR), "--num-pages", "512", "--prefill-num-pages", "48"),
        *("--prefill-cp", "2", "--prefill-cp-min-tokens", "1"),
        *("--decode-dp", "2", "--decode-dp-attention", "--decode-ep", "2"),
    )
    with running_system(tmp_path, *flags) as system:
        client = openai.AsyncOpenAI(
            base_url=system.base_url, api_key="unused", max_retries=0, timeout=BOUND_S
        )

        async def run():
            try:
                model = (await client.models.list()).data[0].id
                return await asyncio.wait_for(storm(client, model), BOUND_S)
            finally:
                await client.close()

        checks, reals, cuts = asyncio.run(run())
        assert checks == [2] * NUM_CHECKS
        assert reals == [(48, "length")] * 8
        assert cuts == [3] * 6
        hits = system.metric("prefill", "stageserve_prefill_prefix_cache_hits_total")
        assert hits > 0  # repeated checks read the cache, in a pool far too small to keep all
        logs = system.logs()
        for group in ("decode DP-attention group of 2", "prefill"):
            formed = re.findall(rf"{re.escape(group)}[^\n]*formation (\d+) is ready", logs)
            assert formed and set(formed) == {"1"}, (group, formed)
