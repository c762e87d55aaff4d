"""GPU (device tool): CP = 2 equals CP = 1 in bf16 (torch attention: flashinfer has no kernels for
the tiny model's head_dim 16).

Both ranks on ``cuda:0`` exchange K/V over the CPU (gloo) group (NCCL needs one GPU per
rank: prefill's ``--devices cuda:0,cuda:0`` does the same); with two GPUs, ``cuda:0,cuda:1``
exchanges over NCCL. KV goes to a bf16 decode pool on ``cuda:0`` in this process over
CUDA IPC. bf16 runs differ in rounding, so logits and KV are compared within bf16 bounds
and the greedy first token must agree.
"""

from __future__ import annotations

import time

import pytest
import torch

from services.engine.kv_cache import KVPageManager, KVPool
from services.prefill.messages import RankRequest
from tests.prefill.cp_ranks import PAGE_SIZE, plan_of, rank_init, started_ranks, write_rows
from tests.prefill.test_cp_exactness import cases

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
LOGITS_RTOL = 0.05  # of the largest |logit|
KV_ATOL = 0.05


class GpuDecodePool:
    def __init__(self, model_config) -> None:
        from services.transfer.cuda_ipc_backend import CudaIpcKVReceiver

        text = model_config.text
        self.pool = KVPool(
            text.num_hidden_layers,
            1024,
            PAGE_SIZE,
            text.num_key_value_heads,
            text.head_dim,
            torch.bfloat16,
            "cuda:0",
        )
        self.pages = KVPageManager(1024, PAGE_SIZE)
        self.receiver = CudaIpcKVReceiver()
        self.receiver.register(self.pool)

    def reserve(self, request_id: str, num_tokens: int):
        pages = self.pages.allocate(-(-num_tokens // PAGE_SIZE))[::-1]
        return self.receiver.destination(request_id, pages)

    def kv(self, dst, n: int):
        torch.cuda.synchronize()
        positions = torch.arange(n)
        slots = (
            torch.tensor(dst.page_ids)[positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
        ).cuda()
        k = (
            torch.stack([self.pool.k_slots(i)[slots] for i in range(self.pool.num_layers)])
            .float()
            .cpu()
        )
        v = (
            torch.stack([self.pool.v_slots(i)[slots] for i in range(self.pool.num_layers)])
            .float()
            .cpu()
        )
        self.pages.free(list(dst.page_ids))
        return k, v


async def run_all(pipeline, devices, decode, block_tokens: int) -> dict:
    init = rank_init(
        dtype="bfloat16",
        attention_backend="torch",
        kv_backend="cuda_ipc",
        kv_exchange_over_cpu=len(set(devices)) < len(devices),
    )
    out = {}
    async with started_ranks(len(devices), init, devices=devices) as ranks:
        for i, case in enumerate(cases(pipeline)):
            request = case.request
            n = len(request.prompt_ids)
            dst = decode.reserve(request.request_id, n)
            row_start = -1
            if request.spans:
                row_start = 0
                rows = pipeline.engine.image_embeddings([request])[0].to(torch.bfloat16)
                write_rows(ranks.descriptions, request.request_id, row_start, rows)
            rank_request = RankRequest(
                request.request_id,
                tuple(request.prompt_ids),
                case.prompt.spans,
                request.params,
                dst,
                time.time() + 60,
                row_start,
            )
            results = await ranks.run(plan_of(i + 1, [rank_request], block_tokens=block_tokens))
            [(logits, token)] = [
                (r.logits[request.request_id], o.first_token_id)
                for r in results
                for o in r.outcomes
                if o.first_token_id >= 0
            ]
            out[request.request_id] = (torch.tensor(logits), token, *decode.kv(dst, n))
    return out


@pytest.mark.parametrize(
    "devices", [("cuda:0", "cuda:0"), ("cuda:0", "cuda:1")], ids=["one-gpu-gloo", "two-gpus"]
)
async def test_cp2_equals_cp1_in_bf16(pipeline, language_model, devices) -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < len(set(devices)):
        pytest.skip(f"needs {len(set(devices))} CUDA devices")
    decode = GpuDecodePool(language_model.config)
    try:
        want = await run_all(pipeline, ("cuda:0",), decode, 1)
        for block_tokens in (1, 16):
            got = await run_all(pipeline, devices, decode, block_tokens)
            for name, (logits, token, k, v) in got.items():
                ref_logits, ref_token, ref_k, ref_v = want[name]
                assert token == ref_token, (name, block_tokens)
                assert (logits - ref_logits).abs().max() <= LOGITS_RTOL * ref_logits.abs().max(), (
                    name
                )
                assert (k - ref_k).abs().max() <= KV_ATOL and (v - ref_v).abs().max() <= KV_ATOL, (
                    name
                )
    finally:
        decode.receiver.close()
