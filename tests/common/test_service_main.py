"""The common flags: ``--log-level`` defaults to STAGESERVE_LOG_LEVEL (else INFO) in every service;
the auth flags, and the refusal to start without an internal token."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from services.common.auth import NO_TOKEN_MESSAGE
from services.common.envs import Envs
from services.common.service_main import add_common_args
from tests.conftest import REPO


def log_level(envs: Envs, argv: list[str]) -> str:
    parser = argparse.ArgumentParser()
    add_common_args(parser, envs=envs)
    return parser.parse_args(argv).log_level


def test_log_level_default_comes_from_envs() -> None:
    assert log_level(Envs.from_environ({}), []) == "INFO"
    assert log_level(Envs.from_environ({"STAGESERVE_LOG_LEVEL": "debug"}), []) == "DEBUG"
    assert (
        log_level(Envs.from_environ({"STAGESERVE_LOG_LEVEL": "debug"}), ["--log-level", "error"])
        == "ERROR"
    )


def test_every_service_reads_stageserve_log_level(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.decode.__main__ import parse_config as decode_config
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


def test_every_service_takes_the_common_auth_flags(tmp_path) -> None:
    from services.decode.__main__ import parse_config as decode_config
    from services.prefill.__main__ import parse_args as prefill_config
    from services.router.__main__ import build_parser as router_parser
    from services.tokenizer.__main__ import parse_config as tokenizer_config
    from services.vision_encoder.__main__ import parse_args as vision_encoder_config

    token_file = tmp_path / "token"
    flags = [
        "--internal-token-file",
        str(token_file),
        "--allow-unauthenticated",
        "--enable-reflection",
    ]
    envs = Envs.from_environ({})
    parsed = [
        decode_config(flags),
        prefill_config(flags),
        vision_encoder_config(flags),
        tokenizer_config(flags, envs)[1],
        router_parser(envs).parse_args(flags),
    ]
    for config in parsed:
        assert (
            config.internal_token_file,
            config.allow_unauthenticated,
            config.enable_reflection,
        ) == (token_file, True, True)
    defaults = [
        decode_config([]),
        prefill_config([]),
        vision_encoder_config([]),
        tokenizer_config([], envs)[1],
        router_parser(envs).parse_args([]),
    ]
    for config in defaults:  # secure by default: a token is required, reflection is off
        assert (
            config.internal_token_file,
            config.allow_unauthenticated,
            config.enable_reflection,
        ) == (None, False, False)


SERVICES = ["tokenizer", "vision_encoder", "prefill", "decode", "router"]


@pytest.mark.slow
@pytest.mark.parametrize("service", SERVICES)
def test_a_service_without_a_token_refuses_to_start(service: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "STAGESERVE_INTERNAL_TOKEN"}
    result = subprocess.run(
        [sys.executable, "-m", f"services.{service}", "--port", "0", "--metrics-port", "0"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    assert "READY" not in result.stdout
    assert result.stderr.strip().splitlines() == [f"{service}: error: {NO_TOKEN_MESSAGE}"], (
        result.stderr
    )


def test_every_service_takes_log_format_from_the_flag_or_stageserve_log_format(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.decode.__main__ import parse_config as decode_config
    from services.prefill.__main__ import parse_args as prefill_config
    from services.router.__main__ import build_parser as router_parser
    from services.router.__main__ import config_from_args as router_config
    from services.tokenizer.__main__ import parse_config as tokenizer_config
    from services.vision_encoder.__main__ import parse_args as vision_encoder_config

    monkeypatch.setenv("STAGESERVE_LOG_FORMAT", "json")
    envs = Envs.from_environ()
    configs = [
        decode_config([]),
        prefill_config([]),
        vision_encoder_config([]),
        tokenizer_config([], envs)[0],
        router_config(router_parser(envs).parse_args([])),
    ]
    assert [c.log_format for c in configs] == ["json"] * 5
    flag = ["--log-format", "text"]
    configs = [
        decode_config(flag),
        prefill_config(flag),
        vision_encoder_config(flag),
        tokenizer_config(flag, envs)[0],
        router_config(router_parser(envs).parse_args(flag)),
    ]
    assert [c.log_format for c in configs] == ["text"] * 5
    with pytest.raises(SystemExit):
        decode_config(["--log-format", "xml"])


@pytest.mark.slow
def test_a_service_refuses_an_otel_setting_it_cannot_honour() -> None:
    env = {**os.environ, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.tokenizer",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--num-workers",
            "0",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "READY" not in result.stdout
    assert (
        result.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "tokenizer: error: OTEL_EXPORTER_OTLP_PROTOCOL / OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: "
            "'http/json'"
        )
    ), result.stderr
