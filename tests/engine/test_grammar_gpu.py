"""Grammar masks on the GPU (device tool, never in CI): ``GrammarMasks`` fills on the host,
uploads through pinned memory and masks CUDA logits on the stream (xgrammar's kernel) exactly
as the host reference masks the same logits, step after step."""

from __future__ import annotations

import pytest
import torch

from services.common.paths import BUNDLED_MODEL
from services.engine.config import ModelConfig
from services.engine.grammar import GrammarCache, GrammarMasks, apply_grammar_masks
from tests.engine.test_grammar import SCHEMA, schema_grammar

pytestmark = pytest.mark.gpu


def test_masks_on_cuda_logits_equal_the_host_reference():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cache = GrammarCache(BUNDLED_MODEL)
    vocab_size = ModelConfig.from_dir(BUNDLED_MODEL).text.vocab_size
    generator = torch.Generator().manual_seed(2)
    masks = GrammarMasks(8, vocab_size, torch.device("cuda"))
    grammar = schema_grammar(SCHEMA)
    ours = [(5, cache.matcher(grammar)), (1, cache.matcher(grammar))]
    theirs = [(row, cache.matcher(grammar)) for row, _ in ours]
    num_steps = 0
    while not all(m.is_terminated() for _, m in ours) and num_steps < 60:
        logits = torch.randn(8, vocab_size, generator=generator)
        expected = logits.clone()
        on_gpu = logits.cuda()
        masks.apply(on_gpu, ours)
        apply_grammar_masks(expected, theirs)
        assert torch.equal(on_gpu.cpu(), expected)
        picked = [int(expected[row].argmax()) for row, _ in ours]
        masks.accept([m for _, m in ours], picked)
        for (_, matcher), token in zip(theirs, picked, strict=True):
            if not matcher.is_terminated():
                assert matcher.accept_token(token)
        num_steps += 1
    assert all(m.is_terminated() for _, m in ours), "greedy under the schema ends within 60"
