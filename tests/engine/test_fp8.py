"""FP8 weights (``--quantization fp8``, services/engine/fp8.py) on the CPU: quantize/dequantize
bounds, the reference matmul against torch's own ``_scaled_mm``, which layers the loader
quantizes, the logits of the bundled tiny checkpoint against fp32, and the flag reaching the
model of a prefill and a decode rank."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from services.common.errors import ModelLoadError
from services.common.types import SamplingParams
from services.engine import fp8
from services.engine.loader import load_model
from services.engine.model.layers import GatedMLP
from services.engine.offline import OfflinePipeline
from tests.conftest import TINY_MODEL_DIR
from tests.engine.logit_closeness import closeness
from tests.engine.test_model_parity import PROMPTS

E4M3_HALF_STEP = 2.0**-4  # e4m3 has 3 mantissa bits: a normal rounds within 1/16 of itself
E4M3_SUBNORMAL_HALF_STEP = 2.0**-10  # below 2^-6 the grid is 2^-9 (in the scaled domain)


def _rows() -> torch.Tensor:
    """Rows whose magnitudes span 1e-6 to 1e4, with outliers, in fp32."""
    torch.manual_seed(0)
    t = torch.randn(64, 96) * torch.logspace(-6, 4, 64).unsqueeze(1)
    t[3, 7] *= 50.0
    return t


def test_round_trip_is_within_the_e4m3_step_of_each_element() -> None:
    t = _rows()
    q, scale = fp8.quantize_rows(t)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (64, 1)
    bound = torch.maximum(t.abs() * E4M3_HALF_STEP, scale * E4M3_SUBNORMAL_HALF_STEP)
    error = (fp8.dequantize_rows(q, scale) - t).abs()
    assert bool((error <= bound * (1 + 1e-6)).all()), (error / bound).max()
    worst = (error / t.abs().clamp(min=1e-30))[t.abs() > scale * 2**-6]
    assert worst.max().item() > E4M3_HALF_STEP / 4  # the bound is tight, not vacuous


def test_scales_come_from_each_channels_max() -> None:
    t = _rows()
    q, scale = fp8.quantize_rows(t)
    torch.testing.assert_close(scale[:, 0], t.abs().amax(-1) / 448.0, rtol=1e-7, atol=0)
    assert bool((q.float().abs().amax(-1) == 448.0).all())  # each row's largest fills the range
    torch.testing.assert_close(fp8.dequantize_rows(q, scale).abs().amax(-1), t.abs().amax(-1))


def test_values_on_the_e4m3_grid_round_trip_exactly() -> None:
    grid = torch.tensor([448.0, -448.0, 1.0, -0.5, 0.015625, 2.0**-9, 0.0, 240.0, -3.5])
    t = torch.stack([grid * 2.0**-12, grid * 8.0])
    q, scale = fp8.quantize_rows(t)
    assert torch.equal(fp8.dequantize_rows(q, scale), t)


def test_zeros_and_all_zero_channels() -> None:
    t = torch.zeros(3, 32)
    t[1, 5] = 2.0
    weight_q, weight_scale = fp8.quantize_weight(t)
    assert bool(torch.isfinite(weight_scale).all()) and bool((weight_scale > 0).all())
    assert torch.equal(fp8.dequantize_rows(weight_q, weight_scale), t)
    x = torch.randn(4, 32)
    x[2] = 0.0  # an all-zero token
    bias = torch.tensor([0.5, -1.0, 2.0])
    out = fp8.linear(x, weight_q, weight_scale, bias)
    assert torch.equal(out[:, 0], torch.full((4,), 0.5))  # zero channel: the bias alone
    assert torch.equal(out[2], bias)
    assert fp8.linear(torch.zeros(0, 32), weight_q, weight_scale).shape == (0, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matmul_equals_torch_scaled_mm(dtype) -> None:
    """The layout the CUDA path hands ``_scaled_mm`` (row-wise scales [T, 1] and [1, out], the
    weight transposed) gives the CPU reference's result."""
    torch.manual_seed(1)
    x = torch.randn(9, 64).to(dtype)
    weight_q, weight_scale = fp8.quantize_weight(torch.randn(48, 64))
    x_q, x_scale = fp8.quantize_rows(x)
    theirs = torch._scaled_mm(
        x_q, weight_q.t(), x_scale, weight_scale.view(1, -1), out_dtype=torch.float32
    )
    torch.testing.assert_close(fp8.linear(x, weight_q, weight_scale), theirs.to(dtype))


def test_check_fp8_device_refuses_what_cannot_run_it(monkeypatch) -> None:
    cuda = torch.device("cuda:0")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"SM 8\.9\+.*A100 is SM 8\.0"):
        fp8.check_fp8_device(cuda, torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    fp8.check_fp8_device(cuda, torch.bfloat16)
    with pytest.raises(ValueError, match="needs --dtype bfloat16"):
        fp8.check_fp8_device(cuda, torch.float16)
    with pytest.raises(ValueError, match="CUDA or the CPU"):
        fp8.check_fp8_device(torch.device("meta"), torch.bfloat16)
    fp8.check_fp8_device(torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def fp8_pipeline() -> OfflinePipeline:
    return OfflinePipeline.from_dir(TINY_MODEL_DIR, page_size=4, num_pages=2048, quantization="fp8")


def _dense_linears(language) -> list:
    return [
        linear
        for layer in language.layers
        for linear in (
            layer.self_attn.q_proj,
            layer.self_attn.k_proj,
            layer.self_attn.v_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_proj,
            layer.mlp.up_proj,
            layer.mlp.down_proj,
        )
    ]


def test_the_loader_quantizes_the_dense_linears_only(fp8_pipeline) -> None:
    model = fp8_pipeline.engine.runner.model
    full = load_model(TINY_MODEL_DIR, components=("language",))
    originals = dict(full.named_parameters())
    for name, param in model.named_parameters():
        is_dense = name.startswith("model.layers.") and name.endswith("proj.weight")
        if not is_dense:  # embedding, norms, biases, LM head, the vision tower
            assert param.dtype == torch.float32, name
            continue
        assert param.dtype == torch.float8_e4m3fn, name
        module = model.get_submodule(name.removesuffix(".weight"))
        restored = fp8.dequantize_rows(param, module.weight_scale)
        original = originals[name]
        bound = torch.maximum(
            original.abs() * E4M3_HALF_STEP,
            module.weight_scale[:, None] * E4M3_SUBNORMAL_HALF_STEP,
        )
        assert bool(((restored - original).abs() <= bound * (1 + 1e-6)).all()), name
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        assert isinstance(mlp, GatedMLP)
        assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()  # views, not copies
        q_rows = attn.q_proj.out_features
        assert attn.k_proj.weight_scale.data_ptr() == attn.qkv_scale[q_rows:].data_ptr()
        assert mlp.down_proj.weight_scale is mlp.down_scale


def test_dense_linear_bytes_drop_to_a_quarter_of_fp32_plus_scales(fp8_pipeline) -> None:
    fp32 = load_model(TINY_MODEL_DIR, components=("language",))
    quantized = fp8_pipeline.engine.runner.model

    def held(language, attrs):  # the tensors the matmuls read (padded MLP rows included)
        return sum(
            getattr(module, a).numel() * getattr(module, a).element_size()
            for layer in language.layers
            for module, names in ((layer.self_attn, attrs[0]), (layer.mlp, attrs[1]))
            for a in names
        )

    weights = (("qkv_weight",), ("gate_up_weight", "down_weight"))
    scales = (("qkv_scale",), ("gate_up_scale", "down_scale"))
    before = held(fp32.model, weights)
    after = held(quantized.model, weights)
    assert after * 4 == before
    assert held(quantized.model, scales) * 4 < after  # one fp32 per output channel


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_fp8_logits_stay_close_to_fp32(name, pipeline, fp8_pipeline) -> None:
    """Weights and activations rounded to e4m3 (a 1/16 relative step) over the tiny model's
    64-wide dot products: per position, cosine similarity of the logits > 0.99; top-1 agreement
    on at least 3/4 of the positions, and a flip only where fp32's lead over its runner-up is a
    near-tie (under a tenth of the logit range: random tiny weights leave many)."""
    messages, images = PROMPTS[name]
    request = pipeline.build_request(messages, images, SamplingParams())
    ref = pipeline.engine.prompt_logits([request])[0]
    ours = fp8_pipeline.engine.prompt_logits([request])[0]
    c = closeness(ours, ref)
    print(f"{name}: {c.summary('fp8 - fp32')}")
    assert c.cosine_min > 0.99
    assert c.agreement >= 0.75
    assert bool((c.flipped_leads < 0.1 * c.scale).all())
    assert 0 < c.max_diff < 0.25 * c.scale  # quantized, and not wildly so


def test_a_quantized_checkpoint_is_refused(tmp_path) -> None:
    for path in TINY_MODEL_DIR.iterdir():
        if path.is_file():
            shutil.copy(path, tmp_path / path.name)
    raw = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=r"quantized checkpoint \(quantization_config: fp8"):
        load_model(tmp_path, components=("language",))


def test_an_unknown_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported quantization 'int4'"):
        load_model(TINY_MODEL_DIR, quantization="int4")
