"""``--quantization fp8`` and ``--kv-cache-dtype fp8_e4m3`` reach the model and the KV pool:
prefill's and decode's flags, through their rank init, to what their ranks build; ``up`` passes
each to both, and a prefill rank group agrees on the KV dtype."""

from __future__ import annotations

from dataclasses import dataclass

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

SHM = ["--transfer-backend", "shm"]


@dataclass(frozen=True)
class Flag:
    name: str  # the flag, as on the command line
    field: str  # its name in the rank inits and LaunchConfig
    value: str  # the FP8 choice
    default: str
    refused: str  # a value neither service takes
    prefill_stop: str  # the rank_step name whose result the prefill test keeps, then stops
    fp8_of: object  # the built thing (a model or a ModelRunner) -> whether it is FP8

    @property
    def args(self) -> list[str]:
        return [self.name, self.value, *SHM]


def _weights_fp8(model) -> bool:
    return model.model.layers[0].self_attn.qkv_weight.dtype == torch.float8_e4m3fn


def _pool_fp8(runner) -> bool:
    pool = runner.kv_pool
    return pool.dtype == torch.float8_e4m3fn and pool.value_dtype == torch.float32


FLAGS = [
    Flag(
        "--quantization", "quantization", "fp8", "none", "int8", "load_model", _weights_fp8
    ),
    Flag(
        "--kv-cache-dtype", "kv_cache_dtype", "fp8_e4m3", "auto", "fp8_e5m2", "ModelRunner",
        _pool_fp8,
    ),
]  # fmt: skip
IDS = [flag.name for flag in FLAGS]


@pytest.mark.parametrize("flag", FLAGS, ids=IDS)
def test_the_default_and_a_refused_value(flag: Flag) -> None:
    assert getattr(prefill_rank_init(parse_prefill(SHM)), flag.field) == flag.default
    assert getattr(decode_rank_init(parse_decode(SHM)), flag.field) == flag.default
    with pytest.raises(SystemExit):
        parse_decode([flag.name, flag.refused])


@pytest.mark.parametrize("flag", FLAGS, ids=IDS)
def test_a_decode_rank_builds_fp8(flag: Flag) -> None:
    init = decode_rank_init(parse_decode([*flag.args, "--num-pages", "64"]))
    receiver = create_kv_receiver("inprocess", fabric=InProcessFabric())
    try:
        runner = build_rank(init, "cpu", receiver=receiver).loop.batch.runner
        assert flag.fp8_of(runner.model if flag.field == "quantization" else runner)
    finally:
        receiver.close()


class _Built(Exception):
    """Stops a prefill rank's start once the part under test is built."""


@pytest.mark.parametrize("flag", FLAGS, ids=IDS)
def test_a_prefill_rank_builds_fp8(flag: Flag, monkeypatch) -> None:
    built, build = [], getattr(rank_step, flag.prefill_stop)

    def build_then_stop(*args, **kwargs):
        built.append(build(*args, **kwargs))
        raise _Built

    monkeypatch.setattr(rank_step, flag.prefill_stop, build_then_stop)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    init = prefill_rank_init(parse_prefill(flag.args))
    with pytest.raises(_Built):
        rank_step.PrefillRankStep(RankContext(0, 1, "cpu", None, None, 10.0), init)
    assert flag.fp8_of(built[0])
    if flag.field == "kv_cache_dtype":  # the group agrees on it
        assert rank_step.manifest_of(init)["kv_cache_dtype"] == "fp8_e4m3"


@pytest.mark.parametrize("flag", FLAGS, ids=IDS)
def test_up_passes_the_flag_to_prefill_and_decode(flag: Flag) -> None:
    cfg = LaunchConfig(**{flag.field: flag.value})
    for spec in (decode_spec(cfg), prefill_spec(cfg, "")):
        assert f"{flag.name} {flag.value}" in " ".join(spec.args), spec.name
    assert flag.name not in " ".join(decode_spec(LaunchConfig()).args)
