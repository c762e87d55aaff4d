"""Decode on a GPU (device tool, one H200): two DP ranks on one GPU generate exactly what one
rank does (greedy, bf16, CUDA graphs, KV written over CUDA IPC)."""

from __future__ import annotations

import asyncio

import pytest

from services.common.types import SamplingParams
from services.engine.llm import EngineRequest
from services.transfer.cuda_ipc_backend import CudaIpcKVSender
from tests.conftest import image_bytes
from tests.decode.conftest import prompt_of
from tests.decode.test_ranks import (
    Prefill,
    chat_request,
    decode_process,
    generate,
    make_pipeline,
    wait_idle,
)

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
GPU_FLAGS = (
    "--device",
    "cuda:0",
    "--kv-transfer-backend",
    "cuda_ipc",
    "--dtype",
    "bfloat16",
)  # torch attention: flashinfer has no kernels for the tiny model's head_dim 16


async def run_all(decode, pipeline, requests) -> list[tuple[list[int], str]]:
    prefill, client = Prefill(pipeline.engine, CudaIpcKVSender()), decode.client()
    try:
        results = await asyncio.gather(*(generate(client, prefill, r) for r in requests))
        await wait_idle(decode, client)
        return [(tokens, reason) for tokens, reason, _ in results]
    finally:
        await client.close()


def test_two_ranks_on_one_gpu_match_one_rank_token_for_token(tmp_path) -> None:
    pipeline = make_pipeline("cuda:0", dtype="bfloat16")
    params = SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True)
    requests = [EngineRequest(f"r{i}", prompt_of(20 + 7 * i, i), params) for i in range(12)]
    requests.append(
        chat_request(pipeline, "image", "What is here?", [image_bytes(120, 80, seed=1)], params)
    )
    outcomes = {}
    for num_ranks in (1, 2):
        with decode_process(num_ranks, tmp_path / f"decode-{num_ranks}.log", *GPU_FLAGS) as decode:
            outcomes[num_ranks] = asyncio.run(run_all(decode, pipeline, requests))
    assert outcomes[1] == outcomes[2]
    assert all(len(tokens) == 64 and reason == "length" for tokens, reason in outcomes[1])
