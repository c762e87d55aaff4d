"""The ``stageserve`` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from services.cli_up import add_up
from services.cli_up_checks import check_prefill_cp as check_prefill_cp
from services.common.errors import StageServeError
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
    from services.common.types import SamplingParams
    from services.engine.offline import OfflinePipeline

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


def _add_join_rank(sub: argparse._SubParsersAction) -> None:
    """Listed for --help only: ``main`` hands ``join-rank``'s flags to its own parser."""
    sub.add_parser(
        "join-rank",
        help="run one rank of a service's rank group from another host (a LeaderWorkerSet "
        "worker); `stageserve join-rank --help` lists its flags",
    )


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
    add_up(sub)
    _add_serve(sub)
    _add_bench(sub)
    _add_join_rank(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["join-rank"]:  # its flags start with dashes: argparse would take them
        from services.common.ranks.join import main as join_main

        return join_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except StageServeError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
