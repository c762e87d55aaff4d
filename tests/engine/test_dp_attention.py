"""DP attention in the engine (fp32, CPU, gloo): groups of 2 ranks where attention, the
embedding and the LM head are whole on every rank and only the MLP (dense Qwen2.5-VL: split
by rows of the intermediate features) or the MoE layers (Qwen3-VL-MoE: experts split, EP = 2)
split, each layer's MLP run on every rank's rows gathered. Logits within 1e-4 of one rank and
of transformers, the same greedy tokens, and each rank's share of the weights; the sizes that
cannot split are refused. (Ranks with different requests in one step: the decode service's
tests, ``tests/decode/test_dp_attention.py``.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.common.errors import ModelLoadError
from services.engine.config import ModelConfig
from services.engine.loader import load_model, tp_shards
from services.engine.parallel import TensorParallel, check_tensor_parallel
from tests.conftest import TINY_MODEL_DIR
from tests.engine.test_tensor_parallel import assert_logits_match, reference_run
from tests.engine.tp_ranks import run_tp_groups

pytestmark = pytest.mark.slow
MODELS = {  # name: (checkpoint, experts split over the group)
    "qwen2.5-vl": (TINY_MODEL_DIR, False),
    "qwen3-vl-moe": (TINY_MODEL_DIR.parent / "tiny-qwen3-vl-moe", True),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def dp_runs(request, tmp_path_factory):
    model_dir, experts = MODELS[request.param]
    reference, requests = reference_run(model_dir)
    results = run_tp_groups(
        2,
        (2,),
        [(model_dir, requests)],
        tmp_path_factory.mktemp("dp"),
        expert_parallel=experts,
        dp_attention=True,
    )
    return request.param, reference, [results[0, 2, rank] for rank in range(2)]


def test_logits_and_tokens_match_one_rank_and_transformers(dp_runs) -> None:
    _, reference, ranks = dp_runs
    for result in ranks:
        assert_logits_match(reference, result)
        assert result.token_ids == reference.token_ids


def test_only_the_mlp_or_the_experts_split(dp_runs) -> None:
    name, _, ranks = dp_runs
    model_dir, experts = MODELS[name]
    whole = dict(load_model(model_dir, components=("language",)).named_parameters())
    model = load_model(
        model_dir, components=("language",), tp=TensorParallel(0, 2, ep_size=2 if experts else 1)
    )
    dp = TensorParallel(0, 2, ep_size=2 if experts else 1, dp_attention=True)
    shards = tp_shards(load_model(model_dir, components=("language",), tp=dp))
    assert shards and all(".mlp." in name for name in shards), sorted(shards)
    assert set(shards) < set(tp_shards(model))  # attention, embedding, LM head: whole
    params = dict(load_model(model_dir, components=("language",), tp=dp).named_parameters())
    for name, param in params.items():
        if name not in shards:
            assert param.shape == whole[name].shape, name
    for result in ranks:
        assert result.split_bytes * 2 == result.split_total_bytes


def test_sizes_that_do_not_split_are_refused() -> None:
    text = ModelConfig.from_dir(TINY_MODEL_DIR).text
    check_tensor_parallel(text, 8, dp_attention=True)  # 4 heads, 2 KV heads: whole per rank
    with pytest.raises(ModelLoadError, match="tensor parallel size 8 does not divide the 4"):
        check_tensor_parallel(text, 8)
    odd = dataclasses.replace(text, intermediate_size=text.intermediate_size + 1)
    with pytest.raises(ModelLoadError, match="DP attention over 2 does not divide the inter"):
        check_tensor_parallel(odd, 2, dp_attention=True)
    moe = ModelConfig.from_dir(MODELS["qwen3-vl-moe"][0]).text
    with pytest.raises(ModelLoadError, match="needs expert parallel size 2"):
        check_tensor_parallel(moe, 2, 1, dp_attention=True)


def test_one_rank_group_is_the_single_device_model() -> None:
    dp = TensorParallel(0, 1, dp_attention=True)
    x = torch.randn(3, 4)
    assert dp.attention.size == 1 and torch.equal(dp.mlp_rows(lambda t: t * 2, x), x * 2)
