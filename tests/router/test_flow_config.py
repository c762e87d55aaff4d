"""The router's progress and admission flags reach ``RouterConfig.flow``; bad values are refused."""

from __future__ import annotations

import pytest

from services.router.__main__ import build_parser, config_from_args
from services.router.config import FlowConfig
from tests.conftest import TINY_MODEL_DIR


def flow_of(*argv: str) -> FlowConfig:
    args = build_parser().parse_args(["--model", str(TINY_MODEL_DIR), *argv])
    return config_from_args(args).flow


def test_defaults():
    assert (
        flow_of()
        == FlowConfig()
        == FlowConfig(
            stall_timeout_s=10.0,
            max_concurrent_requests=256,
            max_queued_requests=1024,
            queue_timeout_s=30.0,
        )
    )


def test_flags_reach_the_config():
    flow = flow_of(
        "--stall-timeout-s",
        "2.5",
        "--max-concurrent-requests",
        "8",
        "--max-queued-requests",
        "0",
        "--queue-timeout-s",
        "0",
    )
    assert flow == FlowConfig(
        stall_timeout_s=2.5, max_concurrent_requests=8, max_queued_requests=0, queue_timeout_s=0.0
    )


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--stall-timeout-s", "0"),
        ("--stall-timeout-s", "nan"),
        ("--max-concurrent-requests", "0"),
        ("--max-queued-requests", "-1"),
        ("--queue-timeout-s", "-1"),
    ],
)
def test_bad_values_are_refused_naming_the_flag(flag, value):
    with pytest.raises(SystemExit, match=f"{flag} must be"):
        flow_of(flag, value)
