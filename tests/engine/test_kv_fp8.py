"""FP8 KV cache (``--kv-cache-dtype fp8_e4m3``) on the CPU: the pool's quantize on write and
dequantize on read (exact on e4m3's grid, a scale applied both ways, clamping), the torch
backend and context-parallel attention reading and storing through it, the bytes the sizing
counts, the checkpoint's scales, and the tiny model's greedy decode against the default KV."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from services.common.errors import ModelLoadError
from services.common.types import SamplingParams
from services.engine.attention import AttentionBatch, ForwardMode
from services.engine.attention.context_parallel import ContextParallelAttention
from services.engine.attention.torch_backend import TorchAttentionBackend
from services.engine.config import ModelConfig
from services.engine.kv_cache import KVPool, KVScales, pool_scales
from services.engine.kv_sizing import kv_element_size
from services.engine.llm import LLMEngine
from services.engine.loader import load_model
from services.engine.model_runner import KVCacheConfig, ModelRunner
from services.engine.offline import OfflinePipeline
from services.engine.step_inputs import StepInput
from tests.conftest import TINY_MODEL_DIR
from tests.engine.logit_closeness import closeness
from tests.engine.test_model_parity import PROMPTS
from tests.engine.test_prefill_graph import _passes

FP8 = torch.float8_e4m3fn
LAYERS, PAGES, PAGE, HEADS, DIM = 3, 6, 4, 2, 8
SCALES = KVScales(k=(1.0, 0.25, 3.0), v=(1.0, 4.0, 0.1))
# e4m3 values: the largest, normals, the smallest normal and subnormal, zero
GRID = [448.0, -448.0, 240.0, 1.0, -0.5, 3.5, 0.015625, 2.0**-9, 0.0, -6.0]


def _pool(scales: KVScales | None = SCALES, dtype: torch.dtype = torch.float32) -> KVPool:
    return KVPool(LAYERS, PAGES, PAGE, HEADS, DIM, dtype, "cpu", scales=scales)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)  # fp8 tensors compare as their bytes (no torch.equal for e4m3)


def _tokens(values: torch.Tensor) -> torch.Tensor:
    """[n, HEADS, DIM] tokens, token ``i`` all ``values[i]``."""
    return values[:, None, None].expand(-1, HEADS, DIM).contiguous()


def test_values_on_the_e4m3_grid_times_the_scale_round_trip_bit_exact() -> None:
    pool = _pool()
    n = len(GRID)
    grid = torch.tensor(GRID)[torch.arange(n * HEADS * DIM) % n].view(n, HEADS, DIM)
    slots = torch.tensor([3, 0, 23, 7, 12, 5, 1, 19, 8, 22])
    for layer in range(LAYERS):
        k_scale, v_scale = SCALES.k[layer], SCALES.v[layer]
        pool.write(layer, slots, grid * k_scale, -grid * v_scale)
        k, v = pool.read(layer, slots)
        assert k.dtype == v.dtype == torch.float32
        assert torch.equal(k, grid * k_scale) and torch.equal(v, -grid * v_scale)
        # the pages hold value / scale: the grid itself, whatever the scale
        assert torch.equal(_bytes(pool.k_slots(layer)[slots]), _bytes(grid.to(FP8)))
        assert torch.equal(_bytes(pool.v_slots(layer)[slots]), _bytes((-grid).to(FP8)))
    assert pool.k_buffer.dtype == FP8 and pool.value_dtype == torch.float32


def test_a_scale_divides_on_write_and_multiplies_on_read() -> None:
    torch.manual_seed(0)
    pool = _pool()
    values = torch.randn(5, HEADS, DIM)
    slots = torch.tensor([2, 9, 4, 17, 11])
    pool.write(1, slots, values, values)  # K scale 0.25, V scale 4.0
    stored_k, stored_v = pool.k_slots(1)[slots], pool.v_slots(1)[slots]
    assert torch.equal(_bytes(stored_k), _bytes((values / 0.25).to(FP8)))
    assert torch.equal(_bytes(stored_v), _bytes((values / 4.0).to(FP8)))
    k, v = pool.read(1, slots)
    assert torch.equal(k, stored_k.float() * 0.25) and torch.equal(v, stored_v.float() * 4.0)
    # e4m3 keeps 3 mantissa bits: each value within half a step (1/16) of itself, or of the
    # subnormal step (2^-9 of the scale)
    for got, scale in ((k, 0.25), (v, 4.0)):
        bound = torch.maximum(values.abs() / 16, torch.full_like(values, scale * 2.0**-10))
        assert bool(((got - values).abs() <= bound * (1 + 1e-6)).all())
    assert not torch.equal(k, v)  # the two scales round differently
    untouched = torch.ones(PAGES * PAGE, dtype=torch.bool)
    untouched[slots] = False
    assert not _bytes(pool.k_slots(1)[untouched]).any() and not _bytes(pool.k_slots(0)).any()


def test_values_past_the_e4m3_range_clamp_to_448_times_the_scale() -> None:
    pool = _pool()
    values = torch.tensor([100.0, -100.0, 40.0, 1e30, float("inf"), -float("inf")])
    slots = torch.arange(len(values))
    pool.write(2, slots, _tokens(values), _tokens(values))  # scales: K 3.0, V 0.1
    k, v = pool.read(2, slots)
    # V: 100 / 0.1 = 1000 is past 448, and so are the rest but 400 (e4m3 rounds it to 384)
    stored = torch.tensor([448.0, -448.0, 384.0, 448.0, 448.0, -448.0])
    assert torch.equal(v, _tokens(stored * torch.tensor(0.1)))
    # K: 100 / 3 and 40 / 3 are in range; 1e30 and the infinities clamp
    in_range = (values[:3] / 3.0).to(FP8).float()
    assert torch.equal(k[:3], _tokens(in_range * 3.0))
    assert torch.equal(k[3:], _tokens(torch.tensor([448.0, 448.0, -448.0]) * 3.0))


def test_an_unquantized_pool_stores_and_reads_its_dtype_unchanged() -> None:
    pool = _pool(scales=None, dtype=torch.bfloat16)
    values = torch.randn(4, HEADS, DIM)
    slots = torch.tensor([1, 6, 3, 20])
    pool.write(0, slots, values, 2 * values)
    k, v = pool.read(0, slots)
    assert pool.dtype == pool.value_dtype == torch.bfloat16 and k.dtype == torch.bfloat16
    assert torch.equal(k, values.bfloat16()) and torch.equal(v, (2 * values).bfloat16())
    assert pool.store_target(0, slots) is not None and _pool().store_target(0, slots) is None


def test_the_torch_backend_attends_over_the_dequantized_pages() -> None:
    """An FP8 pool and an fp32 pool holding its pages' ``page * scale`` give the same outputs."""
    torch.manual_seed(1)
    fp8_pool, ref_pool = _pool(), _pool(scales=None)
    kwargs = {"num_q_heads": 4, "num_kv_heads": HEADS, "head_dim": DIM}
    ours = TorchAttentionBackend(fp8_pool, **kwargs)
    reference = TorchAttentionBackend(ref_pool, **kwargs)
    slots = torch.arange(11)
    batch = AttentionBatch(ForwardMode.EXTEND, [7, 4], [7, 4], [[0, 1], [2]], PAGE, slots)
    for backend in (ours, reference):
        backend.plan(batch)
    for layer in range(LAYERS):
        q, k, v = torch.randn(11, 4, DIM), torch.randn(11, HEADS, DIM), torch.randn(11, HEADS, DIM)
        got = ours.forward(layer, q, k, v)
        ref_pool.write(layer, slots, *fp8_pool.read(layer, slots))
        expected = reference.forward(layer, q, k, v, kv_stored=True)
        assert torch.equal(got, expected)
        exact = TorchAttentionBackend(_pool(scales=None), **kwargs)
        exact.plan(batch)
        error = (got - exact.forward(layer, q, k, v)).abs().max().item()
        print(f"layer {layer}: max |fp8 - exact| {error:.4f}")
        assert 0 < error < 0.2  # e4m3's step on unit-normal K and V: 0.07 to 0.13 measured


class _OneRankExchange:
    """A context-parallel exchange of a world of one: the gathered rows are this rank's."""

    def __init__(self, num_tokens: int) -> None:
        self.sizes, self.dtype, self.device = [num_tokens], torch.float32, torch.device("cpu")

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        return rows


def test_context_parallel_attention_stores_through_the_pool_quantizing() -> None:
    torch.manual_seed(2)
    kwargs = {"num_q_heads": 4, "num_kv_heads": HEADS, "head_dim": DIM}
    cp_pool, plain_pool = _pool(), _pool()
    cp = ContextParallelAttention(TorchAttentionBackend(cp_pool, **kwargs), cp_pool)
    plain = TorchAttentionBackend(plain_pool, **kwargs)
    slots = torch.tensor([4, 5, 6, 7, 8, 9])
    batch = AttentionBatch(ForwardMode.EXTEND, [6], [6], [[1, 2]], PAGE, slots)
    cp.begin_pass(_OneRankExchange(6), slots)  # type: ignore[arg-type]
    cp.plan(batch)
    plain.plan(batch)
    for layer in range(LAYERS):
        q, k, v = torch.randn(6, 4, DIM), torch.randn(6, HEADS, DIM), torch.randn(6, HEADS, DIM)
        assert torch.equal(cp.forward(layer, q, k, v), plain.forward(layer, q, k, v))
    assert torch.equal(_bytes(cp_pool.k_buffer), _bytes(plain_pool.k_buffer))
    assert torch.equal(_bytes(cp_pool.v_buffer), _bytes(plain_pool.v_buffer))
    assert _bytes(cp_pool.k_buffer).any()


def test_pool_scales_per_flag_and_device(monkeypatch) -> None:
    cpu = torch.device("cpu")
    assert pool_scales("auto", SCALES, LAYERS, cpu) is None
    assert pool_scales("fp8_e4m3", None, LAYERS, cpu) == KVScales.ones(LAYERS)
    assert pool_scales("fp8_e4m3", SCALES, LAYERS, cpu) == SCALES
    with pytest.raises(ValueError, match="unsupported --kv-cache-dtype 'fp8_e5m2'"):
        pool_scales("fp8_e5m2", None, LAYERS, cpu)
    with pytest.raises(ValueError, match="CUDA or the CPU, not on meta"):
        pool_scales("fp8_e4m3", None, LAYERS, torch.device("meta"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"fp8_e4m3 needs .*\(SM 8\.9\+.*A100 is SM 8\.0"):
        pool_scales("fp8_e4m3", None, LAYERS, torch.device("cuda:0"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert pool_scales("fp8_e4m3", None, LAYERS, torch.device("cuda:0")) == KVScales.ones(LAYERS)
    with pytest.raises(ValueError, match="positive and finite"):
        KVScales((1.0, 0.0), (1.0, 1.0))


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_the_sizing_counts_the_bytes_the_pool_holds(kv_cache_dtype) -> None:
    model = load_model(TINY_MODEL_DIR, "cpu", "bfloat16", components=("language",))
    runner = ModelRunner(model, KVCacheConfig(8, 4, dtype=kv_cache_dtype), "torch", ())
    pool = runner.kv_pool
    assert runner.pool_size.page_bytes == 2 * pool.num_layers * pool.page_nbytes
    assert pool.k_buffer.element_size() == kv_element_size(kv_cache_dtype, 2)
    assert pool.page_nbytes == PAGE * pool.num_kv_heads * pool.head_dim * (
        1 if kv_cache_dtype == "fp8_e4m3" else 2
    )
    assert pool.value_dtype == torch.bfloat16
    assert pool.dtype == (FP8 if kv_cache_dtype == "fp8_e4m3" else torch.bfloat16)


def test_the_prefill_pieces_store_fp8_pages_as_the_eager_pass() -> None:
    """The prefill graphs' pieces (run eagerly on the CPU) store through the pool's ``write``
    (the rotary kernel's store cannot quantize): the same pages and logits as the eager pass."""
    model = load_model(TINY_MODEL_DIR, "cpu", "float32", components=("language",))
    kv = KVCacheConfig(32, 16, dtype="fp8_e4m3")
    eager, pieces = ModelRunner(model, kv, "torch", ()), ModelRunner(model, kv, "torch", (), (32,))
    assert pieces.prefill_graphs is not None
    vocab = model.config.text.vocab_size
    for e_step, p_step in zip(_passes(eager, vocab), _passes(pieces, vocab), strict=True):
        expected = eager.forward(ForwardMode.EXTEND, e_step)
        got = pieces.forward(ForwardMode.EXTEND, p_step)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    lens = (5, 33, 9)  # _passes' prompts, every position written
    written = {
        runner: torch.cat([runner.page_table.slots(f"r{i}", 0, n) for i, n in enumerate(lens)])
        for runner in (eager, pieces)
    }
    for layer in range(model.config.text.num_hidden_layers):
        got_k, got_v = pieces.kv_pool.read(layer, written[pieces])
        expected_k, expected_v = eager.kv_pool.read(layer, written[eager])
        torch.testing.assert_close(got_k, expected_k, rtol=0, atol=1e-5)
        torch.testing.assert_close(got_v, expected_v, rtol=0, atol=1e-5)
        assert bool(got_k.abs().amax() > 0)


# --- the tiny model ------------------------------------------------------------------------

NUM_STEPS = 24


@pytest.fixture(scope="module")
def fp8_kv_pipeline() -> OfflinePipeline:
    return OfflinePipeline.from_dir(
        TINY_MODEL_DIR, page_size=4, num_pages=512, kv_cache_dtype="fp8_e4m3"
    )


def _decode_logits(pipeline, request, tokens: list[int] | None = None):
    """Logits ``[1 + NUM_STEPS, vocab]`` of the prompt's last position and each decode step,
    fed ``tokens`` (teacher-forced) or the greedy choice; and the tokens fed."""
    engine, runner = pipeline.engine, pipeline.engine.runner
    runner.page_table.reserve(request.request_id, len(request.prompt_ids) + NUM_STEPS)
    try:
        step, delta = engine.prefill_input(request, engine.image_embeddings([request])[0])
        logits, fed = [runner.forward(ForwardMode.EXTEND, [step])[0]], []
        for i in range(NUM_STEPS):
            fed.append(int(logits[-1].argmax()) if tokens is None else tokens[i])
            seq_len = len(request.prompt_ids) + i
            position = torch.full((3, 1), seq_len + delta, dtype=torch.long)
            inputs = [StepInput(request.request_id, [fed[-1]], position, seq_len)]
            logits.append(runner.forward(ForwardMode.DECODE, inputs)[0])
        return torch.stack(logits), fed
    finally:
        runner.page_table.release(request.request_id)


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_greedy_decode_with_fp8_kv_stays_close_to_the_default(
    name, pipeline, fp8_kv_pipeline
) -> None:
    """Teacher-forced on the default KV's greedy tokens (so one near-tie does not make the two
    runs drift): measured on the fp32 tiny model, cosine >= 0.9994 per step, max |fp8 - default|
    <= 0.133 on logits up to 4.9 (3.1%), the same argmax on 92-100% of the 25 steps, each flip
    where the default's top two are within 0.035. Asserted: cosine > 0.999, the change under
    5% of the logit range, the argmax on >= 85% of the steps, flips only under 2% of the range."""
    messages, images = PROMPTS[name]
    request = pipeline.build_request(messages, images, SamplingParams(), request_id=name)
    ref, tokens = _decode_logits(pipeline, request)
    ours, _ = _decode_logits(fp8_kv_pipeline, request, tokens)
    c = closeness(ours, ref)
    print(f"{name}: {c.summary('fp8 - default')}")
    assert c.cosine_min > 0.999
    assert 0 < c.max_diff < 0.05 * c.scale
    assert c.agreement >= 0.85
    assert bool((c.flipped_leads < 0.02 * c.scale).all())


def _checkpoint_with_kv_scales(path, scales: dict[str, torch.Tensor], config_extra=None):
    """The tiny checkpoint in ``path`` with ``scales`` in a file of their own."""
    path.mkdir(exist_ok=True)
    for file in TINY_MODEL_DIR.iterdir():
        if file.is_file():
            shutil.copy(file, path / file.name)
    save_file(scales, str(path / "kv_scales.safetensors"))
    if config_extra:
        raw = json.loads((TINY_MODEL_DIR / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**raw, **config_extra}))
    return path


# compressed-tensors quantizing only the KV cache: its weights are the unquantized ones
KV_ONLY_CONFIG = {
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "config_groups": {},
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"},
    }
}


def test_the_checkpoints_scales_reach_the_pool_and_are_used(tmp_path, pipeline) -> None:
    """Scales of about max|K| / 448 (the tiny model's K and V stay under 4), in the nested
    transformers 5 names for layer 0's K and V and one ``kv_scale`` for each other layer: the
    pages use e4m3's range (up to ~420, not ~4 as with 1.0), and decode stays as close (cosine
    0.9988 measured; 0.9989 to 0.9999 over scales from 0.009 to 1.0 and the three prompts: the
    rounding moves, not its size)."""
    scales = {
        "model.language_model.layers.0.self_attn.k_scale": torch.tensor(0.009),
        "model.language_model.layers.0.self_attn.v_scale": torch.tensor([0.011]),
        **{f"model.layers.{i}.self_attn.kv_scale": torch.tensor(0.01) for i in range(1, 4)},
    }
    model_dir = _checkpoint_with_kv_scales(tmp_path, scales, KV_ONLY_CONFIG)
    model = load_model(model_dir, components=("language",))
    assert model.config.text.num_hidden_layers == 4 and model.kv_scales is not None
    assert model.kv_scales.k == pytest.approx((0.009, 0.01, 0.01, 0.01), rel=1e-7)
    assert model.kv_scales.v == pytest.approx((0.011, 0.01, 0.01, 0.01), rel=1e-7)
    runner = ModelRunner(model, KVCacheConfig(512, 4, dtype="fp8_e4m3"), "torch", ())
    assert runner.kv_pool.scales == model.kv_scales
    scaled = OfflinePipeline(pipeline.text, pipeline.images, LLMEngine(runner))
    messages, images = PROMPTS["text"]
    request = pipeline.build_request(messages, images, SamplingParams(), request_id="scaled")
    ref, tokens = _decode_logits(pipeline, request)
    ours, _ = _decode_logits(scaled, request, tokens)
    cosine = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    print(f"checkpoint scales: cosine min {cosine.min().item():.5f}")
    assert cosine.min().item() > 0.998
    assert runner.kv_pool.k_buffer.float().abs().amax().item() > 100
    auto = ModelRunner(model, KVCacheConfig(8, 4), "torch", ())  # scales unused with auto
    assert auto.kv_pool.scales is None and auto.kv_pool.dtype == torch.float32


def test_malformed_kv_scales_are_refused(tmp_path) -> None:
    per_head = {"model.layers.0.self_attn.k_scale": torch.tensor([0.1, 0.2])}
    with pytest.raises(ModelLoadError, match=r"k_scale' must be one positive finite number"):
        load_model(_checkpoint_with_kv_scales(tmp_path / "a", per_head), components=("language",))
    partial = {"model.layers.0.self_attn.kv_scale": torch.tensor(0.1)}
    with pytest.raises(ModelLoadError, match=r"do not cover its 4 layers: missing \['1.k_scale'"):
        load_model(_checkpoint_with_kv_scales(tmp_path / "b", partial), components=("language",))


def test_only_a_kv_cache_quantization_config_loads() -> None:
    raw = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    assert ModelConfig.from_dict({**raw, **KV_ONLY_CONFIG}).checkpoint_quantization == ""
    weights = {**KV_ONLY_CONFIG["quantization_config"], "config_groups": {"group_0": {}}}
    config = ModelConfig.from_dict({**raw, "quantization_config": weights})
    assert config.checkpoint_quantization == "compressed-tensors"
