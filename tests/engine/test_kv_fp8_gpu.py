"""FP8 KV cache (``--kv-cache-dtype fp8_e4m3``) on a GPU: the Triton store kernel against the
torch quantize, flashinfer decode and prefill over e4m3 pages against the torch backend (the
same pages) and against bf16 pages, the Triton page copy (CUDA IPC's) of e4m3 pages, the
prefill pieces and the decode CUDA graphs against eager steps, and a small random model's
logits against bf16 KV.

Tolerances, where not exact: flashinfer against torch over the same e4m3 pages is the bf16
test's (``test_flashinfer_attention.py``): flashinfer upcasts e4m3 to bf16 exactly and folds
the scales in. Against bf16 pages the quantization itself shows: the torch backend on the CPU,
same shapes and scales, measured max 0.14 and mean 0.008 to 0.010 (one key's V quantized to
e4m3's step, 1/8 of 2-4); asserted max 0.25, mean 0.02. The small random model (bf16, torch
backend on the CPU) measured logits within 2.7% of their range of bf16 KV, cosine >= 0.9995,
the argmax on 96% of the rows; asserted 6%, 0.998, and the argmax wherever decided.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.random_model import build_random_model
from services.engine import fp8, ops
from services.engine.attention import ForwardMode, create_attention_backend
from services.engine.kv_cache import KVPool, KVScales
from services.engine.model_runner import KVCacheConfig, ModelRunner
from tests.engine.test_cuda_graph import NUM_STEPS, PROMPT_LENS, _compare, _decode, _prefill
from tests.engine.test_flashinfer_attention import CASES, HEAD_DIM, NUM_PAGES, PAGE_SIZE, _batch
from tests.engine.test_prefill_graph import _passes

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp8_gpu")]

FP8 = torch.float8_e4m3fn
# layer 0 without calibration (1.0); layer 1 about max|x| / 448 for unit-normal K and V
SCALES = KVScales(k=(1.0, 2.0**-6), v=(1.0, 0.03))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("scale", [1.0, 0.25, 0.03])
def test_the_triton_store_equals_the_torch_quantize_bit_for_bit(scale) -> None:
    torch.manual_seed(0)
    pool = KVPool(1, 64, 16, 4, 128, torch.bfloat16, "cuda", scales=KVScales((scale,), (scale,)))
    n = 300
    qkv = torch.randn(n, 12 * 128, device="cuda", dtype=torch.bfloat16) * 4  # q, k, v heads
    qkv[:5, 4 * 128 : 4 * 128 + 3] = torch.tensor([1e4, -1e4, float("inf")], device="cuda")
    k = qkv[:, 4 * 128 : 8 * 128].view(n, 4, 128)  # views of a wider row, as the model's
    v = qkv[:, 8 * 128 :].view(n, 4, 128)
    slots = torch.randperm(64 * 16, device="cuda")[:n]
    assert ops._fused(k, "triton_kv") is not None  # the Triton kernel runs
    pool.write(0, slots, k, v)
    scale_t = torch.tensor(scale, device="cuda")
    assert torch.equal(_bytes(pool.k_slots(0)[slots]), _bytes(fp8.quantize_scaled(k, scale_t)))
    assert torch.equal(_bytes(pool.v_slots(0)[slots]), _bytes(fp8.quantize_scaled(v, scale_t)))
    assert bool((pool.k_slots(0)[slots[:5], 0, :3].float().abs() == 448.0).all())  # clamped


def _pools(num_kv_heads: int) -> tuple[KVPool, KVPool, KVPool]:
    """An FP8 pool (``SCALES``), a bf16 pool of the same K and V, and an FP8 twin of the first."""
    pools = [
        KVPool(2, NUM_PAGES, PAGE_SIZE, num_kv_heads, HEAD_DIM, torch.bfloat16, "cuda", scales=s)
        for s in (SCALES, None, SCALES)
    ]
    slots = torch.arange(NUM_PAGES * PAGE_SIZE, device="cuda")
    for layer in range(2):
        k, v = torch.randn(2, len(slots), num_kv_heads, HEAD_DIM, device="cuda").bfloat16()
        for pool in pools:
            pool.write(layer, slots, k, v)
    return pools[0], pools[1], pools[2]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(28, 4), (8, 4)])
def test_flashinfer_over_fp8_pages(case, num_q_heads, num_kv_heads) -> None:
    pytest.importorskip("flashinfer")
    torch.manual_seed(num_q_heads)
    mode, prefix_lens, extend_lens = CASES[case]
    fp8_pool, bf16_pool, twin = _pools(num_kv_heads)
    kwargs = {"num_q_heads": num_q_heads, "num_kv_heads": num_kv_heads, "head_dim": HEAD_DIM}
    flashinfer = create_attention_backend("flashinfer", kv_pool=fp8_pool, **kwargs)
    same_pages = create_attention_backend("torch", kv_pool=twin, **kwargs)
    bf16_pages = create_attention_backend("torch", kv_pool=bf16_pool, **kwargs)
    batch = _batch(mode, prefix_lens, extend_lens)
    for backend in (flashinfer, same_pages, bf16_pages):
        backend.plan(batch)
    assert flashinfer.kv_store_target(0) is None  # the pool's write quantizes the new K/V
    n = batch.num_tokens
    for layer in range(2):
        q = torch.randn(n, num_q_heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(n, num_kv_heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(n, num_kv_heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        got = flashinfer.forward(layer, q, k, v).float()
        exact = same_pages.forward(layer, q, k, v).float()
        unquantized = bf16_pages.forward(layer, q, k, v).float()
        error = (got - unquantized).abs()
        print(
            f"{case} {num_q_heads}/{num_kv_heads} layer {layer}: max |fi - torch, same pages| "
            f"{(got - exact).abs().max().item():.4f}; against bf16 pages max "
            f"{error.max().item():.4f} mean {error.mean().item():.5f}"
        )
        torch.testing.assert_close(got, exact, atol=2e-2, rtol=2e-2)
        assert error.max().item() < 0.25 and error.mean().item() < 0.02
    assert torch.equal(_bytes(fp8_pool.k_buffer), _bytes(twin.k_buffer))
    assert torch.equal(_bytes(fp8_pool.v_buffer), _bytes(twin.v_buffer))


def test_the_triton_page_copy_moves_fp8_pages_byte_exact() -> None:
    src, dst = (
        KVPool(3, 32, 16, 2, 128, torch.bfloat16, "cuda", scales=KVScales.ones(3)) for _ in "ab"
    )
    slots = torch.arange(32 * 16, device="cuda")
    for layer in range(3):
        k, v = torch.randn(2, len(slots), 2, 128, device="cuda").bfloat16()
        src.write(layer, slots, k, v)
    src_pages = torch.tensor([3, 4, 5, 20], dtype=torch.int32, device="cuda")
    dst_pages = torch.tensor([0, 9, 10, 31], dtype=torch.int32, device="cuda")
    ops.copy_pages(src.k_buffer, src.v_buffer, src_pages, dst.k_buffer, dst.v_buffer, dst_pages)
    for buf in ("k_buffer", "v_buffer"):
        got = _bytes(getattr(dst, buf))[:, dst_pages.long()]
        assert torch.equal(got, _bytes(getattr(src, buf))[:, src_pages.long()])
        assert not _bytes(getattr(dst, buf))[:, 1].any()  # a page not copied to


def _small_model(small_config_dir):
    pytest.importorskip("flashinfer")
    torch.manual_seed(0)
    return build_random_model(small_config_dir, seed=1)


def test_the_prefill_pieces_equal_the_eager_pass_with_fp8_pages(small_config_dir) -> None:
    model = _small_model(small_config_dir)
    kv = KVCacheConfig(32, 16, dtype="fp8_e4m3")
    eager = ModelRunner(model, kv, "flashinfer", ())
    pieces = ModelRunner(model, kv, "flashinfer", (), (16, 32))
    vocab = model.config.text.vocab_size
    for e_step, p_step in zip(_passes(eager, vocab), _passes(pieces, vocab), strict=True):
        expected = eager.forward(ForwardMode.EXTEND, e_step)
        got = pieces.forward(ForwardMode.EXTEND, p_step)
        diff, scale = (got - expected).abs().max().item(), expected.abs().max().item()
        print(f"pieces against eager, fp8 pages: max diff {diff:.4f} (logit scale {scale:.2f})")
        assert diff <= 0.05 * scale + 0.05  # the bf16 pieces' bound (test_prefill_graph.py)
    assert pieces.prefill_graphs is not None and pieces.prefill_graphs.num_replays == 2


def test_graph_decode_equals_eager_with_fp8_pages(small_config_dir) -> None:
    """``test_cuda_graph.py``'s teacher-forced comparison, on e4m3 pages."""
    graph = _compare(_small_model(small_config_dir), kv_dtype="fp8_e4m3")
    assert graph.kv_pool.dtype == FP8


def test_fp8_kv_logits_stay_close_to_bf16_kv(small_config_dir) -> None:
    """Teacher-forced decode of the small random model: e4m3 pages against bf16 pages."""
    model = _small_model(small_config_dir)
    vocab = model.config.text.vocab_size
    prompts = [torch.randint(0, vocab, (n,)).tolist() for n in PROMPT_LENS]
    runners = {
        kv_dtype: ModelRunner(model, KVCacheConfig(64, 16, dtype=kv_dtype), "flashinfer")
        for kv_dtype in ("auto", "fp8_e4m3")
    }
    ref_logits = [_prefill(runners["auto"], prompts)]
    ours_logits = [_prefill(runners["fp8_e4m3"], prompts)]
    seq_lens = list(PROMPT_LENS)
    for _ in range(NUM_STEPS):
        tokens = ref_logits[-1].argmax(-1).tolist()
        ref_logits.append(_decode(runners["auto"], tokens, seq_lens))
        ours_logits.append(_decode(runners["fp8_e4m3"], tokens, seq_lens))
        seq_lens = [n + 1 for n in seq_lens]
    ref, ours = torch.cat(ref_logits).float(), torch.cat(ours_logits).float()
    diff, scale = (ours - ref).abs().max().item(), ref.abs().max().item()
    cosine = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    top2 = ref.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > 2 * diff
    agree = ours.argmax(-1) == ref.argmax(-1)
    print(
        f"fp8 against bf16 KV: max diff {diff:.4f} of logits up to {scale:.2f}; cosine min "
        f"{cosine.min().item():.5f}; argmax agreement {agree.float().mean().item():.3f}"
    )
    assert 0 < diff < 0.06 * scale
    assert cosine.min().item() > 0.998
    assert bool(agree[decided].all())
