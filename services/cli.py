"""The ``stageserve`` command."""

from __future__ import annotations

import argparse
import socket
import sys
from collections.abc import Callable
from pathlib import Path

from services.common.errors import StageServeError
from services.common.kv_transfer import (
    KV_BACKEND_HELP,
    SERVICE_KV_BACKENDS,
    check_embedding_backend,
    check_kv_backend,
    default_embedding_backend,
)
from services.common.paths import BUNDLED_MODEL


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="run the engine in this process and print the continuation")
    p.add_argument(
        "--model", type=Path, default=BUNDLED_MODEL, help="Hugging Face checkpoint directory"
    )
    p.add_argument("--prompt", required=True, help="user message")
    p.add_argument(
        "--image", action="append", default=[], type=Path, help="image file (repeatable)"
    )
    p.add_argument(
        "--system", default=None, help="system message (the chat template's default if omitted)"
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)"
    )
    p.add_argument("--attention-backend", default="torch")
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from services.engine.offline import OfflinePipeline
    from services.engine.sampler import SamplingParams

    pipeline = OfflinePipeline.from_dir(
        args.model, device=args.device, dtype=args.dtype, attention_backend=args.attention_backend
    )
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_new_tokens=args.max_tokens,
    )
    images = [path.read_bytes() for path in args.image]
    result = pipeline.chat(args.prompt, images, params, system=args.system)
    print(result.text)
    print(
        f"[{result.num_prompt_tokens} prompt tokens, {len(result.token_ids)} generated, "
        f"finish_reason={result.finish_reason}]",
        file=sys.stderr,
    )
    return 0


SERVICES = ("tokenizer", "vision_encoder", "prefill", "decode", "router")


def _at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in [0, 65535], got {value}")
    return value


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _check_up(args: argparse.Namespace) -> None:
    """What `up` can tell before starting anything: ``ValueError`` naming the cause."""
    if not (args.model / "config.json").is_file():
        raise ValueError(f"no config.json in model directory {args.model}")
    if args.port:
        family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((args.host, args.port))
            except OSError as exc:
                raise ValueError(
                    f"cannot bind the HTTP port {args.host}:{args.port}: {exc.strerror}"
                ) from None


def _add_up(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "up", help="start every service as its own process on this machine; restart any that exits"
    )
    p.add_argument(
        "--model", type=Path, default=BUNDLED_MODEL, help="Hugging Face checkpoint directory"
    )
    p.add_argument("--host", default="127.0.0.1", help="address the services and the HTTP API bind")
    p.add_argument("--port", type=_port, default=8000, help="OpenAI-compatible HTTP port")
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
        help="embedding transfer (and KV unless --kv-transfer-backend): shm | cuda_ipc | mooncake; "
        "shm: /dev/shm shared by this host's processes, no network port; cuda_ipc: GPU to GPU "
        "on one host (encoder and prefill on CUDA). Default: cuda_ipc when "
        "--kv-transfer-backend is cuda_ipc and the encoder and prefill run on CUDA, else shm",
    )
    p.add_argument(
        "--kv-transfer-backend", default=None, choices=SERVICE_KV_BACKENDS, help=KV_BACKEND_HELP
    )
    p.add_argument(
        "--attention-backend",
        default="torch",
        help="prefill and decode attention: torch | flashinfer",
    )
    p.add_argument(
        "--num-pages", type=_at_least(1), default=16384, help="decode KV pages (per decode rank)"
    )
    p.add_argument(
        "--decode-dp",
        type=_at_least(1),
        default=1,
        help="decode's data-parallel ranks, each its own process with its own KV pool and "
        "batch, all on --decode-device",
    )
    p.add_argument(
        "--router-workers",
        type=_at_least(1),
        default=None,
        help="router processes sharing the HTTP port (default: one per 8 CPUs, 1 to 4)",
    )
    p.add_argument("--page-size", type=_at_least(1), default=16)
    p.add_argument(
        "--stall-timeout-s",
        type=_positive,
        default=None,
        help="the router's per-hop progress bound (default: the router's)",
    )
    p.add_argument(
        "--max-concurrent-requests",
        type=_at_least(1),
        default=None,
        help="the router's admission slots (default: the router's)",
    )
    p.add_argument(
        "--max-queued-requests",
        type=_at_least(0),
        default=None,
        help="requests waiting for a slot before 429 (default: the router's)",
    )
    p.add_argument(
        "--queue-timeout-s",
        type=_non_negative,
        default=None,
        help="a request's wait limit in the admission queue before 429 (default: the router's)",
    )
    p.add_argument(
        "--kv-quarantine-s",
        type=_non_negative,
        default=None,
        help="decode's rest for the pages of a failed reservation (default: decode's)",
    )
    p.add_argument(
        "--embedding-quarantine-s",
        type=_non_negative,
        default=None,
        help="prefill's rest for the embedding rows of a timed-out Encode (default: prefill's)",
    )
    p.add_argument(
        "--prefill-cp",
        type=_at_least(1),
        default=1,
        help="prefill's context-parallel ranks, one process each (on --prefill-device; cuda: "
        "cuda:0 .. cuda:C-1)",
    )
    p.add_argument(
        "--prefill-cp-block-tokens",
        type=_at_least(1),
        default=None,
        help="prefill's --cp-block-tokens (default: prefill's)",
    )
    p.add_argument(
        "--prefill-cp-min-tokens",
        type=_at_least(0),
        default=None,
        help="prefill's --cp-min-tokens: smaller batches run on one rank (default: prefill's)",
    )
    p.add_argument(
        "--ready-timeout-s",
        type=_positive,
        default=300.0,
        help="how long a service may take to print READY, at start and after a restart",
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
        type=_at_least(2),
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
            "(passed to the router as STAGESERVE_API_KEY; default: that variable)"
        ),
    )
    p.set_defaults(func=_run_up)


def _run_up(args: argparse.Namespace) -> int:
    import os

    from services.common.auth import child_environment
    from services.common.envs import Envs
    from services.common.logs import LOG_FORMATS
    from services.common.telemetry import tracing_plan
    from services.launch_spec import (
        LaunchConfig,
        decode_devices,
        default_router_workers,
        device_of,
    )
    from services.launcher import new_run_dir, run_up

    envs = Envs.from_environ()
    try:  # fail here, not as a service that exits before READY
        _check_up(args)
        transfer_backend = args.transfer_backend or default_embedding_backend(
            args.kv_transfer_backend,
            args.encoder_device or args.device,
            args.prefill_device or args.device,
        )
        if transfer_backend == "inprocess":
            raise ValueError(
                "--transfer-backend inprocess moves tensors inside one process; up runs every "
                "service as its own process: use shm (one host) or mooncake"
            )
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
            transfer_backend=transfer_backend,
            kv_transfer_backend=args.kv_transfer_backend,
            attention_backend=args.attention_backend,
            num_pages=args.num_pages,
            page_size=args.page_size,
            stall_timeout_s=args.stall_timeout_s,
            kv_quarantine_s=args.kv_quarantine_s,
            max_concurrent_requests=args.max_concurrent_requests,
            max_queued_requests=args.max_queued_requests,
            queue_timeout_s=args.queue_timeout_s,
            embedding_quarantine_s=args.embedding_quarantine_s,
            ready_timeout_s=args.ready_timeout_s,
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
            router_workers=args.router_workers or default_router_workers(),
        )
        num_decode_devices = len(decode_devices(cfg))
        if num_decode_devices > 1 and args.decode_dp not in (1, num_decode_devices):
            raise ValueError(
                f"--decode-dp {args.decode_dp} disagrees with --decode-device "
                f"({num_decode_devices} devices)"
            )
        check_prefill_cp(cfg)
        check_embedding_backend(  # the two ends of the embedding rows
            transfer_backend, (device_of(cfg, "vision_encoder"), device_of(cfg, "prefill"))
        )
        for device in (
            device_of(cfg, "prefill"),
            *decode_devices(cfg),
        ):  # the two ends of the KV handoff
            check_kv_backend(args.kv_transfer_backend, transfer_backend, device)
        env = child_environment(
            os.environ, api_key=args.api_key
        )  # AuthConfigError: a bad --api-key
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return run_up(cfg, env)


def check_prefill_cp(cfg) -> None:
    """``ValueError`` naming ``--prefill-cp`` (or its block size) when prefill could not start
    with it."""
    from services.launch_spec import device_of
    from services.prefill.config import check_block_tokens, rank_devices

    if cfg.prefill_cp < 1:
        raise ValueError(f"--prefill-cp {cfg.prefill_cp} must be >= 1")
    rank_devices(device_of(cfg, "prefill"), "", cfg.prefill_cp, flag="--prefill-cp")
    if cfg.prefill_cp_block_tokens is not None:
        check_block_tokens(cfg.prefill_cp_block_tokens, cfg.page_size)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="start one service (multi-machine deployments)",
        description="Start one service; `stageserve serve SERVICE --help` lists its flags.",
    )
    p.add_argument("service", choices=SERVICES)
    p.add_argument("service_args", nargs=argparse.REMAINDER, help="the service's own flags")
    p.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    import importlib

    module = importlib.import_module(f"services.{args.service}.__main__")
    return module.main(args.service_args)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmarks: 'serve' (any OpenAI endpoint) or 'engine' (GPU)",
        description="Run a benchmark; `stageserve bench KIND --help` lists its flags.",
    )
    p.add_argument("kind", choices=("serve", "engine"))
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    p.set_defaults(func=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    import importlib

    return importlib.import_module(f"benchmarks.{args.kind}").main(args.bench_args)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("stageserve")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "unknown (stageserve is not installed: no package metadata)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stageserve", description="Disaggregated multimodal LLM serving."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_up(sub)
    _add_serve(sub)
    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except StageServeError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
