"""Requests, references and decode's page counts shared by the OpenAI API e2e modules."""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import time

import httpx
import pytest
import torch

from services.common.types import SamplingParams
from tests.conftest import INTERNAL_AUTH, image_bytes
from tests.e2e.system import System
from tests.engine.test_model_parity import hf_inputs

MAX_TOKENS = 32
CASES = {
    "text": ("Tell me about the moon.", []),
    "one_image": ("What is shown here?", [image_bytes(300, 97, seed=11)]),
    "two_images": (
        "Compare the two pictures.",
        [image_bytes(224, 224, seed=12), image_bytes(90, 200, seed=13)],
    ),
}


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def chat(text: str, images: list[bytes] = ()) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(i)}} for i in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def layout(request: pytest.FixtureRequest) -> str:
    """The name of the layout (``conftest.LAYOUTS``) the requesting test runs on."""
    return request.node.callspec.params["system"]


def only_on(request: pytest.FixtureRequest, name: str, reason: str) -> None:
    if layout(request) != name:
        pytest.skip(reason)


def create_concurrently(client, calls: list[dict], num_threads: int) -> list:
    """``client.chat.completions.create(**call)``'s reply to each call, ``num_threads`` at once."""
    with concurrent.futures.ThreadPoolExecutor(num_threads) as pool:
        return list(pool.map(lambda call: client.chat.completions.create(**call), calls))


def assert_400(system: System, path: str, body: dict | bytes) -> dict:
    """The error body of the 400 that ``body`` (JSON, or raw bytes) posted to ``/v1/{path}``
    gets."""
    url = f"{system.base_url}/{path}"
    if isinstance(body, bytes):
        headers = {"content-type": "application/json"}
        response = httpx.post(url, content=body, headers=headers, timeout=120)
    else:
        response = httpx.post(url, json=body, timeout=120)
    assert response.status_code == 400, response.text
    return response.json()["error"]


def reference(pipeline, hf_model, text: str, images: list[bytes]) -> tuple[str, int, int]:
    """transformers' greedy continuation: (text, completion tokens, prompt tokens)."""
    messages = [
        {
            "role": "user",
            "content": [*({"type": "image"} for _ in images), {"type": "text", "text": text}],
        }
    ]
    request = pipeline.build_request(messages, list(images), SamplingParams())
    with torch.no_grad():
        out = hf_model.generate(**hf_inputs(request), max_new_tokens=MAX_TOKENS, do_sample=False)
    tokens = out[0, len(request.prompt_ids) :].tolist()
    return (
        pipeline.text.decode(tokens, skip_special_tokens=True),
        len(tokens),
        len(request.prompt_ids),
    )


def decode_stats(system: System):
    from services.common.clients.decode import DecodeClient

    async def stats():
        client = DecodeClient(system.address("decode"), auth=INTERNAL_AUTH)
        try:
            return await client.stats()
        finally:
            await client.close()

    return asyncio.run(stats())


def settled_stats(system: System, is_settled, timeout_s: float):
    """Decode's stats once ``is_settled(stats)``, else its last ones at the bound."""
    deadline_mono = time.monotonic() + timeout_s
    stats = decode_stats(system)
    while not is_settled(stats) and time.monotonic() < deadline_mono:
        time.sleep(0.2)
        stats = decode_stats(system)
    return stats


def holds_nothing(stats) -> bool:
    return not (stats.num_used_pages or stats.num_running_requests or stats.num_reserved_requests)
