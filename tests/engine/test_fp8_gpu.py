"""FP8 on a GPU (SM 8.9+): ``torch._scaled_mm`` with row-wise scales against the bf16 matmul
and against the CPU reference of the same quantized operands, the tiny checkpoint's logits in
FP8 against fp32, and CUDA-graph decode equal to eager with FP8 weights.

Tolerances: e4m3 rounds weights and activations to 1/16 of themselves at most, which leaves a
relative (Frobenius) error of about 0.038 on Gaussian operands (the CPU reference gives 0.037
to 0.039 at these shapes): < 0.05 against bf16. Against the reference of the same e4m3
operands only the accumulation order and the bf16 output rounding differ: < 0.01.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.random_model import CONFIG_7B, build_random_model
from services.common.types import SamplingParams
from services.engine import fp8
from services.engine.offline import OfflinePipeline
from tests.conftest import TINY_MODEL_DIR
from tests.engine.test_cuda_graph import _compare
from tests.engine.test_model_parity import PROMPTS

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("fp8_gpu")]

# the 7B decoder's dense linears: (out, in) of q/k/v fused, o, gate/up fused (padded), down
SHAPES_7B = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("shape", SHAPES_7B)
@pytest.mark.parametrize("num_tokens", [1, 7, 256])
def test_scaled_mm_matches_bf16_and_the_reference(shape, num_tokens) -> None:
    torch.manual_seed(0)
    out_features, in_features = shape
    x = torch.randn(num_tokens, in_features, device="cuda").bfloat16()
    weight = (torch.randn(shape, device="cuda") * 0.02).bfloat16()
    bias = (torch.randn(out_features, device="cuda") * 0.01).bfloat16()
    weight_q, weight_scale = fp8.quantize_weight(weight)
    ours = fp8.linear(x, weight_q, weight_scale, bias)
    assert ours.dtype == torch.bfloat16 and ours.shape == (num_tokens, out_features)
    reference = fp8.linear(x.cpu(), weight_q.cpu(), weight_scale.cpu(), bias.cpu())
    bf16 = torch.nn.functional.linear(x, weight, bias)
    print(
        f"{shape} x {num_tokens}: vs reference {_relative(ours.cpu(), reference):.4f}, "
        f"vs bf16 {_relative(ours, bf16):.4f}"
    )
    assert _relative(ours.cpu(), reference) < 0.01
    assert _relative(ours, bf16) < 0.05


def test_a_misaligned_weight_is_refused_on_cuda() -> None:
    with pytest.raises(Exception, match="multiples of 16"):
        fp8.quantize_weight(torch.randn(40, 24, device="cuda").bfloat16())


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_fp8_logits_stay_close_to_fp32(name) -> None:
    """FP8 on the GPU (e4m3 weights and per-token activations, bf16 between the linears)
    against the same model in fp32 on the GPU, per prompt position.

    The bound is e4m3's rounding (the CPU's, with fp32 between the linears, in
    ``test_fp8.py``: min > 0.99) plus bf16's between them, lowest on image rows: min > 0.985,
    mean > 0.995 (measured: ``docs/benchmarks.md``, "Measurements cited by the code")."""

    def pipeline(dtype: str, quantization: str) -> OfflinePipeline:
        return OfflinePipeline.from_dir(
            TINY_MODEL_DIR,
            device="cuda",
            dtype=dtype,
            page_size=16,
            num_pages=512,
            quantization=quantization,
        )

    fp32, quantized = pipeline("float32", "none"), pipeline("bfloat16", "fp8")
    messages, images = PROMPTS[name]
    request = fp32.build_request(messages, images, SamplingParams())
    ref = fp32.engine.prompt_logits([request])[0].float()
    ours = quantized.engine.prompt_logits([request])[0].float()
    cosine = torch.nn.functional.cosine_similarity(ours, ref, dim=-1)
    agree = (ours.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(
        f"{name}: cosine min {cosine.min().item():.4f} mean {cosine.mean().item():.4f}, "
        f"top-1 agreement {agree:.3f}"
    )
    assert cosine.min().item() > 0.985
    assert cosine.mean().item() > 0.995
    assert agree >= 0.75


def _fp8_random_model(config_dir, seed: int):
    model = build_random_model(config_dir, seed=seed)
    model.model.quantize_fp8()
    torch.cuda.empty_cache()
    return model


def test_graph_decode_matches_eager_with_fp8_small(small_config_dir) -> None:
    pytest.importorskip("flashinfer")
    torch.manual_seed(0)
    _compare(_fp8_random_model(small_config_dir, seed=1))


def test_graph_decode_matches_eager_with_fp8_7b() -> None:
    pytest.importorskip("flashinfer")
    torch.manual_seed(0)
    model = _fp8_random_model(CONFIG_7B, seed=2)
    _compare(model)
    del model
    torch.cuda.empty_cache()
