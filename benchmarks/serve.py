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
How each number is measured: ``benchmarks/serve_client.py`` and ``serve_metrics.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import httpx

from benchmarks.serve_client import Outcome, RequestRecord, new_record, send_request
from benchmarks.serve_dataset import DatasetSpec
from benchmarks.serve_images import IMAGE_FORMATS, IMAGE_KINDS, parse_size
from benchmarks.serve_metrics import Slo, Summary, format_table, markdown_table, summarize
from benchmarks.serve_tokens import (
    LocalTokenCounter,
    ServerTokenCounter,
    TokenCounter,
    TokenCountError,
    tokenize_url,
)
from benchmarks.serve_workload import (
    BACKENDS,
    ENDPOINTS,
    IntRange,
    RequestSpec,
    WorkloadSpec,
    arrival_offsets,
    make_requests,
)


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    model: str | None  # None: the first of GET /models
    api_key: str | None
    tokenizer: Path | None  # a tokenizer.json (or its directory); None: the server's /tokenize
    request_rate: float  # req/s; inf = all at once
    max_concurrency: int | None
    num_requests: int
    seed: int
    workload: WorkloadSpec
    request_timeout_s: float
    max_duration_s: float
    slo: Slo
    output_json: Path | None
    markdown: Path | None


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


class EndpointError(Exception):
    """The endpoint cannot say which model it serves (not retried: the run never starts)."""


async def first_model(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> str:
    url = f"{base_url}/models"
    try:
        response = await client.get(url, headers=headers)
        response.raise_for_status()
        models = response.json().get("data") or []
        return models[0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        raise EndpointError(
            f"cannot read the first model from GET {url} ({exc!r}); pass --model"
        ) from exc


class _Run:
    """Sends the prepared requests on their schedule and collects the records."""

    def __init__(
        self, cfg: BenchConfig, client: httpx.AsyncClient, headers: dict[str, str]
    ) -> None:
        self.cfg = cfg
        self.client = client
        self.headers = headers
        self.url = cfg.base_url + ENDPOINTS[cfg.workload.backend]
        self.slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        self.started: set[int] = set()
        self.t0 = 0.0

    async def _one(self, spec: RequestSpec, offset_s: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, self.t0 + offset_s - time.perf_counter()))
        if self.slots is None:
            return await self._send(spec)
        async with self.slots:
            return await self._send(spec)

    async def _send(self, spec: RequestSpec) -> RequestRecord:
        self.started.add(spec.index)
        return await send_request(
            self.client, self.url, self.headers, spec, self.cfg.request_timeout_s, self.t0
        )

    async def run(self, specs: list[RequestSpec]) -> tuple[list[RequestRecord], float]:
        """Records of every request sent (aborted ones included) and the run's duration."""
        offsets = arrival_offsets(len(specs), self.cfg.request_rate, self.cfg.seed)
        self.t0 = time.perf_counter()
        tasks = {
            asyncio.create_task(self._one(s, o)): s for s, o in zip(specs, offsets, strict=True)
        }
        done, pending = await asyncio.wait(tasks, timeout=self.cfg.max_duration_s)
        duration_s = time.perf_counter() - self.t0
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        records = [t.result() for t in done]
        for task in pending:
            spec = tasks[task]
            if spec.index in self.started:
                records.append(
                    replace(
                        new_record(spec),
                        outcome=Outcome.ABORTED,
                        error="aborted at --max-duration-s",
                    )
                )
        return sorted(records, key=lambda r: r.index), duration_s


@dataclass(frozen=True)
class BenchRun:
    model: str
    records: list[RequestRecord]
    t0: float  # time.perf_counter() when sending began; each record's start_s counts from it
    duration_s: float  # t0 to the last request's end


async def run_benchmark(
    cfg: BenchConfig, before_start: Callable[[], None] | None = None
) -> BenchRun:
    """Resolve the model, build the requests, run them.

    ``before_start`` is called once the requests are built, just before the clock starts (the
    system benchmark's client processes wait there for each other, so that they start
    together)."""
    headers = {"content-type": "application/json"}
    if cfg.api_key:
        headers["Authorization"] = f"Bearer {cfg.api_key}"
    limits = httpx.Limits(
        max_connections=cfg.max_concurrency, max_keepalive_connections=cfg.max_concurrency
    )
    timeout = httpx.Timeout(cfg.request_timeout_s)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        model = cfg.model or await first_model(client, cfg.base_url, headers)
        print(
            f"preparing {cfg.num_requests} requests for {model!r} at {cfg.base_url}",
            file=sys.stderr,
        )
        counter: TokenCounter = (
            LocalTokenCounter(cfg.tokenizer)
            if cfg.tokenizer
            else ServerTokenCounter(client, tokenize_url(cfg.base_url), model, headers)
        )
        specs = await make_requests(model, cfg.workload, cfg.num_requests, cfg.seed, counter)
        if before_start is not None:
            before_start()
        run = _Run(cfg, client, headers)
        records, duration_s = await run.run(specs)
    return BenchRun(model, records, run.t0, duration_s)


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
