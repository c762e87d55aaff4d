"""The common flags: ``--log-level`` defaults to STAGESERVE_LOG_LEVEL (else INFO) in every service."""

from __future__ import annotations

import argparse

import pytest

from services.common.envs import Envs
from services.common.service_main import add_common_args


def log_level(envs: Envs, argv: list[str]) -> str:
    parser = argparse.ArgumentParser()
    add_common_args(parser, envs=envs)
    return parser.parse_args(argv).log_level


def test_log_level_default_comes_from_envs() -> None:
    assert log_level(Envs.from_environ({}), []) == "INFO"
    assert log_level(Envs.from_environ({"STAGESERVE_LOG_LEVEL": "debug"}), []) == "DEBUG"
    assert log_level(Envs.from_environ({"STAGESERVE_LOG_LEVEL": "debug"}), ["--log-level", "error"]) == "ERROR"


def test_every_service_reads_stageserve_log_level(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.decode.config import parse_config as decode_config
    from services.prefill.__main__ import parse_args as prefill_config
    from services.router.__main__ import build_parser as router_parser
    from services.tokenizer.__main__ import build_parser as tokenizer_parser
    from services.vision_encoder.__main__ import parse_args as vision_encoder_config

    monkeypatch.setenv("STAGESERVE_LOG_LEVEL", "warning")
    assert decode_config([]).log_level == "WARNING"
    assert prefill_config([]).log_level == "WARNING"
    assert vision_encoder_config([]).log_level == "WARNING"
    assert tokenizer_parser().parse_args([]).log_level == "WARNING"
    assert router_parser().parse_args([]).log_level == "WARNING"
