"""Paged KV: incremental decode equals full recompute; batching does not change any request's logits."""

from __future__ import annotations

import torch

from services.common.types import SamplingParams
from services.engine.attention import ForwardMode
from services.engine.model.rope import mrope_positions
from services.engine.step_inputs import StepInput
from tests.conftest import image_bytes

TOLERANCE = 1e-4


def one_image_request(pipeline, request_id: str, text: str, size=(120, 80), seed=0):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    return pipeline.build_request(
        messages, [image_bytes(*size, seed=seed)], SamplingParams(), request_id
    )


def text_request(pipeline, request_id: str, text: str):
    return pipeline.build_request(
        [{"role": "user", "content": text}], [], SamplingParams(), request_id
    )


def test_incremental_paged_decode_equals_full_recompute(pipeline):
    engine, runner = pipeline.engine, pipeline.engine.runner
    request = one_image_request(pipeline, "inc", "Describe it.")
    assert runner.page_size < len(request.prompt_ids)
    merge = engine.config.vision.spatial_merge_size
    free_before = runner.page_manager.num_free_pages
    try:
        runner.page_table.reserve("inc", len(request.prompt_ids))
        step, delta = engine.prefill_input(request, engine.image_embeddings([request])[0])
        logits = runner.forward(ForwardMode.EXTEND, [step])
        tokens, step_logits = [], [logits[0]]
        for _ in range(12):
            tokens.append(int(step_logits[-1].argmax()))
            seq_len = len(request.prompt_ids) + len(tokens) - 1
            runner.page_table.reserve("inc", seq_len + 1)
            position = torch.full((3, 1), seq_len + delta, dtype=torch.long)
            out = runner.forward(
                ForwardMode.DECODE, [StepInput("inc", [tokens[-1]], position, seq_len)]
            )
            step_logits.append(out[0])
    finally:
        runner.page_table.release("inc")
    assert runner.page_manager.num_free_pages == free_before

    full = type(request)(
        "full", request.prompt_ids + tokens, request.params, request.spans, request.pixel_values
    )
    recomputed = engine.prompt_logits([full])[0]
    prompt_len = len(request.prompt_ids)
    expected = recomputed[prompt_len - 1 :]
    assert torch.stack(step_logits).shape == expected.shape
    assert (torch.stack(step_logits) - expected).abs().max().item() < TOLERANCE
    # the decode positions are those of the full sequence
    positions, _ = mrope_positions(len(full.prompt_ids), full.spans, merge)
    assert (
        positions[:, prompt_len:].eq(torch.arange(prompt_len, len(full.prompt_ids)) + delta).all()
    )


def test_batched_prefill_equals_each_alone(pipeline):
    engine = pipeline.engine
    requests = [
        text_request(pipeline, "t1", "Hi."),
        one_image_request(pipeline, "i1", "What colour dominates this image?", (300, 97), seed=4),
        text_request(pipeline, "t2", "Write three lines about the sea and the wind over it."),
        one_image_request(pipeline, "i2", "Count the shapes.", (64, 200), seed=5),
    ]
    assert len({len(r.prompt_ids) for r in requests}) == len(requests)
    batched = engine.prompt_logits(requests)
    for request, logits in zip(requests, batched, strict=True):
        alone = engine.prompt_logits([request])[0]
        assert (logits - alone).abs().max().item() < TOLERANCE


def test_batched_generate_equals_each_alone(pipeline):
    engine = pipeline.engine
    params = [
        SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True) for n in (5, 17, 9)
    ]
    params.append(
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=11, ignore_eos=True)
    )
    requests = [
        text_request(pipeline, "g1", "One."),
        one_image_request(pipeline, "g2", "Two, with a picture.", (100, 100), seed=6),
        text_request(pipeline, "g3", "Three is a longer prompt than the others are."),
        one_image_request(pipeline, "g4", "Four, sampled with a seed.", (50, 80), seed=8),
    ]
    for request, p in zip(requests, params, strict=True):
        request.params = p
    free_before = engine.runner.page_manager.num_free_pages
    batched = engine.generate(requests)
    alone = [engine.generate([r])[0] for r in requests]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    assert [len(o.token_ids) for o in batched] == [5, 17, 9, 11]
    assert engine.runner.page_manager.num_free_pages == free_before


def test_decode_with_device_token_ids_equals_host_ids(pipeline):
    """``forward(..., input_ids=tensor)`` (a loop feeding the previous argmax back) = StepInput ids."""
    engine, runner = pipeline.engine, pipeline.engine.runner
    requests = [
        text_request(pipeline, f"dev{i}", text)
        for i, text in enumerate(["Hi there.", "Count to three."])
    ]
    try:
        steps = []
        for request in requests:
            runner.page_table.reserve(request.request_id, len(request.prompt_ids) + 1)
            steps.append(engine.prefill_input(request, None)[0])
        tokens = runner.forward(ForwardMode.EXTEND, steps).argmax(-1)
        decode = [
            StepInput(
                r.request_id,
                [0],
                torch.full((3, 1), len(r.prompt_ids), dtype=torch.long),
                len(r.prompt_ids),
            )
            for r in requests
        ]
        from_device = runner.forward(ForwardMode.DECODE, decode, input_ids=tokens).clone()
        for step, token in zip(decode, tokens.tolist(), strict=True):
            step.input_ids = [token]
        from_host = runner.forward(ForwardMode.DECODE, decode)
    finally:
        for request in requests:
            runner.page_table.release(request.request_id)
    assert torch.equal(from_device, from_host)
