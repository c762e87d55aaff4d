"""Tensor parallelism in the engine (fp32, CPU, gloo): TP = 2 and 4 against TP = 1 and
transformers on the tiny Qwen2.5-VL and dense Qwen3-VL checkpoints, each rank's share of the
weights, and the sizes a model cannot split over.

The tiny checkpoints have 4 attention heads and 2 KV heads, so TP = 4 also covers the
replicated KV heads (each pair of ranks holds a copy of one).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.common.errors import ModelLoadError
from services.common.types import SamplingParams
from services.engine import loader
from services.engine.config import ModelConfig
from services.engine.loader import load_model, tp_shards
from services.engine.parallel import HeadLayout, TensorParallel, check_tensor_parallel
from tests.conftest import TINY_MODEL_DIR
from tests.engine.test_model_parity import PROMPTS, TOLERANCE, hf_inputs
from tests.engine.tp_ranks import run_tp_groups

MODELS = {"qwen2.5-vl": TINY_MODEL_DIR, "qwen3-vl": TINY_MODEL_DIR.parent / "tiny-qwen3-vl"}
WORLD, SIZES = 4, (2, 4)
NUM_DECODE_STEPS = 5


@dataclasses.dataclass(frozen=True)
class Reference:
    prompt_logits: list[torch.Tensor]  # TP = 1, per request
    hf_logits: list[torch.Tensor]  # transformers, per request
    token_ids: list[list[int]]  # TP = 1 greedy


def reference_run(model_dir) -> tuple[Reference, list]:
    """The TP = 1 and transformers reference of a text and an image prompt, and their engine
    requests."""
    from transformers import AutoModelForImageTextToText

    from services.engine.offline import OfflinePipeline

    params = SamplingParams(temperature=0.0, max_new_tokens=NUM_DECODE_STEPS, ignore_eos=True)
    pipeline = OfflinePipeline.from_dir(model_dir, page_size=4, num_pages=256)
    requests = [pipeline.build_request(*PROMPTS[p], params, p) for p in ("text", "one_image")]
    hf = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.no_grad():
        hf_logits = [hf.eval()(**hf_inputs(r)).logits[0].float() for r in requests]
    reference = Reference(
        pipeline.engine.prompt_logits(requests),
        hf_logits,
        [o.token_ids for o in pipeline.engine.generate(requests)],
    )
    return reference, requests


def assert_logits_match(reference: Reference, result) -> None:  # result: a tp_ranks.RankResult
    assert len(result.prompt_logits) == 2, "a text and an image prompt"
    logits = zip(result.prompt_logits, reference.prompt_logits, reference.hf_logits, strict=True)
    for ours, tp1, hf in logits:
        ours = torch.from_numpy(ours)
        assert ours.shape == tp1.shape == hf.shape, "the whole vocabulary on every rank"
        assert (ours - tp1).abs().max().item() < TOLERANCE
        assert (ours - hf).abs().max().item() < TOLERANCE


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    """Per model, the TP = 1 and transformers reference and every rank's results at TP = 2
    and TP = 4, all from one spawn of 4 processes."""
    jobs, references = [], {}
    for name, model_dir in MODELS.items():
        references[name], requests = reference_run(model_dir)
        jobs.append((model_dir, requests))
    results = run_tp_groups(WORLD, SIZES, jobs, tmp_path_factory.mktemp("tp"))
    return references, results


def group_results(tp_runs, name: str, size: int):
    references, results = tp_runs
    job = list(MODELS).index(name)
    return references[name], [results[job, size, rank] for rank in range(size)]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_match_tp1_and_transformers(tp_runs, name, size):
    ref, ranks = group_results(tp_runs, name, size)
    for result in ranks:
        assert_logits_match(ref, result)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_tokens_match_tp1(tp_runs, name, size):
    ref, ranks = group_results(tp_runs, name, size)
    assert all(len(t) == NUM_DECODE_STEPS for t in ref.token_ids)
    for result in ranks:
        assert result.token_ids == ref.token_ids


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_rank_holds_its_share_of_the_split_weights(tp_runs, name, size):
    _, ranks = group_results(tp_runs, name, size)
    text = ModelConfig.from_dir(MODELS[name]).text
    for result in ranks:
        share = result.split_total_bytes / size
        if text.num_key_value_heads >= size:
            assert result.split_bytes == share
        else:  # k and v are held by size / num_kv_heads ranks each
            assert share < result.split_bytes < 1.1 * share


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_shards_are_slices_of_the_checkpoint_read_alone(name, size, monkeypatch):
    """Each rank's split parameters are its slices of the TP = 1 ones, together they cover
    every row, and the loader never reads a split tensor whole."""
    full = dict(load_model(MODELS[name], components=("language",)).named_parameters())
    assert tp_shards(load_model(MODELS[name], components=("language",))) == {}
    whole_reads = spy_whole_reads(monkeypatch)
    covered: dict[str, set[int]] = {}
    for rank in range(size):
        model = load_model(MODELS[name], components=("language",), tp=TensorParallel(rank, size))
        params = dict(model.named_parameters())
        shards = tp_shards(model)
        assert "model.embed_tokens.weight" in shards and "lm_head.weight" in shards
        for key, shard in shards.items():
            torch.testing.assert_close(params[key], full[key][shard.index(full[key].dim())])
            covered.setdefault(key, set()).update(range(shard.start, shard.start + shard.size))
        assert whole_reads, "the norms are read whole"
        assert not {loader.canonical_name(k) for k in whole_reads} & shards.keys()
    for key, rows in covered.items():
        assert len(rows) == full[key].shape[shards[key].dim], key


def spy_whole_reads(monkeypatch) -> list[str]:
    """The checkpoint keys the loader reads whole (``get_tensor``) from now on."""
    keys: list[str] = []
    real_open = loader.safe_open

    class SpyFile:
        def __init__(self, *args, **kwargs) -> None:
            self.file = real_open(*args, **kwargs)

        def __enter__(self):
            self.inner = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, key):
            return self.inner.get_slice(key)

        def get_tensor(self, key):
            keys.append(key)
            return self.inner.get_tensor(key)

    monkeypatch.setattr(loader, "safe_open", SpyFile)
    return keys


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size"), [(4, 2, 2), (4, 2, 4), (8, 8, 4), (8, 2, 8), (16, 4, 2)]
)
def test_each_rank_holds_the_kv_heads_its_q_heads_read(heads, kv_heads, size):
    group = heads // kv_heads
    holders = {h: 0 for h in range(kv_heads)}
    for rank in range(size):
        layout = HeadLayout.of(heads, kv_heads, TensorParallel(rank, size))
        assert layout.num_q_heads * size == heads
        held = range(layout.kv_start, layout.kv_start + layout.num_kv_heads)
        for q in range(layout.q_start, layout.q_start + layout.num_q_heads):
            assert q // group in held
        for kv in held:
            holders[kv] += 1
    assert set(holders.values()) == {max(1, size // kv_heads)}


@pytest.mark.parametrize(
    ("change", "size", "named"),
    [
        ({}, 3, ("4 attention heads", "2 KV heads", "intermediate size 128", "vocabulary of 2048")),
        ({"num_attention_heads": 12, "num_key_value_heads": 3}, 2, ("3 KV heads",)),
        ({"intermediate_size": 130}, 4, ("intermediate size 130",)),
        ({"vocab_size": 2050}, 4, ("vocabulary of 2050",)),
    ],
)
def test_sizes_that_do_not_divide_the_model_are_refused(change, size, named):
    text = dataclasses.replace(ModelConfig.from_dir(TINY_MODEL_DIR).text, **change)
    with pytest.raises(ModelLoadError, match=f"tensor parallel size {size} does not divide") as e:
        check_tensor_parallel(text, size)
    assert all(n in str(e.value) for n in named), str(e.value)
    check_tensor_parallel(text, 1)


def test_loader_refuses_a_bad_size_and_an_moe_model_before_reading():
    with pytest.raises(ModelLoadError, match="4 attention heads"):
        load_model(TINY_MODEL_DIR, tp=TensorParallel(0, 3))
    with pytest.raises(ModelLoadError, match="MoE model needs expert parallel size 2"):
        load_model(TINY_MODEL_DIR.parent / "tiny-qwen3-vl-moe", tp=TensorParallel(1, 2))
    with pytest.raises(ValueError, match="TP rank 2 is outside a group of 2"):
        TensorParallel(2, 2)
