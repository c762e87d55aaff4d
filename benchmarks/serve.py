"""Serving benchmark client for any OpenAI-compatible endpoint (stageserve, vLLM, SGLang, ...).

    python -m benchmarks.serve --base-url http://127.0.0.1:8000/v1 --num-requests 200 \\
        --request-rate 8 --input-len-range 256:1024 --output-len 128 --ignore-eos \\
        --images-per-request 0:2 --image-size 640x480 --slo-ttft-ms 500 --slo-tpot-ms 50 \\
        --output-json run.json --markdown docs/benchmarks.md

Workload, as vLLM's and sglang's clients build it at the same flags: ``--input-len`` is
prompt tokens counted with the model's tokenizer (``--tokenizer``, else the server's
``/tokenize``), the chat template's tokens coming on top; images are random-noise JPEGs
(quality 90) unless ``--image-kind`` / ``--image-format`` say otherwise;
``--dataset-name sharegpt --dataset-path FILE`` takes prompts from a local ShareGPT
file; ``--backend openai-chat`` (default) or ``openai`` (text completions).

Load: ``--request-rate R`` sends on a Poisson process (``inf``, the default, sends all at
once); ``--max-concurrency C`` caps requests in flight (alone it is a closed loop of C
clients); both together give Poisson arrivals with a cap. Requests and images are built
before the clock starts. Every request has ``--request-timeout-s``; the run stops at
``--max-duration-s`` (requests in flight are aborted and counted, unsent ones are not
sent). Traffic goes only to ``--base-url`` (proxy environment variables are ignored).
The run itself is ``benchmarks/serve_run.py``; how each number is measured:
``benchmarks/serve_client.py`` and ``serve_metrics.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

from benchmarks.serve_client import RequestRecord
from benchmarks.serve_dataset import DatasetSpec
from benchmarks.serve_images import IMAGE_FORMATS, IMAGE_KINDS, parse_size
from benchmarks.serve_metrics import Slo, Summary, format_table, markdown_table, summarize
from benchmarks.serve_run import BenchConfig, EndpointError, run_benchmark
from benchmarks.serve_tokens import TokenCountError
from benchmarks.serve_workload import BACKENDS, IntRange, WorkloadSpec


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="stageserve bench serve", description=__doc__.split("\n")[0])
    p.add_argument(
        "--base-url", default="http://127.0.0.1:8000/v1", help="OpenAI API root, ending in /v1"
    )
    p.add_argument(
        "--model", default=None, help="default: the first model of GET {base-url}/models"
    )
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals, req/s (inf: all at once)",
    )
    p.add_argument(
        "--max-concurrency", type=int, default=None, help="most requests in flight (closed loop)"
    )
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default="openai-chat",
        help="openai-chat: /chat/completions; openai: /completions (no template, no images)",
    )
    p.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="tokenizer.json (or a model directory) to count tokens; default: POST /tokenize",
    )
    p.add_argument("--dataset-name", choices=("random", "sharegpt"), default="random")
    p.add_argument("--dataset-path", type=Path, default=None, help="a local ShareGPT JSON file")
    p.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="max_tokens (default: the reply's tokens)",
    )
    p.add_argument(
        "--sharegpt-context-len", type=int, default=None, help="skip longer prompt + reply pairs"
    )
    p.add_argument(
        "--input-len", type=int, default=256, help="prompt tokens, chat template not included"
    )
    p.add_argument(
        "--input-len-range", default=None, metavar="A:B", help="uniform random prompt length"
    )
    p.add_argument("--output-len", type=int, default=128, help="max_tokens")
    p.add_argument(
        "--output-len-range", default=None, metavar="A:B", help="uniform random max_tokens"
    )
    p.add_argument("--images-per-request", default="0", metavar="N|A:B", help="images per request")
    p.add_argument(
        "--image-size", default="640x480", metavar="WxH", help="or 4k, 1080p, 720p, 360p"
    )
    p.add_argument(
        "--image-kind", choices=IMAGE_KINDS, default="noise", help="pixels (default: noise)"
    )
    p.add_argument(
        "--image-format", choices=IMAGE_FORMATS, default="jpeg", help="jpeg (quality 90) or png"
    )
    p.add_argument(
        "--ignore-eos", action="store_true", help="send ignore_eos: true (fixed output lengths)"
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument(
        "--max-duration-s", type=float, default=1800.0, help="the whole run stops after this"
    )
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-e2e-ms", type=float, default=None)
    p.add_argument(
        "--output-json", type=Path, default=None, help="config, per-request records and summary"
    )
    p.add_argument(
        "--markdown", type=Path, default=None, help="append a markdown table to this file"
    )
    return p


def _dataset(args: argparse.Namespace) -> DatasetSpec | None:
    if args.dataset_name == "random":
        if args.dataset_path or args.sharegpt_output_len or args.sharegpt_context_len:
            raise ValueError("--dataset-path and --sharegpt-* need --dataset-name sharegpt")
        return None
    if args.dataset_path is None:
        raise ValueError(
            "--dataset-name sharegpt needs --dataset-path (a local file; nothing is downloaded)"
        )
    if args.input_len_range or args.output_len_range:
        raise ValueError("--input-len-range / --output-len-range apply to --dataset-name random")
    if (args.sharegpt_output_len or 1) < 1:
        raise ValueError("--sharegpt-output-len must be >= 1")
    return DatasetSpec(args.dataset_path, args.sharegpt_output_len, args.sharegpt_context_len)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    workload = WorkloadSpec(
        input_len=IntRange.parse(args.input_len_range or str(args.input_len)),
        output_len=IntRange.parse(args.output_len_range or str(args.output_len)),
        num_images=IntRange.parse(args.images_per_request),
        image_size=parse_size(args.image_size),
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        backend=args.backend,
        image_kind=args.image_kind,
        image_format=args.image_format,
        dataset=_dataset(args),
    )
    if workload.output_len.low < 1:
        raise ValueError("output lengths must be >= 1")
    if workload.backend == "openai" and workload.num_images.high:
        raise ValueError("--backend openai sends text completions: no images (use openai-chat)")
    if args.request_rate <= 0 or args.num_requests < 1 or (args.max_concurrency or 1) < 1:
        raise ValueError("--request-rate, --num-requests and --max-concurrency must be positive")
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms, args.slo_e2e_ms)
    return BenchConfig(
        base_url=args.base_url.rstrip("/"),
        model=args.model,
        api_key=args.api_key,
        tokenizer=args.tokenizer,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        num_requests=args.num_requests,
        seed=args.seed,
        workload=workload,
        request_timeout_s=args.request_timeout_s,
        max_duration_s=args.max_duration_s,
        slo=slo,
        output_json=args.output_json,
        markdown=args.markdown,
    )


def _jsonable(value: object) -> object:
    if isinstance(value, float) and value == float("inf"):
        return "inf"
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def write_json(
    path: Path, cfg: BenchConfig, model: str, records: list[RequestRecord], summary: Summary
) -> None:
    report = {
        "config": {**asdict(cfg), "model": model, "api_key": "<redacted>" if cfg.api_key else None},
        "summary": asdict(summary),
        "requests": [asdict(r) for r in records],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(report), indent=1))


def describe(cfg: BenchConfig, model: str) -> str:
    load = f"rate {cfg.request_rate:g} req/s" + (
        f", concurrency {cfg.max_concurrency}" if cfg.max_concurrency else ""
    )
    w = cfg.workload
    prompts = (
        f"sharegpt {w.dataset.path.name}"
        if w.dataset
        else f"input {w.input_len} tokens, output {w.output_len}"
    )
    images = (
        f"images {w.num_images} of {w.image_size[0]}x{w.image_size[1]} "
        f"{w.image_kind} {w.image_format}"
        if w.num_images.high
        else "no images"
    )
    eos = " (ignore_eos)" if w.ignore_eos else ""
    head = f"{model} @ {cfg.base_url} ({w.backend}): {cfg.num_requests} requests, {load}"
    return f"{head}, {prompts}{eos}, {images}"


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; 0 when at least one request succeeded, 1 when none did, 2 on bad
    arguments."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))  # exits with status 2
    try:
        run = asyncio.run(run_benchmark(cfg))
    except (EndpointError, TokenCountError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a dataset file that cannot serve the run
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model, records = run.model, run.records
    summary = summarize(records, run.duration_s, cfg.slo, cfg.num_requests)
    title = describe(cfg, model)
    print(f"\n{title}\n{format_table(summary)}")
    errors = sorted({r.error for r in records if r.error})
    for error in errors[:5]:
        print(f"error: {error}", file=sys.stderr)
    if cfg.output_json:
        write_json(cfg.output_json, cfg, model, records, summary)
    if cfg.markdown:
        command = "stageserve bench serve " + shlex.join(sys.argv[1:] if argv is None else argv)
        with cfg.markdown.open("a") as f:
            f.write(markdown_table(summary, title, command))
    return 0 if summary.num_ok else 1


if __name__ == "__main__":
    sys.exit(main())
