"""Image TTFT benchmark: one image request at a time through the whole system at real model size.

    python -m benchmarks.image_ttft [--out docs/benchmarks.md] [--num-requests 10]
        [--large-size 1920x1080] [--small-size 640x480]
    python -m benchmarks.image_ttft --config benchmarks/configs/qwen3-vl-8b
        # Qwen3-VL-8B dimensions (16-pixel patches: 1920x1080 is 68x120 patches, 2,040 tokens),
        # its own checkpoint ($TMPDIR/stageserve-qwen3-vl-8b-random) and its own section
    python -m benchmarks.image_ttft --quick   # CPU smoke run on the bundled tiny model
    python -m benchmarks.image_ttft --quick --config services/assets/tiny-qwen3-vl
        # CPU smoke run of a random checkpoint of a Qwen3-VL config (its tokenizer and processor)
    python -m benchmarks.image_ttft --trace   # also each row's span timeline

Writes (or reuses) the system benchmark's checkpoint of ``--config``'s dimensions (default
Qwen2.5-VL-7B's; vision tower included, random bf16 weights, the config's preprocessor: see
benchmarks/system_model.py; one checkpoint directory per config unless ``--checkpoint-dir``),
starts ``stageserve up`` on it once (as
``benchmarks.system`` does), warms it up with a text request and one image of each size, then
sends ``--num-requests`` requests per row at concurrency 1, max_tokens 1, the same text prompt
in every row: text only; a fresh ``--large-size`` noise JPEG (quality 90, what sglang's and
vLLM's bench tools send) per request, so every one misses the embedding cache; the same large
image every time (its first request, a miss, is left out); a fresh ``--small-size`` one. Prints
one table (the client's TTFT, the encoder's and prefill's own times from their histograms over
the row, cache hits and misses) and writes its section of ``--out`` (the 7B's ``SECTION_TITLE``;
another config's section names it). With ``--trace`` every
service exports its spans to a receiver in this process (``benchmarks/span_timeline.py``), and
a second table gives each row's spans: mean start after ``router.request`` and mean duration.
``--quick`` runs on the CPU: the bundled tiny model as it is, or with ``--config`` a random
checkpoint of that config. Tests never assert on these numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.report import command_line, fmt, markdown_table, write_run_section
from benchmarks.serve_client import Outcome, RequestRecord, send_request
from benchmarks.serve_images import image_bytes, image_data_url, parse_size
from benchmarks.serve_metrics import LatencyStats, latency_stats
from benchmarks.serve_workload import IntRange, RequestSpec, WorkloadSpec, chat_body
from benchmarks.span_timeline import timeline_lines, traced_services, wait_for_roots
from benchmarks.system_load import (
    CPU_UP,
    GPU_UP,
    MetricDelta,
    System,
    add_system_args,
    histogram_mean_ms,
    running_system,
)
from benchmarks.system_model import (
    add_config_arg,
    is_default_config,
    resolve_checkpoint_dir,
    section_title,
    write_checkpoint,
)
from services.cli import BUNDLED_MODEL
from services.engine.processing import TextProcessor

SECTION_TITLE = "## Image TTFT (`python -m benchmarks.image_ttft`)"
PROMPT = "Describe this image in one sentence."
# histograms whose mean over a row's requests is reported: (column, service, metric)
HISTOGRAMS = (
    ("router TTFT ms", "router", "stageserve_time_to_first_token_seconds"),
    ("tokenize ms", "tokenizer", "stageserve_tokenizer_tokenize_seconds"),
    ("router prefill ms", "router", "stageserve_request_prefill_time_seconds"),
    ("encode ms", "vision_encoder", "stageserve_vision_encoder_encode_seconds"),
    ("prefetch ms", "vision_encoder", "stageserve_vision_encoder_cache_only_seconds"),
    ("ViT ms", "vision_encoder", "stageserve_vision_encoder_vit_seconds"),
    ("preprocess ms", "vision_encoder", "stageserve_vision_encoder_preprocess_seconds"),
    ("prefill ms", "prefill", "stageserve_prefill_latency_seconds"),
    ("prefill forward ms", "prefill", "stageserve_prefill_forward_seconds"),
)
COUNTERS = (
    ("cache hits", "vision_encoder", "stageserve_vision_encoder_cache_hits_total"),
    ("cache misses", "vision_encoder", "stageserve_vision_encoder_cache_misses_total"),
    ("prefetched", "vision_encoder", "stageserve_vision_encoder_cache_only_spans_total"),
)


@dataclass(frozen=True)
class Case:
    """One row: its requests' image (none, a fresh one each, or one shared by all)."""

    name: str
    image_size: tuple[int, int] | None  # (width, height); None: text only
    is_fresh: bool = True  # False: the same image every request, the first one left out


@dataclass(frozen=True)
class CaseResult:
    case: Case
    num_ok: int
    num_requests: int
    mean_prompt_tokens: float | None
    ttft: LatencyStats | None
    histogram_ms: dict[str, float | None]  # column -> mean over the row (None: not observed)
    counts: dict[str, int]  # column -> increase over the row
    window_ns: tuple[int, int]  # wall clock (ns) from the first counted request's start to the end
    ttfts_s: tuple[float | None, ...] = ()  # each counted request's, in order (None: failed)

    def ttfts_text(self) -> str:
        return " ".join("-" if t is None else f"{t * 1e3:.1f}" for t in self.ttfts_s)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.image_ttft", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, small images")
    add_system_args(p)
    add_config_arg(p)
    p.add_argument("--num-requests", type=int, default=None, help="per row (default 10; --quick 2)")
    p.add_argument("--large-size", default=None, help="WxH (default 1920x1080; --quick 320x180)")
    p.add_argument("--small-size", default=None, help="WxH (default 640x480; --quick 160x120)")
    p.add_argument(
        "--transfer-backend", default=None, help="up's embedding backend (default: up's choice)"
    )
    p.add_argument(
        "--trace",
        action="store_true",
        help="the services export spans to this process: print and write each row's timeline",
    )
    args = p.parse_args(argv)
    resolve_checkpoint_dir(p, args)
    if (args.num_requests or 1) < 1:
        p.error("--num-requests must be >= 1")
    return args


def cases(large: tuple[int, int], small: tuple[int, int]) -> tuple[Case, ...]:
    def size(s: tuple[int, int]) -> str:
        return f"{s[0]}x{s[1]}"

    return (
        Case("text only", None),
        Case(f"fresh {size(large)}", large),
        Case(f"cached {size(large)}", large, is_fresh=False),
        Case(f"fresh {size(small)}", small),
    )


# every request's trace holds these spans; an image request's also vision_encoder.encode
TRACED_STAGES = frozenset(
    {"router.request", "tokenizer.tokenize", "decode.reserve", "prefill.request"}
)


def traced_stages(result: CaseResult) -> frozenset[str]:
    """The span names each of the row's traces holds once all its services have exported."""
    if result.case.image_size is None:
        return TRACED_STAGES
    return TRACED_STAGES | {"vision_encoder.encode"}


def _spec(model: str, size: tuple[int, int] | None, seed: int, index: int) -> RequestSpec:
    workload = WorkloadSpec(
        IntRange(0, 0),  # the text is PROMPT
        IntRange(1, 1),
        IntRange(int(size is not None), int(size is not None)),
        size or (0, 0),
        ignore_eos=True,
        temperature=0.0,
    )
    urls = [image_data_url("noise", "jpeg", size[0], size[1], seed)] if size else []
    body = chat_body(model, PROMPT, urls, 1, workload)
    return RequestSpec(index, 0, 1, len(urls), json.dumps(body).encode())


def case_specs(model: str, case: Case, num_requests: int, seed: int) -> list[RequestSpec]:
    """``num_requests`` bodies (one more, first, for a shared image); every image seed is new."""
    if not case.is_fresh:
        return [_spec(model, case.image_size, seed, i) for i in range(num_requests + 1)]
    return [_spec(model, case.image_size, seed + i, i) for i in range(num_requests)]


class _Probe(MetricDelta):
    """The services' histogram sums and counts, and counters, since the last ``reset``."""

    def __init__(self, system: System) -> None:
        super().__init__(system, COUNTERS, HISTOGRAMS)

    def means_and_counts(self) -> tuple[dict[str, float | None], dict[str, int]]:
        delta = self.since()
        means = {column: histogram_mean_ms(delta, column) for column, _, _ in HISTOGRAMS}
        return means, {column: round(delta[column]) for column, _, _ in COUNTERS}


async def run_case(system: System, specs: list[RequestSpec], case: Case) -> CaseResult:
    """Send ``specs`` one after another; the first is left out when the image is shared."""
    url = system.base_url + "/chat/completions"
    headers = {"content-type": "application/json"}
    probe = _Probe(system)
    records: list[RequestRecord] = []
    first_ns = time.time_ns()
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), trust_env=False) as client:
        for i, spec in enumerate(specs):
            record = await send_request(client, url, headers, spec, 600.0, 0.0)
            if i == 0 and not case.is_fresh:
                probe.reset()  # the shared image is in the cache from here on
                first_ns = time.time_ns()
            else:
                records.append(record)
    window_ns = (first_ns, time.time_ns())
    means, counts = probe.means_and_counts()
    ok = [r for r in records if r.outcome is Outcome.OK]
    for record in records:
        if record.outcome is not Outcome.OK:
            print(f"{case.name}: request {record.index} failed: {record.error}", flush=True)
    prompt_tokens = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    return CaseResult(
        case,
        len(ok),
        len(records),
        sum(prompt_tokens) / len(prompt_tokens) if prompt_tokens else None,
        latency_stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        means,
        counts,
        window_ns,
        tuple(r.ttft_s if r.outcome is Outcome.OK else None for r in records),
    )


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return fmt(value, spec)


def table_lines(results: list[CaseResult]) -> list[str]:
    header = (
        "row",
        "ok",
        "prompt tokens",
        "TTFT mean ms",
        "TTFT p50 ms",
        "TTFT p90 ms",
        *(column for column, _, _ in HISTOGRAMS),
        *(column for column, _, _ in COUNTERS),
    )

    def cells(r: CaseResult) -> tuple[str, ...]:
        return (
            r.case.name,
            f"{r.num_ok}/{r.num_requests}",
            _fmt(r.mean_prompt_tokens, ".0f"),
            _fmt(r.ttft and r.ttft.mean),
            _fmt(r.ttft and r.ttft.median),
            _fmt(r.ttft and r.ttft.at(90)),
            *(_fmt(r.histogram_ms[column]) for column, _, _ in HISTOGRAMS),
            *(str(r.counts[column]) for column, _, _ in COUNTERS),
        )

    return markdown_table(header, [cells(r) for r in results])


NOTES = [
    "How to read it: one request at a time, max_tokens 1, the same text prompt in every row;",
    "TTFT is the client's (POST to the first content chunk); *router TTFT ms* the router's own",
    "(from the start of tokenization, after the body is read and parsed and its images decoded",
    "from base64, to the first token), so TTFT minus it is the body's transfer, parse and image",
    "loading. *tokenize ms*: the tokenizer's Tokenize",
    "call. *router prefill ms*: the router's Reserve + Prefill phase (the call's transfer of the",
    "image bytes to prefill included). *encode ms*: the encoder's Encode",
    "call (arrival to rows written into prefill's buffer); *prefetch ms*: the router's",
    "cache_only Encode of the request's images, sent once the request is admitted (arrival to",
    "rows cached); *ViT ms* and *preprocess ms*: a rank's",
    "forward and its decoding and pixel preparation per batch; *prefill ms*: a Prefill call's",
    "arrival to its first token with the KV written (the wait for the embeddings included);",
    "*prefill forward ms*: the forward pass and sampling. Each is its histogram's mean over the",
    "row's requests (`-`: not observed). Cache hits and misses: the image spans of the Encode",
    "calls that wrote rows over the row (a hit: no ViT run of its own, the router's prefetch",
    "having encoded it), *prefetched*: the image spans of the router's cache_only calls; the",
    "cached row's first request is left out. The issue's targets on one",
    "H200: fresh 1920x1080 <= 150 ms, cached <= 90 ms, 640x480 <= 60 ms.",
]


TRACE_NOTES = [
    "",
    "The second table (`--trace`): every service exported its spans to a receiver in the",
    "benchmark's process; for each row's requests, each span's mean start in ms after the",
    "request's `router.request` span began (the router's first step after the body is parsed)",
    "and its mean duration; *requests*: how many of the row's traces held that span.",
    "Exporting costs each service a little CPU.",
]


def _up_args(quick: bool, model_dir: Path, transfer_backend: str | None) -> list[str]:
    device = CPU_UP if quick else GPU_UP
    transfer = ["--transfer-backend", transfer_backend] if transfer_backend else []
    return [
        *device,
        *transfer,
        "--model",
        str(model_dir),
        "--num-pages",
        "1024",
        "--ready-timeout-s",
        "1800",
    ]


async def _warm_up(system: System, model: str, sizes: list[tuple[int, int]]) -> None:
    """A text request, then two distinct images of each size: the encoder's ViT runs a layout
    eagerly the first time and captures its CUDA graph the second (``VisionGraphs``), a
    one-off that would otherwise land on the first request of a row."""
    specs = [_spec(model, None, 0, 0)]
    specs += [
        _spec(model, size, 1 + 2 * i + k, 1 + 2 * i + k)
        for i, size in enumerate(sizes)
        for k in range(2)
    ]
    results = await run_case(system, specs, Case("warm-up", None))
    if results.num_ok != len(specs):
        raise RuntimeError(f"warm-up: {results.num_ok}/{len(specs)} requests succeeded")


def checkpoint_for(args: argparse.Namespace) -> Path:
    """The model ``up`` serves: the bundled tiny one for ``--quick`` on the default config, else
    the random checkpoint of ``--config`` (on the CPU for ``--quick``)."""
    if args.quick and is_default_config(args.config):
        return BUNDLED_MODEL
    return write_checkpoint(
        args.checkpoint_dir, "cpu" if args.quick else "cuda", config_dir=args.config
    )


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    quick = args.quick
    large = parse_size(args.large_size or ("320x180" if quick else "1920x1080"))
    small = parse_size(args.small_size or ("160x120" if quick else "640x480"))
    num_requests = args.num_requests or (2 if quick else 10)
    model_dir = checkpoint_for(args)
    up_args = _up_args(quick, model_dir, args.transfer_backend)
    with contextlib.ExitStack() as stack:
        receiver = stack.enter_context(traced_services()) if args.trace else None
        system = stack.enter_context(
            running_system(up_args, args.workdir, "stageserve-image-ttft-")
        )
        model = system.served_model() or model_dir.name
        asyncio.run(_warm_up(system, model, [large, small]))
        results = []
        for seed, case in enumerate(cases(large, small)):
            specs = case_specs(model, case, num_requests, seed=(seed + 1) * 1_000_003)
            results.append(asyncio.run(run_case(system, specs, case)))
            print(table_lines(results)[-1], flush=True)
        timeline: list[str] = []
        if receiver is not None:
            windows = [r.window_ns for r in results]
            counts = [r.num_requests for r in results]
            spans = wait_for_roots(receiver, windows, counts, [traced_stages(r) for r in results])
            timeline = ["", *timeline_lines(spans, [(r.case.name, r.window_ns) for r in results])]
    code = system.process.returncode
    per_request = [f"- {r.case.name}: {r.ttfts_text()}" for r in results]
    lines = [*table_lines(results), "", "TTFT ms of each request, in order:", *per_request]
    lines += timeline
    print("\n".join(lines))
    jpeg_sizes = ", ".join(
        f"{w}x{h}: {len(image_bytes('noise', 'jpeg', w, h, 1)) / 1e6:.2f} MB"
        for w, h in (large, small)
    )
    weights = (
        "bundled tiny model"
        if model_dir == BUNDLED_MODEL
        else f"{args.config.resolve().name} dimensions (vision tower included), random bf16"
    )
    info = [
        f"- model: {weights}, a byte-level BPE vocabulary of "
        f"{TextProcessor.from_dir(model_dir).vocab_size:,} ids; `stageserve up "
        f"{shlex.join(up_args)}`; stop exit code {code}",
        f"- workload: {num_requests} requests per row at concurrency 1, max_tokens 1, "
        f"prompt {PROMPT!r}; images: random-noise JPEG, quality 90 ({jpeg_sizes})",
    ]
    command = command_line("benchmarks.image_ttft", argv)
    notes = NOTES + TRACE_NOTES if timeline else NOTES
    title = section_title(SECTION_TITLE, "Image TTFT", "benchmarks.image_ttft", args.config)
    write_run_section(args.out, title, command, info, lines, notes)
    return 0 if all(r.num_ok == r.num_requests for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
