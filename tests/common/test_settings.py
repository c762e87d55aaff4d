"""Settings declared once: flags built from a config dataclass, and a config back to argv."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from services.common.settings import (
    add_config_args,
    config_from_args,
    config_to_argv,
    flag,
    nested,
    positive,
    positive_int,
)


@dataclass(frozen=True)
class Http:
    max_body_bytes: int = flag(1024, type=positive_int, help="largest request body")
    timeout_s: float | None = flag(None, type=positive, help="read timeout (default: none)")


@dataclass(frozen=True)
class Example:
    name: str = flag(help="required name")
    devices: tuple[str, ...] = flag(("cpu",), metavar="DEV,...", help="rank devices")
    path: Path | None = flag(None, help="a file")
    mode: str = flag("a", choices=("a", "b"), help="the mode")
    verbose: bool = flag(False, help="say more")
    http: Http = nested(Http, prefix="http")
    computed: int = field(default=7)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="example")
    add_config_args(p, Example)
    return p


def parse(argv: list[str], **values) -> Example:
    return config_from_args(Example, parser().parse_args(argv), **values)


def test_the_flags_carry_the_fields_types_defaults_and_help() -> None:
    config = parse(["--name", "x"])
    assert config == Example(name="x")
    text = parser().format_help()
    for expected in ("--http-max-body-bytes", "largest request body", "--devices DEV,...", "{a,b}"):
        assert expected in text
    assert "--computed" not in text
    config = parse(
        ["--name", "x", "--devices", "cuda:0, cuda:1", "--path", "f", "--verbose"]
        + ["--mode", "b", "--http-timeout-s", "2.5"],
        computed=3,
    )
    assert config == Example(
        "x", ("cuda:0", "cuda:1"), Path("f"), "b", True, Http(1024, 2.5), computed=3
    )


@pytest.mark.parametrize(
    "argv", [["--http-max-body-bytes", "0"], ["--http-timeout-s", "-1"], ["--mode", "c"], []]
)
def test_a_bad_or_missing_value_is_a_usage_error(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        parse(["--name", "x", *argv] if argv else [])
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_a_config_turns_back_into_the_argv_that_parses_to_it() -> None:
    config = Example("x", ("a", "b"), Path("p"), "b", True, Http(5, 1.0))
    argv = config_to_argv(config)
    assert argv == [
        "--name", "x", "--devices", "a,b", "--path", "p", "--mode", "b", "--verbose",
        "--http-max-body-bytes", "5", "--http-timeout-s", "1.0",
    ]  # fmt: skip
    assert parse(argv) == config
    assert config_to_argv(Example("x")) == ["--name", "x"]  # defaults stay the child's
    assert config_to_argv(config, skip={"name", "http_timeout_s"})[:2] == ["--devices", "a,b"]


def test_the_tokenizer_and_encoder_configs_round_trip_through_their_parsers() -> None:
    from services.common.envs import Envs
    from services.common.service_main import COMMON_SETTINGS
    from services.tokenizer.__main__ import parse_config
    from services.tokenizer.config import TokenizerConfig
    from services.vision_encoder.__main__ import parse_args
    from services.vision_encoder.config import VisionEncoderConfig

    tokenizer = TokenizerConfig(max_model_len=64, num_workers=0, worker_liveness_timeout_s=3.0)
    assert parse_config(config_to_argv(tokenizer), Envs())[0] == tokenizer
    assert "--model" not in config_to_argv(tokenizer, skip=COMMON_SETTINGS)
    encoder = VisionEncoderConfig(
        devices=("cpu", "cpu"), transfer_backend="shm", pixel_method="pil", log_level="DEBUG"
    )
    assert parse_args(config_to_argv(encoder)) == encoder


@dataclass(frozen=True)
class Router:
    addresses: tuple[str, ...] = flag((), repeatable=True, help="workers")
    prefetch: bool = flag(True, name="no_prefetch", help="turn prefetching off")
    http: Http = nested(Http)


def test_repeatable_lists_off_switches_and_unprefixed_nesting_round_trip() -> None:
    p = argparse.ArgumentParser()
    add_config_args(p, Router)
    argv = ["--addresses", "a:1", "--addresses", "b:1,c:1", "--no-prefetch", "--timeout-s", "2"]
    config = config_from_args(Router, p.parse_args(argv))
    assert config == Router(("a:1", "b:1", "c:1"), False, Http(timeout_s=2.0))
    assert config_from_args(Router, p.parse_args(config_to_argv(config))) == config
    assert config_from_args(Router, p.parse_args([])) == Router()
