"""The benchmark's prompt lengths are the model's tokens: checked with the tiny model's tokenizer.

``PromptBuilder`` is checked against the tokenizer directly; then the whole client runs
against a router whose tokenizer worker is the real one (prefill and decode are fakes:
they report the prompt length the router sent them), counting tokens both through the
router's ``/tokenize`` and with the local tokenizer.json.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from benchmarks.serve import main
from benchmarks.serve_tokens import LocalTokenCounter, PromptBuilder
from services.engine.processing import TextProcessor
from tests.conftest import TINY_MODEL_DIR
from tests.router.conftest import Cluster, router_config, serve_http, stop_router
from tests.router.fake_decode import FakeDecode
from tests.router.fakes import FakePrefill, Script, start_worker
from tests.tokenizer.conftest import start_served, stop_served

TEXT = TextProcessor.from_dir(TINY_MODEL_DIR)
INPUT_LEN = 64


async def test_prompts_have_the_exact_token_count():
    counter = LocalTokenCounter(TINY_MODEL_DIR)
    builder = await PromptBuilder.create(counter)
    lengths = [1, 2, 3, 7, 64, 257, 1000]
    prompts = await builder.prompts(lengths, np.random.default_rng(0))
    for (text, count), n in zip(prompts, lengths, strict=True):
        assert count == n == len(TEXT.encode(text)), (n, text[:60])
    assert len({text for text, _ in prompts}) == len(lengths)


async def test_extended_prompts_keep_their_start_and_have_the_exact_count():
    counter = LocalTokenCounter(TINY_MODEL_DIR)
    builder = await PromptBuilder.create(counter)
    rng = np.random.default_rng(1)
    starts = await builder.prompts([50, 300], rng)
    extra = [1, 3, 40, 257]
    chosen = [starts[i % 2] for i in range(len(extra))]
    prompts = await builder.extend(chosen, extra, rng)
    for (text, count), (start, start_count), n in zip(prompts, chosen, extra, strict=True):
        assert text.startswith(start + " ")
        assert count == start_count + n == len(TEXT.encode(text)), (n, text[-60:])


def template_len() -> int:
    """Tokens the chat template adds around one user message (its text excluded)."""
    return len(TEXT.encode_chat([{"role": "user", "content": [{"type": "text", "text": ""}]}]))


@pytest.fixture
async def router_url():
    """A router over the real tokenizer (one thread) and fake prefill / decode workers."""
    tokenizer, tokenizer_server = await start_served(num_workers=0)
    script = Script()
    prefill, decode = (
        await start_worker(FakePrefill(script)),
        await start_worker(FakeDecode(script)),
    )
    cluster = Cluster(script, tokenizer, [prefill], [decode])
    app, url = await serve_http(router_config(cluster))
    try:
        yield url
    finally:
        await stop_router(app)
        for worker in (prefill, decode):
            await worker.server.stop(None)
        await stop_served(tokenizer, tokenizer_server)


@pytest.mark.parametrize("count_with", ["server", "local"])
async def test_input_len_64_is_64_prompt_tokens_plus_the_chat_template(
    router_url, tmp_path, count_with
):
    out = tmp_path / "run.json"
    argv = [
        "--base-url",
        f"{router_url}/v1",
        "--num-requests",
        "4",
        "--input-len",
        str(INPUT_LEN),
        "--output-len",
        "4",
        "--output-json",
        str(out),
        "--request-timeout-s",
        "60",
    ]
    argv += ["--tokenizer", str(TINY_MODEL_DIR) if count_with == "local" else "server"]
    assert await asyncio.to_thread(main, argv) == 0
    records = json.loads(out.read_text())["requests"]
    assert [r["outcome"] for r in records] == ["ok"] * 4
    expected = INPUT_LEN + template_len()
    for record in records:
        assert record["input_len"] == INPUT_LEN
        assert abs(record["prompt_tokens"] - expected) <= 2, (record["prompt_tokens"], expected)


async def test_completions_backend_prompt_is_the_input_len(router_url, tmp_path):
    out = tmp_path / "run.json"
    argv = [
        "--base-url",
        f"{router_url}/v1",
        "--backend",
        "openai",
        "--num-requests",
        "2",
        "--input-len",
        str(INPUT_LEN),
        "--output-len",
        "3",
        "--output-json",
        str(out),
        "--tokenizer",
        str(TINY_MODEL_DIR),
    ]
    assert await asyncio.to_thread(main, argv) == 0
    assert [r["prompt_tokens"] for r in json.loads(out.read_text())["requests"]] == [INPUT_LEN] * 2


async def test_a_noise_jpeg_is_accepted_and_counted_by_the_real_tokenizer(router_url, tmp_path):
    out = tmp_path / "run.json"
    argv = [
        "--base-url",
        f"{router_url}/v1",
        "--num-requests",
        "1",
        "--input-len",
        "16",
        "--output-len",
        "2",
        "--images-per-request",
        "1",
        "--image-size",
        "56x56",
        "--output-json",
        str(out),
        "--tokenizer",
        str(TINY_MODEL_DIR),
    ]
    assert await asyncio.to_thread(main, argv) == 0
    [record] = json.loads(out.read_text())["requests"]
    num_image_tokens = (56 // 14) ** 2 // 4  # 4x4 patches, merged 2x2
    assert record["prompt_tokens"] >= 16 + template_len() + num_image_tokens
