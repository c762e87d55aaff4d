"""``--kv-cache-dtype fp8_e4m3`` reaches the KV pool: prefill's and decode's flags, through their
rank init, to the pool their ranks build; ``up`` passes it to both, and a rank group agrees
on it."""

from __future__ import annotations

import pytest
import torch

from services.common.ranks.step import RankContext
from services.decode.__main__ import parse_config as parse_decode
from services.decode.app import rank_init as decode_rank_init
from services.decode.rank import build_rank
from services.launch_config import LaunchConfig
from services.launch_spec import decode_spec, prefill_spec
from services.prefill import rank_step
from services.prefill.__main__ import parse_args as parse_prefill
from services.prefill.app import rank_init as prefill_rank_init
from services.transfer import create_kv_receiver
from services.transfer.inprocess_backend import InProcessFabric

FP8_ARGS = ["--kv-cache-dtype", "fp8_e4m3", "--transfer-backend", "shm"]


def test_the_default_is_the_models_dtype() -> None:
    assert prefill_rank_init(parse_prefill(["--transfer-backend", "shm"])).kv_cache_dtype == "auto"
    assert decode_rank_init(parse_decode(["--transfer-backend", "shm"])).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parse_decode(["--kv-cache-dtype", "fp8_e5m2"])


def test_decode_rank_builds_an_fp8_pool() -> None:
    init = decode_rank_init(parse_decode([*FP8_ARGS, "--num-pages", "64"]))
    receiver = create_kv_receiver("inprocess", fabric=InProcessFabric())
    try:
        rank = build_rank(init, "cpu", receiver=receiver)
        pool = rank.loop.batch.runner.kv_pool
        assert pool.dtype == torch.float8_e4m3fn and pool.value_dtype == torch.float32
    finally:
        receiver.close()


class _Built(Exception):
    """Stops a prefill rank's start once its runner is built."""


def test_prefill_rank_builds_an_fp8_pool(monkeypatch) -> None:
    built, model_runner = [], rank_step.ModelRunner

    def build_then_stop(*args, **kwargs):
        built.append(model_runner(*args, **kwargs))
        raise _Built

    monkeypatch.setattr(rank_step, "ModelRunner", build_then_stop)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    init = prefill_rank_init(parse_prefill(FP8_ARGS))
    ctx = RankContext(0, 1, "cpu", None, None, 10.0)
    with pytest.raises(_Built):
        rank_step.PrefillRankStep(ctx, init)
    assert built[0].kv_pool.dtype == torch.float8_e4m3fn
    assert rank_step.manifest_of(init)["kv_cache_dtype"] == "fp8_e4m3"  # the group agrees on it


def test_up_passes_the_flag_to_prefill_and_decode() -> None:
    cfg = LaunchConfig(kv_cache_dtype="fp8_e4m3")
    for spec in (decode_spec(cfg), prefill_spec(cfg, "")):
        assert "--kv-cache-dtype fp8_e4m3" in " ".join(spec.args), spec.name
    assert "--kv-cache-dtype" not in " ".join(decode_spec(LaunchConfig()).args)
