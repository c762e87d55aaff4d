"""The engine's Qwen2.5-VL against transformers' on the bundled checkpoint (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from services.common.types import SamplingParams
from tests.conftest import image_bytes

TOLERANCE = 1e-4

PROMPTS = {
    "text": ([{"role": "user", "content": "Tell me a short story about a lighthouse."}], []),
    "one_image": (
        [
            {
                "role": "user",
                "content": [{"type": "image"}, {"type": "text", "text": "What is in the picture?"}],
            }
        ],
        [image_bytes(300, 97, seed=1)],
    ),
    "two_images": (
        [
            {"role": "system", "content": "You compare pictures."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "First:"},
                    {"type": "image"},
                    {"type": "text", "text": "second:"},
                    {"type": "image"},
                    {"type": "text", "text": "How do they differ?"},
                ],
            },
        ],
        [image_bytes(224, 224, seed=2), image_bytes(90, 200, seed=3, fmt="JPEG")],
    ),
}


def hf_inputs(request) -> dict[str, torch.Tensor]:
    """transformers' forward inputs for an engine request (same token ids and pixels)."""
    input_ids = torch.tensor([request.prompt_ids])
    inputs = {"input_ids": input_ids}
    if request.spans:
        inputs["pixel_values"] = torch.cat(request.pixel_values)
        inputs["image_grid_thw"] = torch.tensor([s.grid_thw for s in request.spans])
        inputs["mm_token_type_ids"] = (input_ids == 5).int()
    return inputs


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_prompt_logits_match_transformers(name, pipeline, hf_model):
    messages, images = PROMPTS[name]
    request = pipeline.build_request(messages, images, SamplingParams())
    assert len(request.spans) == len(images)
    ours = pipeline.engine.prompt_logits([request])[0]
    with torch.no_grad():
        ref = hf_model(**hf_inputs(request)).logits[0].float()
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("name", sorted(PROMPTS))
def test_greedy_32_tokens_match_transformers(name, pipeline, hf_model):
    messages, images = PROMPTS[name]
    params = SamplingParams(temperature=0.0, max_new_tokens=32, ignore_eos=True)
    request = pipeline.build_request(messages, images, params)
    ours = pipeline.engine.generate([request])[0].token_ids
    with torch.no_grad():
        out = hf_model.generate(
            **hf_inputs(request),
            max_new_tokens=32,
            min_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
        )
    ref = out[0, len(request.prompt_ids) :].tolist()
    assert len(ours) == 32
    assert ours == ref
    assert len(set(ours)) > 3, "a degenerate continuation would not test much"
