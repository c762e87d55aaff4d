"""The ``stageserve up`` subcommand: every service as its own process on this machine.

Its flags are ``LaunchConfig``'s (``services.launch_config``), plus ``--api-key``, which reaches
the routers through their environment, never through a config or the state file.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from services.cli_up_checks import (
    check_decode_dp,
    check_kv_store,
    check_log_format,
    check_model_and_port,
    check_prefill_cp,
    check_tensor_parallel,
    check_transfers,
)
from services.cli_up_defaults import rank_layout, resolve_up
from services.common.envs import Envs
from services.common.exposure import check_api_exposure
from services.common.settings import add_config_args, config_from_args
from services.launch_config import LaunchConfig, default_router_workers
from services.launch_spec import with_gpu_share


def add_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "up", help="start every service as its own process on this machine; restart any that exits"
    )
    add_config_args(p, LaunchConfig, defaults=_machine_defaults(Envs.from_environ()))
    p.add_argument(
        "--api-key",
        default=None,
        help="key the API requires (passed to the router as STAGESERVE_API_KEY; default: that "
        "variable); a non-loopback --host needs one unless --insecure-no-api-key",
    )
    p.set_defaults(func=_run_up)


def _machine_defaults(envs: Envs) -> dict[str, object]:
    """The defaults this machine gives ``up``'s flags: its CPUs, its ``STAGESERVE_LOG_FORMAT``."""
    return {"router_workers": default_router_workers(), "log_format": envs.log_format}


def _run_up(args: argparse.Namespace) -> int:
    import os

    from services.common.auth import child_environment
    from services.launcher import run_up

    envs = Envs.from_environ()
    try:  # fail here, not as a service that exits before READY
        cfg, chosen = _launch_config(args, envs)
        exposures = (check_transfers(cfg), check_kv_store(cfg))
        env = child_environment(os.environ, api_key=args.api_key)  # AuthConfigError: a bad key
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for exposure in dict.fromkeys(e for e in exposures if e is not None):  # said once
        print(f"warning: {exposure}", file=sys.stderr)
    print(f"stageserve up: {chosen}", file=sys.stderr, flush=True)
    return run_up(cfg, env)


def _launch_config(args: argparse.Namespace, envs: Envs) -> tuple[LaunchConfig, str]:
    """The config ``up`` starts, with what it chose for its devices, and the line that says
    those choices; ``ValueError`` naming what could not start."""
    from services.common.telemetry import tracing_plan
    from services.launcher import new_run_dir

    cfg = config_from_args(LaunchConfig, args, model=args.model.resolve())
    check_model_and_port(cfg)
    has_api_key = bool(envs.api_key if args.api_key is None else args.api_key)
    check_api_exposure((cfg.host,), has_api_key, cfg.insecure_no_api_key)
    check_log_format(cfg.log_format)
    tracing_plan(envs)  # the OTEL_* settings every service will read
    cfg = replace(cfg, log_dir=cfg.log_dir or new_run_dir())
    check_decode_dp(cfg)
    check_prefill_cp(cfg)
    cfg, chosen = _with_device_choices(cfg)
    check_tensor_parallel(cfg)
    return with_gpu_share(cfg), chosen


def _with_device_choices(cfg: LaunchConfig) -> tuple[LaunchConfig, str]:
    """``cfg`` with the backends and decode's memory share chosen for its devices from
    ``cfg.given`` (``services.cli_up_defaults``), and the line that says them."""
    from services.engine.gpu_defaults import flashinfer_importable

    named = (cfg.device, cfg.encoder_device, cfg.prefill_device, cfg.decode_device)
    num_cuda_devices = 0
    if any("cuda" in (device or "") for device in named):
        import torch

        num_cuda_devices = torch.cuda.device_count()
    layout = rank_layout(cfg, num_cuda_devices)
    dtype, head_dim = cfg.dtype or "bfloat16", 128
    if num_cuda_devices:  # flashinfer's choice depends on the model's dtype and head size
        from services.engine.config import ModelConfig

        model = ModelConfig.from_dir(cfg.model)
        dtype, head_dim = cfg.dtype or model.torch_dtype, model.text.head_dim
    choices = resolve_up(
        layout, cfg.given, num_cuda_devices, flashinfer_importable(), dtype, head_dim
    )
    cfg = replace(
        cfg,
        transfer_backend=choices.transfer_backend,
        kv_transfer_backend=choices.kv_transfer_backend,
        attention_backend=choices.attention_backend,
        decode_memory_fraction=choices.decode_memory_fraction,
    )
    return cfg, choices.describe(layout, cfg.given)
