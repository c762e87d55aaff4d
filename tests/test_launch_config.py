"""``stageserve up``'s flags are ``LaunchConfig``'s: each setting parses into the config, and
each flag's help says what its default is."""

from __future__ import annotations

import argparse
from pathlib import Path

from services.cli import build_parser
from services.common.settings import config_from_args, config_to_argv
from services.launch_config import LaunchConfig, LivenessPolicy, UpFlags


def _up_parser() -> argparse.ArgumentParser:
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["up"]


def test_every_setting_of_the_config_parses_back_into_it() -> None:
    cfg = LaunchConfig(
        Path("/models/m"),
        host="0.0.0.0",
        http_port=9000,
        device="cuda",
        encoder_device="cuda:1",
        encoder_ranks=2,
        prefill_device="cuda:0",
        decode_device="cuda:0,cuda:1",
        dtype="bfloat16",
        given=UpFlags("shm", "cuda_ipc", "torch", 0.7, None),
        decode_dp=2,
        max_running_requests=64,
        prefill_first_ms=20.0,
        router_workers=3,
        page_size=32,
        stall_timeout_s=3.0,
        max_concurrent_requests=8,
        max_queued_requests=0,
        queue_timeout_s=5.0,
        tool_call_parser="qwen3_coder",
        max_n=4,
        drain_timeout_s=0.0,
        kv_quarantine_s=2.0,
        embedding_quarantine_s=1.5,
        prefill_cp_block_tokens=64,
        prefill_cp_min_tokens=0,
        prefill_num_pages=4096,
        disable_prefix_cache=True,
        host_cache_gb=2.5,
        kv_store_gb=0.5,
        prefill_cp=2,
        ready_timeout_s=60.0,
        liveness=LivenessPolicy(4.0),
        log_dir=Path("/tmp/logs"),
        served_model_name="m",
        max_model_len=4096,
        log_level="DEBUG",
        log_format="json",
        metrics_port_base=9100,
        state_file=Path("/tmp/state.json"),
        insecure_no_api_key=True,
    )
    argv = config_to_argv(cfg)
    assert "--port" in argv and "--liveness-timeout-s" in argv and "--num-pages" not in argv
    args = build_parser().parse_args(["up", *argv])
    assert config_from_args(LaunchConfig, args) == cfg


def test_every_flag_without_a_value_says_what_its_default_means() -> None:
    unset = [
        action
        for action in _up_parser()._actions
        if action.default is None and action.option_strings and action.dest != "help"
    ]
    assert {a.dest for a in unset} >= {"stall_timeout_s", "num_pages", "state_file", "api_key"}
    assert [a.dest for a in unset if "default" not in (a.help or "").lower()] == []
