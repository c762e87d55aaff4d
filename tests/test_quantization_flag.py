"""``--quantization fp8`` reaches the model: prefill's and decode's flags, through their rank
init, to the weights their ranks load; ``up`` passes it to both."""

from __future__ import annotations

import pytest
import torch

from services.common.ranks.step import RankContext
from services.decode.__main__ import parse_config as parse_decode
from services.decode.app import rank_init as decode_rank_init
from services.decode.rank import build_rank
from services.engine.loader import load_model
from services.launch_config import LaunchConfig
from services.launch_spec import decode_spec, prefill_spec
from services.prefill import rank_step
from services.prefill.__main__ import parse_args as parse_prefill
from services.prefill.app import rank_init as prefill_rank_init
from services.transfer import create_kv_receiver
from services.transfer.inprocess_backend import InProcessFabric

FP8_ARGS = ["--quantization", "fp8", "--transfer-backend", "shm"]


def _qkv_dtype(model) -> torch.dtype:
    return model.model.layers[0].self_attn.qkv_weight.dtype


def test_the_default_is_unquantized() -> None:
    assert prefill_rank_init(parse_prefill(["--transfer-backend", "shm"])).quantization == "none"
    assert decode_rank_init(parse_decode(["--transfer-backend", "shm"])).quantization == "none"
    with pytest.raises(SystemExit):
        parse_decode(["--quantization", "int8"])


def test_decode_rank_loads_fp8_weights() -> None:
    init = decode_rank_init(parse_decode([*FP8_ARGS, "--num-pages", "64"]))
    receiver = create_kv_receiver("inprocess", fabric=InProcessFabric())
    try:
        rank = build_rank(init, "cpu", receiver=receiver)
        assert _qkv_dtype(rank.loop.batch.runner.model) == torch.float8_e4m3fn
    finally:
        receiver.close()


class _Loaded(Exception):
    """Stops a prefill rank's start once its model is loaded."""


def test_prefill_rank_loads_fp8_weights(monkeypatch) -> None:
    loaded = []

    def load_then_stop(*args, **kwargs):
        loaded.append(load_model(*args, **kwargs))
        raise _Loaded

    monkeypatch.setattr(rank_step, "load_model", load_then_stop)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    init = prefill_rank_init(parse_prefill(FP8_ARGS))
    ctx = RankContext(0, 1, "cpu", None, None, 10.0)
    with pytest.raises(_Loaded):
        rank_step.PrefillRankStep(ctx, init)
    assert _qkv_dtype(loaded[0]) == torch.float8_e4m3fn


def test_up_passes_the_flag_to_prefill_and_decode() -> None:
    cfg = LaunchConfig(quantization="fp8")
    for spec in (decode_spec(cfg), prefill_spec(cfg, "")):
        assert "--quantization fp8" in " ".join(spec.args), spec.name
    assert "--quantization" not in " ".join(decode_spec(LaunchConfig()).args)
