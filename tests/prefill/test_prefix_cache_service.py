"""The prefix cache in the prefill service (real rank processes, C = 1 and C = 2 sharded):
a prompt with an image run again after other prompts pushed its pages out of the device
pool, into the ranks' host tier (``--host-cache-gb``) or out of the cache. The second run
reads its cached prefix (from the host tier: copied back), and decode receives the same
KV and first token as the offline engine's, its cached pages bit for bit the first run's.
"""

from __future__ import annotations

import pytest
import torch

from services.common.prefix_keys import page_keys
from services.common.types import SamplingParams
from tests.conftest import image_bytes
from tests.prefill.conftest import (
    KV_ATOL,
    PAGE_SIZE,
    make_case,
    prefill_config,
    reference,
    start_harness,
    stop_harness,
)
from tests.prefill.test_cp_soak import host_page_bytes

pytestmark = pytest.mark.slow
NUM_PAGES = 64


def decode_kv(harness, dst, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[L, num_tokens, Hkv, D]`` that decode's pages of ``dst`` hold (copies)."""
    pool = harness.decode.pool
    pages = list(dst.page_ids)

    def read(buffer: torch.Tensor) -> torch.Tensor:
        rows = buffer[:, pages]  # [L, pages, page_size, Hkv, D]
        return rows.reshape(rows.shape[0], -1, *rows.shape[3:])[:, :num_tokens].clone()

    return read(pool.k_buffer), read(pool.v_buffer)


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu")], ids=["c1", "c2"])
@pytest.mark.parametrize("host_pages", [0, 256], ids=["device_only", "host_tier"])
async def test_a_prefix_pushed_out_comes_back_exact(
    pipeline, language_model, devices, host_pages
) -> None:
    greedy = SamplingParams(temperature=0.0)
    text = "Describe the picture in the style of a ship's log. " * 6
    case = make_case(pipeline, "turn", text, [image_bytes(96, 64, seed=7)], greedy)
    n = len(case.prompt.token_ids)
    assert n > 4 * PAGE_SIZE
    ref = reference(pipeline, case)
    config = prefill_config(
        devices=devices,
        num_pages=NUM_PAGES,
        host_cache_gb=(host_pages + 0.5) * host_page_bytes(language_model) / 1e9
        if host_pages
        else 0,
    )
    h = await start_harness(pipeline, language_model, config)
    try:
        index = h.scheduler.prefix
        first, dst = await h.prefill(case)
        assert first.num_prefix_cached_tokens == 0 and first.first_token_id == ref.first_token_id
        k1, v1 = decode_kv(h, dst, n)
        h.decode.pages.free(list(dst.page_ids))
        keys = set(index.held(0))
        assert len(keys) == n // PAGE_SIZE  # every full page kept
        shared: set[bytes] = set()  # the chat template's pages, warm in every filler
        for i in range(3):  # other prompts need the whole pool: the turn's pages leave it
            filler = make_case(
                pipeline, f"filler-{i}", f"Filler {i}. " + "Count the waves. " * 27, [], greedy
            )
            num_tokens = len(filler.prompt.token_ids)
            assert NUM_PAGES * PAGE_SIZE * 2 // 3 < num_tokens < NUM_PAGES * PAGE_SIZE
            shared |= keys & set(page_keys(filler.prompt.token_ids, (), PAGE_SIZE))
            _, filler_dst = await h.prefill(filler)
            h.decode.pages.free(list(filler_dst.page_ids))
        assert len(shared) == case.request.spans[0].offset // PAGE_SIZE  # up to the image
        for rank in range(len(devices)):
            assert not (keys - shared) & index.held(rank)
            assert (keys - shared <= index.host_held(rank)) == bool(host_pages)

        again = case.__class__(
            case.request.__class__(**{**case.request.__dict__, "request_id": "turn-again"}),
            case.prompt,
        )
        second, dst = await h.prefill(again)
        k2, v2 = decode_kv(h, dst, n)
        h.decode.pages.free(list(dst.page_ids))
    finally:
        await stop_harness(h)
    cached = second.num_prefix_cached_tokens
    if host_pages:  # read from the host tier: every full page but the last token's
        assert cached == (n - 1) // PAGE_SIZE * PAGE_SIZE
        assert second.num_prefix_cached_image_tokens == case.request.spans[0].length
        assert torch.equal(k2[:, :cached], k1[:, :cached])
        assert torch.equal(v2[:, :cached], v1[:, :cached])
    else:  # evicted: computed again past the chat template's shared first pages
        assert cached == len(shared) * PAGE_SIZE
    assert second.first_token_id == ref.first_token_id
    for k, v in ((k1, v1), (k2, v2)):
        assert torch.allclose(k, ref.k, atol=KV_ATOL, rtol=0)
        assert torch.allclose(v, ref.v, atol=KV_ATOL, rtol=0)
