"""The ``stageserve up`` subcommand: every service as its own process on this machine."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.cli_up_checks import (
    at_least,
    check_prefill_cp,
    check_up_args,
    non_negative,
    port_number,
    positive,
)
from services.cli_up_defaults import (
    ENCODER_SHARE,
    PREFILL_SHARE,
    UpFlags,
    rank_layout,
    resolve_up,
)
from services.common.exposure import INSECURE_NO_API_KEY_FLAG
from services.common.kv_transfer import (
    BACKENDS,
    CROSS_PROCESS_BACKENDS,
    KV_BACKEND_HELP,
    check_cross_process,
    check_embedding_backend,
    check_kv_backend,
    resolve_kv_backend,
)
from services.common.paths import BUNDLED_MODEL
from services.engine.gpu_defaults import (
    ATTENTION_CHOICES,
    ATTENTION_HELP,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    memory_fraction,
)
from services.launch_spec import LaunchConfig

# Flags passed on to one service only when given; None leaves the service's own default.
_DEFAULTED_BY_THE_SERVICE = (
    ("--stall-timeout-s", positive, "the router's per-hop progress bound (default: the router's)"),
    (
        "--max-concurrent-requests",
        at_least(1),
        "the router's admission slots (default: the router's)",
    ),
    (
        "--max-queued-requests",
        at_least(0),
        "requests waiting for a slot before 429 (default: the router's)",
    ),
    (
        "--queue-timeout-s",
        non_negative,
        "a request's wait limit in the admission queue before 429 (default: the router's)",
    ),
    (
        "--drain-timeout-s",
        non_negative,
        "on Ctrl-C / SIGTERM: how long the routers' requests in flight get to finish before "
        "the services stop (default: the router's, its request deadline)",
    ),
    (
        "--kv-quarantine-s",
        non_negative,
        "decode's rest for the pages of a failed reservation (default: decode's)",
    ),
    (
        "--embedding-quarantine-s",
        non_negative,
        "prefill's rest for the embedding rows of a timed-out Encode (default: prefill's)",
    ),
    ("--prefill-cp-block-tokens", at_least(1), "prefill's --cp-block-tokens (default: prefill's)"),
    (
        "--prefill-cp-min-tokens",
        at_least(0),
        "prefill's --cp-min-tokens: smaller batches run on one rank (default: prefill's)",
    ),
)


def add_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "up", help="start every service as its own process on this machine; restart any that exits"
    )
    p.add_argument(
        "--model", type=Path, default=BUNDLED_MODEL, help="Hugging Face checkpoint directory"
    )
    p.add_argument("--host", default="127.0.0.1", help="address the services and the HTTP API bind")
    p.add_argument("--port", type=port_number, default=8000, help="OpenAI-compatible HTTP port")
    p.add_argument(
        "--device", default="cpu", help="where the models run (each of the next three overrides it)"
    )
    p.add_argument(
        "--encoder-device", default=None, help="the vision encoder's device (default: --device)"
    )
    p.add_argument(
        "--encoder-ranks",
        type=int,
        default=None,
        help="the vision encoder's rank processes, all on its device (default: 1)",
    )
    p.add_argument(
        "--prefill-device", default=None, help="prefill's device, e.g. cuda:0 (default: --device)"
    )
    p.add_argument(
        "--decode-device",
        default=None,
        help="decode's device, e.g. cuda:1 (default: --device); a list (cuda:0,cuda:1) puts one "
        "data-parallel rank on each",
    )
    p.add_argument("--dtype", default=None)
    p.add_argument(
        "--transfer-backend",
        default=None,
        help="embedding transfer (and KV unless --kv-transfer-backend): "
        f"{' | '.join(CROSS_PROCESS_BACKENDS)}; shm: /dev/shm shared by this host's processes, "
        "no network port; cuda_ipc: GPU to GPU on one host (encoder and prefill on CUDA). "
        "Default: cuda_ipc when the encoder and prefill run on CUDA, else shm",
    )
    p.add_argument(
        "--kv-transfer-backend",
        default=None,
        choices=list(BACKENDS),
        help=f"{KV_BACKEND_HELP}, else cuda_ipc when prefill and decode run on CUDA, shm on the CPU",
    )
    p.add_argument(
        "--attention-backend",
        default=None,
        choices=ATTENTION_CHOICES,
        help=f"prefill and decode attention: {ATTENTION_HELP} (default: auto)",
    )
    p.add_argument(
        "--num-pages",
        type=at_least(1),
        default=None,
        help="decode KV pages per decode rank (default: sized from --gpu-memory-utilization on "
        "CUDA, decode's default on the CPU)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        "--mem-fraction-static",
        type=memory_fraction,
        default=None,
        help="share of each GPU the services hold together (weights, activations, CUDA graphs, "
        "KV pools): each prefill rank on a GPU is set "
        f"{PREFILL_SHARE:g} aside, each encoder rank {ENCODER_SHARE:g}, and decode's ranks "
        "size their KV pools to the rest "
        f"(default {DEFAULT_GPU_MEMORY_UTILIZATION:g})",
    )
    p.add_argument(
        "--decode-dp",
        type=at_least(1),
        default=1,
        help="decode's data-parallel ranks, each its own process with its own KV pool and "
        "batch, all on --decode-device",
    )
    p.add_argument(
        "--max-running-requests",
        type=at_least(1),
        default=None,
        help="decode's largest batch per rank (default: every request the routers admit, "
        "over the decode ranks; at least 256)",
    )
    p.add_argument(
        "--prefill-first-ms",
        type=non_negative,
        default=None,
        help="when prefill and decode share one device: the longest a decode step waits for "
        "prefill's forwards, so prompts run on the GPU alone (default: on for a CUDA device, "
        "with decode's default; 0: off)",
    )
    p.add_argument(
        "--router-workers",
        type=at_least(1),
        default=None,
        help="router processes sharing the HTTP port (default: one per 8 CPUs, 1 to 4)",
    )
    p.add_argument("--page-size", type=at_least(1), default=16)
    for flag, kind, help_text in _DEFAULTED_BY_THE_SERVICE:
        p.add_argument(flag, type=kind, default=None, help=help_text)
    p.add_argument(
        "--prefill-cp",
        type=at_least(1),
        default=1,
        help="prefill's context-parallel ranks, one process each (on --prefill-device; cuda: "
        "cuda:0 .. cuda:C-1)",
    )
    p.add_argument(
        "--ready-timeout-s",
        type=positive,
        default=300.0,
        help="how long a service may take to print READY, at start and after a restart",
    )
    p.add_argument(
        "--liveness-timeout-s",
        type=positive,
        default=10.0,
        help="a running service (or tokenizer worker process) that answers no liveness check "
        "for this long is killed and restarted",
    )
    p.add_argument(
        "--log-dir",
        type=Path,
        default=None,
        help="each service's log goes to <dir>/<service>.log (default: a new run directory "
        "under the temporary directory, printed at start)",
    )
    p.add_argument(
        "--served-model-name", default=None, help="model name in the API (default: the model dir's)"
    )
    p.add_argument(
        "--max-model-len",
        type=at_least(2),
        default=None,
        help=(
            "context limit, prompt + generated tokens "
            "(default: the model's max_position_embeddings)"
        ),
    )
    p.add_argument(
        "--log-level",
        type=str.upper,
        default=None,
        help=(
            "every service's log level: DEBUG, INFO, ... (default: STAGESERVE_LOG_LEVEL, else INFO)"
        ),
    )
    p.add_argument(
        "--log-format",
        type=str.lower,
        choices=("text", "json"),
        default=None,
        help="every service's log format; json: one object per line with request_id and "
        "trace_id (default: STAGESERVE_LOG_FORMAT, else text)",
    )
    p.add_argument(
        "--metrics-port-base",
        type=int,
        default=None,
        metavar="N",
        help="fixed /metrics ports N, N+1, ... for tokenizer, vision_encoder, prefill, "
        "decode, router (default: free ports, printed once ready)",
    )
    p.add_argument(
        "--state-file",
        type=Path,
        default=None,
        help="write pids and ports as JSON once ready (rewritten after a restart)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=(
            "key the API requires "
            "(passed to the router as STAGESERVE_API_KEY; default: that variable); a "
            "non-loopback --host needs one unless --insecure-no-api-key"
        ),
    )
    p.add_argument(
        INSECURE_NO_API_KEY_FLAG,
        action="store_true",
        help="serve the API without a key although --host is not a loopback address "
        "(anyone who reaches the port may call it)",
    )
    p.set_defaults(func=_run_up)


def _run_up(args: argparse.Namespace) -> int:
    import os

    from services.common.auth import child_environment
    from services.common.envs import Envs
    from services.common.exposure import check_api_exposure, check_transfer_exposure
    from services.common.logs import LOG_FORMATS
    from services.common.telemetry import tracing_plan
    from services.launch_spec import (
        LaunchConfig,
        LivenessPolicy,
        decode_devices,
        default_router_workers,
        device_of,
        with_gpu_share,
    )
    from services.launcher import new_run_dir, run_up

    envs = Envs.from_environ()
    try:  # fail here, not as a service that exits before READY
        check_up_args(args)
        has_api_key = bool(envs.api_key if args.api_key is None else args.api_key)
        check_api_exposure((args.host,), has_api_key, args.insecure_no_api_key)
        if args.encoder_ranks is not None and args.encoder_ranks < 1:
            raise ValueError(f"--encoder-ranks must be >= 1, got {args.encoder_ranks}")
        log_format = args.log_format or envs.log_format
        if log_format not in LOG_FORMATS:
            formats = ", ".join(LOG_FORMATS)
            raise ValueError(f"STAGESERVE_LOG_FORMAT must be one of {formats}, got {log_format!r}")
        tracing_plan(envs)  # the OTEL_* settings every service will read
        cfg = LaunchConfig(
            model=args.model.resolve(),
            host=args.host,
            http_port=args.port,
            device=args.device,
            encoder_device=args.encoder_device,
            encoder_ranks=args.encoder_ranks,
            prefill_device=args.prefill_device,
            decode_device=args.decode_device,
            dtype=args.dtype,
            num_pages=args.num_pages,
            page_size=args.page_size,
            stall_timeout_s=args.stall_timeout_s,
            kv_quarantine_s=args.kv_quarantine_s,
            max_concurrent_requests=args.max_concurrent_requests,
            max_queued_requests=args.max_queued_requests,
            queue_timeout_s=args.queue_timeout_s,
            drain_timeout_s=args.drain_timeout_s,
            embedding_quarantine_s=args.embedding_quarantine_s,
            ready_timeout_s=args.ready_timeout_s,
            liveness=LivenessPolicy(args.liveness_timeout_s),
            prefill_cp=args.prefill_cp,
            prefill_cp_block_tokens=args.prefill_cp_block_tokens,
            prefill_cp_min_tokens=args.prefill_cp_min_tokens,
            log_dir=args.log_dir or new_run_dir(),
            log_format=log_format,
            log_level=args.log_level,
            metrics_port_base=args.metrics_port_base,
            state_file=args.state_file,
            served_model_name=args.served_model_name,
            max_model_len=args.max_model_len,
            decode_dp=args.decode_dp,
            max_running_requests=args.max_running_requests,
            router_workers=args.router_workers or default_router_workers(),
            insecure_no_api_key=args.insecure_no_api_key,
        )
        num_decode_devices = len(decode_devices(cfg))
        if num_decode_devices > 1 and args.decode_dp not in (1, num_decode_devices):
            raise ValueError(
                f"--decode-dp {args.decode_dp} disagrees with --decode-device "
                f"({num_decode_devices} devices)"
            )
        check_prefill_cp(cfg)
        cfg, chosen = _with_device_choices(cfg, args)
        transfer_backend = cfg.transfer_backend
        check_cross_process(transfer_backend, "up runs every service as its own process")
        cfg = with_gpu_share(cfg, args.prefill_first_ms)
        check_embedding_backend(  # the two ends of the embedding rows
            transfer_backend, (device_of(cfg, "vision_encoder"), device_of(cfg, "prefill"))
        )
        for device in (
            device_of(cfg, "prefill"),
            *decode_devices(cfg),
        ):  # the two ends of the KV handoff
            check_kv_backend(cfg.kv_transfer_backend, transfer_backend, device)
        kv_backend = resolve_kv_backend(cfg.kv_transfer_backend, transfer_backend)
        check_cross_process(kv_backend, "up runs every service as its own process")
        exposure = check_transfer_exposure(args.host, (transfer_backend, kv_backend))
        env = child_environment(
            os.environ, api_key=args.api_key
        )  # AuthConfigError: a bad --api-key
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if exposure is not None:
        print(f"warning: {exposure}", file=sys.stderr)
    print(f"stageserve up: {chosen}", file=sys.stderr, flush=True)
    return run_up(cfg, env)


def _with_device_choices(cfg: LaunchConfig, args: argparse.Namespace) -> tuple[LaunchConfig, str]:
    """``cfg`` with the backends and decode's memory share chosen for its devices
    (``services.cli_up_defaults``), and the line that says them."""
    from dataclasses import replace

    from services.engine.gpu_defaults import flashinfer_importable

    named = (cfg.device, cfg.encoder_device, cfg.prefill_device, cfg.decode_device)
    num_cuda_devices = 0
    if any("cuda" in (device or "") for device in named):
        import torch

        num_cuda_devices = torch.cuda.device_count()
    layout = rank_layout(cfg, num_cuda_devices)
    flags = UpFlags(
        args.transfer_backend,
        args.kv_transfer_backend,
        args.attention_backend,
        args.gpu_memory_utilization,
        args.num_pages,
    )
    choices = resolve_up(layout, flags, num_cuda_devices, flashinfer_importable())
    cfg = replace(
        cfg,
        transfer_backend=choices.transfer_backend,
        kv_transfer_backend=choices.kv_transfer_backend,
        attention_backend=choices.attention_backend,
        decode_memory_fraction=choices.decode_memory_fraction,
    )
    return cfg, choices.describe(layout, flags)
