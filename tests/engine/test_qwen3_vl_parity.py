"""The engine's Qwen3-VL and Qwen3-VL-MoE against transformers' on the bundled tiny
checkpoints (fp32, CPU): prompt logits, greedy generation, the vision tower with its
DeepStack rows, a batch through the MoE layers, and DeepStack's placement."""

from __future__ import annotations

import pytest
import torch

from services.common.paths import BUNDLED_MODEL
from services.common.types import SamplingParams
from services.engine.attention import ForwardMode
from services.engine.model.moe import SparseMoE
from tests.engine.test_model_parity import PROMPTS, TOLERANCE, hf_inputs

ASSETS = BUNDLED_MODEL.parent
ARCHS = ("tiny-qwen3-vl", "tiny-qwen3-vl-moe")


@pytest.fixture(scope="module", params=ARCHS)
def qwen3(request):
    """(offline pipeline, transformers model) of one tiny Qwen3-VL checkpoint."""
    from transformers import AutoModelForImageTextToText

    from services.engine.offline import OfflinePipeline

    model_dir = ASSETS / request.param
    hf = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)
    return OfflinePipeline.from_dir(model_dir, page_size=4, num_pages=2048), hf.eval()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_prompt_logits_match_transformers(name, qwen3):
    pipeline, hf = qwen3
    messages, images = PROMPTS[name]
    request = pipeline.build_request(messages, images, SamplingParams())
    assert len(request.spans) == len(images)
    if name == "two_images":
        assert len({s.grid_thw for s in request.spans}) == 2, "two different sizes"
    ours = pipeline.engine.prompt_logits([request])[0]
    with torch.no_grad():
        ref = hf(**hf_inputs(request)).logits[0].float()
    assert max_diff(ours, ref) < TOLERANCE


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_greedy_32_tokens_match_transformers(name, qwen3):
    pipeline, hf = qwen3
    messages, images = PROMPTS[name]
    params = SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)
    request = pipeline.build_request(messages, images, params)
    ours = pipeline.engine.generate([request])[0].token_ids
    with torch.no_grad():
        out = hf.generate(
            **hf_inputs(request),
            max_new_tokens=32,
            min_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
        )
    assert ours == out[0, len(request.prompt_ids) :].tolist()
    assert len(set(ours)) > 3, "a degenerate continuation would not test much"


@pytest.mark.parametrize("grids", [[(1, 8, 12)], [(2, 6, 10), (1, 4, 4)], [(1, 20, 6)]])
def test_vision_rows_and_deepstack_match_transformers(qwen3, grids):
    pipeline, hf = qwen3
    model = pipeline.engine.runner.model
    v, hidden = model.config.vision, model.config.text.hidden_size
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size**2
    generator = torch.Generator().manual_seed(len(grids))
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), patch_dim, generator=generator)
    with torch.inference_mode():
        ours = model.encode_images(pixels, grids)
        out = hf.model.visual(pixels, grid_thw=torch.tensor(grids))
    num_tokens = pixels.shape[0] // v.spatial_merge_size**2
    num_deepstack = len(v.deepstack_visual_indexes)
    assert num_deepstack == len(out.deepstack_features) == 2
    assert ours.shape == (num_tokens, hidden * (1 + num_deepstack))
    theirs = torch.cat([out.pooler_output, *out.deepstack_features], dim=1)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def routed_experts(model) -> tuple[list[SparseMoE], list[list[torch.Tensor]]]:
    """The MoE layers of ``model`` and, per layer, a list that collects each forward's picks."""
    layers = [m for m in model.modules() if isinstance(m, SparseMoE)]
    picks: list[list[torch.Tensor]] = [[] for _ in layers]
    for layer, seen in zip(layers, picks, strict=True):

        def hook(module, args, seen=seen):
            logits = module.gate(args[0])
            seen.append(torch.topk(logits, module.moe.num_experts_per_tok, dim=-1).indices)

        layer.register_forward_pre_hook(hook)
    return layers, picks


def test_moe_batch_matches_transformers_and_routes_tokens_apart():
    from transformers import AutoModelForImageTextToText

    from services.engine.offline import OfflinePipeline

    model_dir = ASSETS / "tiny-qwen3-vl-moe"
    pipeline = OfflinePipeline.from_dir(model_dir, page_size=4, num_pages=2048)
    hf = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    layers, picks = routed_experts(pipeline.engine.runner.model)
    assert len(layers) == 3, "layer 2 is in mlp_only_layers: dense"
    requests = [
        pipeline.build_request(PROMPTS[name][0], PROMPTS[name][1], SamplingParams(), name)
        for name in ("two_images", "text")
    ]
    ours = pipeline.engine.prompt_logits(requests)
    for request, logits in zip(requests, ours, strict=True):
        with torch.no_grad():
            ref = hf(**hf_inputs(request)).logits[0].float()
        assert max_diff(logits, ref) < TOLERANCE
    for seen in picks:
        (experts,) = seen  # one prefill step for the whole batch
        assert experts.shape[0] == sum(len(r.prompt_ids) for r in requests)
        assert len({tuple(sorted(row)) for row in experts.tolist()}) > 3, "tokens route apart"


def deepstack_logits(model, request, image_rows, layers=None) -> torch.Tensor:
    """All prompt logits of ``request`` with its image rows ``image_rows`` [N, hidden * 3]
    merged in, optionally with DeepStack applied after ``layers`` instead of (0, 1)."""
    from services.engine.model.rope import mrope_positions
    from services.engine.model_runner import KVCacheConfig, ModelRunner
    from services.engine.step_inputs import StepInput

    runner = ModelRunner(model, KVCacheConfig(256, 4))
    positions, _ = mrope_positions(len(request.prompt_ids), request.spans, 2)
    rows = [s.offset + i for s in request.spans for i in range(s.length)]
    runner.page_table.reserve(request.request_id, len(request.prompt_ids))
    step = StepInput(request.request_id, request.prompt_ids, positions, 0, image_rows, rows)
    saved = model.model.deepstack_layers
    if layers is not None:
        model.model.deepstack_layers = layers
    try:
        return runner.forward(ForwardMode.EXTEND, [step], all_logits=True)
    finally:
        model.model.deepstack_layers = saved


def test_deepstack_rows_dropped_moved_or_shifted_break_parity():
    """The parity above fails if DeepStack rows are dropped, added after the wrong decoder
    layers, or written one token off: each such variant is far from transformers."""
    from transformers import AutoModelForImageTextToText

    from services.engine.offline import OfflinePipeline

    model_dir = ASSETS / "tiny-qwen3-vl"
    pipeline = OfflinePipeline.from_dir(model_dir)
    hf = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model = pipeline.engine.runner.model
    hidden = model.config.text.hidden_size
    messages, images = PROMPTS["one_image"]
    request = pipeline.build_request(messages, images, SamplingParams())
    with torch.no_grad():
        ref = hf(**hf_inputs(request)).logits[0].float()
        rows = model.encode_images(torch.cat(request.pixel_values), [request.spans[0].grid_thw])
    assert max_diff(deepstack_logits(model, request, rows), ref) < TOLERANCE
    dropped = torch.cat([rows[:, :hidden], torch.zeros_like(rows[:, hidden:])], dim=1)
    shifted = torch.cat([rows[:, :hidden], rows[:, hidden:].roll(1, dims=0)], dim=1)
    variants = {
        "dropped": deepstack_logits(model, request, dropped),
        "wrong layer": deepstack_logits(model, request, rows, layers=(1, 2)),
        "one token off": deepstack_logits(model, request, shifted),
    }
    for name, logits in variants.items():
        assert max_diff(logits, ref) > 100 * TOLERANCE, name


@pytest.mark.parametrize("arch", ARCHS)
def test_qk_norm_takes_a_cp_ranks_empty_share(arch):
    """A CP rank whose share of a pass has no token runs the per-head q/k norm on zero rows."""
    from services.engine.loader import load_model

    attn = load_model(ASSETS / arch, components=("language",)).model.layers[0].self_attn
    width = (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim
    assert attn.norm_qk(torch.zeros(0, width)).shape == (0, width)
