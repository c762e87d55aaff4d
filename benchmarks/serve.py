"""Serving benchmark client for any OpenAI-compatible endpoint (stageserve, vLLM, SGLang, ...).

    python -m benchmarks.serve --base-url http://127.0.0.1:8000/v1 --num-requests 200 \\
        --request-rate 8 --input-len-range 256:1024 --output-len 128 --ignore-eos \\
        --images-per-request 0:2 --image-size 640x480 --slo-ttft-ms 500 --slo-tpot-ms 50 \\
        --output-json run.json --markdown docs/benchmarks.md

Workload, as vLLM's and sglang's clients build it at the same flags: ``--input-len`` is
prompt tokens counted on the client with the model's tokenizer (``--tokenizer``, by default
``--model``'s tokenizer.json; ``--tokenizer server``: the server's ``/tokenize``), the chat
template's tokens coming on top; images are random-noise JPEGs
(quality 90) unless ``--image-kind`` / ``--image-format`` say otherwise;
``--dataset-name sharegpt --dataset-path FILE`` takes prompts from a local ShareGPT
file, ``--dataset-name prefix_repetition`` shares prefixes between prompts (vLLM's flags),
``--dataset-name multi_turn`` sends conversations turn after turn with their history,
``--dataset-name mooncake --dataset-path TRACE`` replays a Mooncake trace at its timestamps;
``--backend openai-chat`` (default) or ``openai`` (text completions); responses are
streamed unless ``--disable-stream``; ``--extra-body JSON`` is merged into every request body.

Load: ``--request-rate R`` sends on a Poisson process (``inf``, the default, sends all at
once), or burstier (``--burstiness`` < 1) or steadier (> 1) gamma arrivals at the same rate;
``--max-concurrency C`` caps requests in flight (alone it is a closed loop of C clients); both
together give Poisson arrivals with a cap. Requests and images are built before the clock
starts; ``--num-warmups N`` requests (prompts and images of their own) are sent and waited for
before it, and left out of the results. Every request has ``--request-timeout-s``; the run stops at
``--max-duration-s`` (requests in flight are aborted and counted, unsent ones are not
sent). Traffic goes only to ``--base-url`` (proxy environment variables are ignored).
The run itself is ``benchmarks/serve_run.py``; how each number is measured:
``benchmarks/serve_client.py`` and ``serve_metrics.py``; ``--output-json`` has the fields of
``vllm bench serve``'s result file, then ours (``benchmarks/serve_result.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
from pathlib import Path

from benchmarks.serve_dataset import MooncakeTraceSpec, MultiTurnSpec, ShareGptSpec
from benchmarks.serve_dataset_flags import add_dataset_flags, dataset_from_args
from benchmarks.serve_images import IMAGE_FORMATS, IMAGE_KINDS, parse_size
from benchmarks.serve_metrics import Slo, format_table, markdown_table, summarize
from benchmarks.serve_result import write_json
from benchmarks.serve_run import BenchConfig, EndpointError, run_benchmark
from benchmarks.serve_tokens import SERVER_TOKENIZER, TokenCountError
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
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps (1: Poisson; < 1 burstier, > 1 steadier)",
    )
    p.add_argument(
        "--max-concurrency", type=int, default=None, help="most requests in flight (closed loop)"
    )
    p.add_argument(
        "--num-warmups", type=int, default=0, help="requests sent before the run, not timed"
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
        default=None,
        help="tokenizer.json or a model directory to count tokens with (default: the model's, "
        f"a local directory or the Hugging Face cache); '{SERVER_TOKENIZER}': POST /tokenize",
    )
    add_dataset_flags(p)
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
    p.add_argument(
        "--extra-body",
        default=None,
        metavar="JSON",
        help="a JSON object merged into every request body (after the client's own fields)",
    )
    p.add_argument(
        "--disable-stream", action="store_true", help="one JSON reply per request: no ITL, TPOT"
    )
    p.add_argument(
        "--metric-percentiles",
        default="50,90,99",
        help="comma-separated latency percentiles to report",
    )
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
        dataset=dataset_from_args(args),
        stream=not args.disable_stream,
        extra_body=_extra_body(args.extra_body),
    )
    if workload.output_len.low < 1:
        raise ValueError("output lengths must be >= 1")
    if workload.backend == "openai" and isinstance(workload.dataset, MultiTurnSpec):
        raise ValueError("--dataset-name multi_turn sends chats: use --backend openai-chat")
    if (
        isinstance(workload.dataset, MultiTurnSpec)
        and args.num_requests % workload.dataset.num_turns
    ):
        raise ValueError("--num-requests counts every turn: a multiple of --multi-turn-num-turns")
    if workload.backend == "openai" and workload.num_images.high:
        raise ValueError("--backend openai sends text completions: no images (use openai-chat)")
    is_trace = isinstance(workload.dataset, MooncakeTraceSpec)
    if is_trace and (args.request_rate != float("inf") or args.burstiness != 1.0):
        raise ValueError(
            "--dataset-name mooncake sends at the trace's timestamps: no --request-rate"
        )
    if args.request_rate <= 0 or args.num_requests < 1 or (args.max_concurrency or 1) < 1:
        raise ValueError("--request-rate, --num-requests and --max-concurrency must be positive")
    if args.burstiness <= 0 or args.num_warmups < 0:
        raise ValueError("--burstiness must be positive and --num-warmups at least 0")
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
        burstiness=args.burstiness,
        num_warmups=args.num_warmups,
        percentiles=_percentiles(args.metric_percentiles),
    )


def _extra_body(text: str | None) -> dict:
    if text is None:
        return {}
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--extra-body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ValueError("--extra-body must be a JSON object")
    return body


def _percentiles(text: str) -> tuple[float, ...]:
    try:
        percentiles = tuple(float(p) for p in text.split(","))
    except ValueError as exc:
        raise ValueError(f"--metric-percentiles {text!r}: numbers separated by commas") from exc
    if not all(0 < p < 100 for p in percentiles):
        raise ValueError("--metric-percentiles must be between 0 and 100 (exclusive)")
    return percentiles


def describe(cfg: BenchConfig, model: str) -> str:
    burst = f" (burstiness {cfg.burstiness:g})" if cfg.burstiness != 1.0 else ""
    load = f"rate {cfg.request_rate:g} req/s{burst}" + (
        f", concurrency {cfg.max_concurrency}" if cfg.max_concurrency else ""
    )
    w = cfg.workload
    if isinstance(w.dataset, ShareGptSpec):
        prompts = f"sharegpt {w.dataset.path.name}"
    elif w.dataset is not None:
        prompts = w.dataset.name
    else:
        prompts = f"input {w.input_len} tokens, output {w.output_len}"

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
    summary = summarize(records, run.duration_s, cfg.slo, cfg.num_requests, cfg.percentiles)
    title = describe(cfg, model)
    print(f"\n{title}\n{format_table(summary)}")
    errors = sorted({r.error for r in records if r.error})
    for error in errors[:5]:
        print(f"error: {error}", file=sys.stderr)
    if cfg.output_json:
        write_json(cfg.output_json, cfg, run, summary)
    if cfg.markdown:
        command = "stageserve bench serve " + shlex.join(sys.argv[1:] if argv is None else argv)
        with cfg.markdown.open("a") as f:
            f.write(markdown_table(summary, title, command))
    return 0 if summary.num_ok else 1


if __name__ == "__main__":
    sys.exit(main())
