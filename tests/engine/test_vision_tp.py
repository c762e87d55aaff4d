"""Tensor parallelism in the vision towers (fp32, CPU, gloo): rows (and DeepStack rows) of
TP = 2 and TP = 4 against TP = 1 on the tiny Qwen2.5-VL and Qwen3-VL checkpoints, for a batch of
images of different sizes; each rank's share of the split weights; the sizes that do not split.

The tiny towers have 2 attention heads, so TP = 4 runs on copies of them with 4 heads of half
the dim: the same tensors, as no vision weight's shape depends on the head count.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from services.common.errors import ModelLoadError
from services.engine import loader
from services.engine.config import ModelConfig
from services.engine.loader import load_model, tp_shards
from services.engine.model.vision import check_vision_parallel
from services.engine.parallel import TensorParallel
from tests.conftest import TINY_MODEL_DIR
from tests.engine.test_tensor_parallel import spy_whole_reads
from tests.engine.tp_ranks import run_groups

MODELS = {"qwen2.5-vl": TINY_MODEL_DIR, "qwen3-vl": TINY_MODEL_DIR.parent / "tiny-qwen3-vl"}
GRIDS = [(1, 8, 12), (1, 4, 4), (2, 6, 10), (1, 10, 6)]  # images of several sizes, 2 frames
WORLD = 4
TOLERANCE = 1e-4
SPLIT = ("attn.qkv.", "attn.proj.weight", "mlp.")  # each block's; the rest is whole


def four_head_copy(model_dir: Path, dst: Path) -> Path:
    """``model_dir`` with 4 vision heads (its other files linked)."""
    dst.mkdir()
    for path in model_dir.iterdir():
        if path.name != "config.json":
            (dst / path.name).symlink_to(path)
    config = json.loads((model_dir / "config.json").read_text())
    config["vision_config"]["num_heads"] = 4
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def pixels_for(model_dir: Path) -> torch.Tensor:  # [patches of GRIDS, C*T*P*P] fp32
    v = ModelConfig.from_dir(model_dir).vision
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size**2
    generator = torch.Generator().manual_seed(0)
    return torch.randn(sum(t * h * w for t, h, w in GRIDS), patch_dim, generator=generator)


def encode(model_dir: Path, tp: TensorParallel) -> tuple[np.ndarray, dict[str, int]]:
    """The tower's rows of GRIDS split over ``tp``, and the bytes of each split parameter."""
    model = load_model(model_dir, dtype="float32", components=("vision",), vision_tp=tp)
    params = dict(model.named_parameters())
    split = {n: params[n].numel() * params[n].element_size() for n in tp_shards(model)}
    with torch.inference_mode():
        rows = model.encode_images(pixels_for(model_dir), GRIDS)
    return rows.numpy(), split


def _vision_job(rank: int, size: int, group, model_dir: str):
    """One rank's rows and split bytes (run in a spawned rank process by ``run_groups``)."""
    torch.set_num_threads(1)
    return encode(Path(model_dir), TensorParallel(rank, size, group))


def run_vision_groups(jobs: list[tuple[Path, tuple[int, ...]]], tmp_dir: Path):
    """``(job, size, rank) -> (rows, split bytes)`` of every job on each of its group sizes,
    from WORLD spawned processes; ``AssertionError`` naming the rank that fails or hangs."""
    return run_groups(WORLD, [(_vision_job, (str(d),), sizes) for d, sizes in jobs], tmp_dir)


@pytest.fixture(scope="module")
def vision_runs(tmp_path_factory):
    """Per tower (the tiny ones at TP = 2, their 4-head copies at TP = 2 and 4): the TP = 1
    rows and whole parameters, and every rank's results, from one spawn of 4 processes."""
    tmp = tmp_path_factory.mktemp("vision_tp")
    dirs = {**MODELS, **{f"{n}-4h": four_head_copy(d, tmp / n) for n, d in MODELS.items()}}
    jobs = [(d, (2, 4) if name.endswith("-4h") else (2,)) for name, d in dirs.items()]
    results = run_vision_groups(jobs, tmp)
    references = {}
    for name, model_dir in dirs.items():
        rows, _ = encode(model_dir, TensorParallel())
        whole = load_model(model_dir, dtype="float32", components=("vision",))
        params = {n: p.numel() * p.element_size() for n, p in whole.named_parameters()}
        references[name] = (rows, params)
    return list(dirs), jobs, references, results


def cases() -> list[tuple[str, int]]:
    return [(name, 2) for name in MODELS] + [(f"{name}-4h", s) for name in MODELS for s in (2, 4)]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "size"), cases())
def test_rows_match_tp1(vision_runs, name, size):
    names, _, references, results = vision_runs
    expected, _ = references[name]
    v = ModelConfig.from_dir(MODELS[name.removesuffix("-4h")]).vision
    width = v.out_hidden_size * (1 + len(v.deepstack_visual_indexes))  # DeepStack rows too
    assert expected.shape == (sum(t * h * w for t, h, w in GRIDS) // 4, width)
    for rank in range(size):
        rows, _ = results[names.index(name), size, rank]
        assert rows.shape == expected.shape
        assert np.abs(rows - expected).max() < TOLERANCE, (name, size, rank)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "size"), cases())
def test_each_rank_holds_its_share_of_the_split_weights(vision_runs, name, size):
    names, _, references, results = vision_runs
    _, whole = references[name]
    depth = ModelConfig.from_dir(MODELS[name.removesuffix("-4h")]).vision.depth
    for rank in range(size):
        _, split = results[names.index(name), size, rank]
        assert all(n.startswith("visual.blocks.") and any(s in n for s in SPLIT) for n in split)
        assert len([n for n in split if ".attn." in n]) == 3 * depth  # qkv weight, bias; proj
        assert sum(split.values()) * size == sum(whole[n] for n in split)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_shards_are_slices_of_the_checkpoint_read_alone(name, monkeypatch):
    """Each rank's split parameters are its slices of the TP = 1 ones (q, k and v: its heads of
    each third), together they cover every row, and no split tensor is read whole."""
    full = dict(load_model(MODELS[name], components=("vision",)).named_parameters())
    whole_reads = spy_whole_reads(monkeypatch)
    covered: dict[str, tuple[int, set[int]]] = {}  # the split dim, its entries held by a rank
    for rank in range(2):
        model = load_model(MODELS[name], components=("vision",), vision_tp=TensorParallel(rank, 2))
        params = dict(model.named_parameters())
        assert params.keys() == full.keys()
        shards = tp_shards(model)
        for key, shard in shards.items():
            parts = shard if isinstance(shard, tuple) else (shard,)
            dim = parts[0].dim
            expected = torch.cat([full[key][p.index(full[key].dim())] for p in parts], dim=dim)
            torch.testing.assert_close(params[key], expected)
            _, held = covered.setdefault(key, (dim, set()))
            for p in parts:
                held.update(range(p.start, p.start + p.size))
        assert whole_reads, "the norms and mergers are read whole"
        assert not {loader.canonical_name(k) for k in whole_reads} & shards.keys()
    for key, (dim, held) in covered.items():
        assert held == set(range(full[key].shape[dim])), key


def test_tp1_is_the_single_device_tower(monkeypatch):
    """A group of 1 splits nothing and runs no collective."""
    import torch.distributed as dist

    def no_collective(*args, **kwargs):
        raise AssertionError("a collective in a group of 1")

    monkeypatch.setattr(dist, "all_reduce", no_collective)
    for model_dir in MODELS.values():
        model = load_model(model_dir, components=("vision",), vision_tp=TensorParallel())
        assert tp_shards(model) == {}
        with torch.inference_mode():
            model.encode_images(pixels_for(model_dir), GRIDS)


def test_sizes_that_do_not_split_the_tower_are_refused():
    with pytest.raises(
        ModelLoadError, match="vision tensor parallel size 4 does not divide the 2 vision"
    ):
        load_model(TINY_MODEL_DIR, components=("vision",), vision_tp=TensorParallel(0, 4))
    vision = dataclasses.replace(ModelConfig.from_dir(TINY_MODEL_DIR).vision, intermediate_size=66)
    with pytest.raises(ModelLoadError) as err:
        check_vision_parallel(vision, 4)
    assert "the 2 vision attention heads, the vision intermediate size 66" in str(err.value)
    check_vision_parallel(vision, 2)
    check_vision_parallel(vision, 1)


def test_the_tower_splits_where_the_decoder_would_not():
    """The vision split asks nothing of the decoder: an MoE checkpoint (whose decoder splits only
    with expert parallelism) loads its tower at TP = 2."""
    moe = TINY_MODEL_DIR.parent / "tiny-qwen3-vl-moe"
    model = load_model(moe, components=("vision",), vision_tp=TensorParallel(1, 2))
    assert tp_shards(model)
