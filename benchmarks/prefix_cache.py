"""Prefix cache benchmark: the whole system with prefill's prefix cache on, then off.

    python -m benchmarks.prefix_cache [--out docs/benchmarks.md] [--concurrency 64]
        [--num-requests 128] [--prefix-len 4096] [--suffix-len 200] [--num-prefixes 2]
        [--output-len 64] [--num-turns 4] [--turn-len 256] [--num-conversations 64]
        [--image-size 640x480] [--no-image-row] [--host-cache-gb GB]
    python -m benchmarks.prefix_cache --quick   # CPU smoke run on the bundled tiny model

Writes (or reuses) the system benchmark's checkpoint (7B dimensions, vision tower included,
random bf16 weights: benchmarks/system_model.py) and starts ``stageserve up`` on it twice, one
system after the other: first with the prefix cache on (up's default), then with it off
(``--disable-prefix-cache``); ``--host-cache-gb`` gives the cache-on system up's host tier.
Each system runs the same rows, each through the serving
benchmark's client (``benchmarks/serve_run.py``), closed loop at ``--concurrency``, greedy,
ignore_eos, after a few warm-up requests of their own; a row's load is spread over client
processes (``--client-processes``, by default one per 32 in flight; each with its share of the
concurrency, of the conversations and of the shared prefixes) that build and warm up, then
start together, as ``benchmarks/system_load.py``'s do, so the client is not the bottleneck:

- *shared prefix*: the ``prefix_repetition`` dataset, ``--num-prefixes`` prompts of
  ``--prefix-len`` tokens shared by all the requests, each followed by ``--suffix-len`` tokens
  of its own (a shared system prompt);
- *multi-turn*: the ``multi_turn`` dataset, ``--num-conversations`` conversations of
  ``--num-turns`` user turns of ``--turn-len`` tokens, each turn sent with the whole history in
  front of it; its TTFT also apart for turn 1 and the turns after it;
- *new tokens only*: the reference of the multi-turn rows, random prompts as long as what a
  later turn adds (the previous reply and the new user turn: ``--turn-len + --output-len``),
  as many as the multi-turn rows' later turns;
- *image multi-turn* (unless ``--no-image-row``): the multi-turn rows with one
  ``--image-size`` noise JPEG per conversation, in its first turn.

The cache hit rate is prefill's Prometheus counters over the row (after its warm-up):
``stageserve_prefill_prefix_cache_hits_total / ..._queries_total`` (prompt tokens; a system
with the cache off counts neither). Prints one table and writes its section of ``--out``,
with the issue's targets computed from it. Tests never assert on these numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import math
import multiprocessing
import shlex
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from benchmarks.report import command_line, fmt, markdown_table, write_run_section
from benchmarks.serve_client import Outcome, RequestRecord
from benchmarks.serve_dataset import MultiTurnSpec, PrefixRepetitionSpec
from benchmarks.serve_images import parse_size
from benchmarks.serve_metrics import LatencyStats, Slo, latency_stats, summarize
from benchmarks.serve_run import BenchConfig, run_benchmark
from benchmarks.serve_workload import IntRange, WorkloadSpec
from benchmarks.system_load import (
    BARRIER_S,
    CPU_UP,
    GPU_UP,
    MetricDelta,
    System,
    add_system_args,
    merge_runs,
    running_system,
)
from benchmarks.system_model import write_checkpoint
from services.cli import BUNDLED_MODEL
from services.engine.processing import TextProcessor

SECTION_TITLE = "## Prefix cache (`python -m benchmarks.prefix_cache`)"
COUNTERS = (
    ("queries", "prefill", "stageserve_prefill_prefix_cache_queries_total"),
    ("hits", "prefill", "stageserve_prefill_prefix_cache_hits_total"),
)
PAGE_TOKENS = 16  # up's default --page-size
TEMPLATE_SLACK = 64  # the chat template's tokens around each turn, at most
TURN_SPEEDUP = 1.2  # target: a later turn's TTFT within this of its new tokens' alone
SHARED_SPEEDUP = 3.0  # target: the shared-prefix row's request throughput, on over off

# rows' names (sub-rows: a multi-turn run's turn 1 and its later turns)
SHARED = "shared prefix"
MULTI_TURN = "multi-turn"
NEW_TOKENS = "new tokens only"
IMAGE_MULTI_TURN = "image multi-turn"
FIRST_TURN = ": turn 1"
LATER_TURNS = ": turns >= 2"
CACHE_STATES = ("on", "off")


@dataclass(frozen=True)
class Sizes:
    concurrency: int
    num_requests: int  # the shared-prefix row's
    prefix_len: int
    suffix_len: int
    num_prefixes: int
    output_len: int
    num_turns: int
    turn_len: int
    num_conversations: int
    image_size: tuple[int, int] | None  # None: no image row
    num_warmups: int

    @property
    def num_turn_requests(self) -> int:
        return self.num_conversations * self.num_turns


@dataclass(frozen=True)
class Row:
    """One workload: a dataset (None: random prompts of ``input_len``) and its requests."""

    name: str
    dataset: PrefixRepetitionSpec | MultiTurnSpec | None
    num_requests: int
    output_len: int
    input_len: int = 0  # random prompts only
    image_size: tuple[int, int] | None = None  # one image per conversation, in turn 1

    @property
    def num_turns(self) -> int:
        return self.dataset.num_turns if isinstance(self.dataset, MultiTurnSpec) else 1


def rows(sizes: Sizes) -> tuple[Row, ...]:
    s = sizes
    turns = MultiTurnSpec(s.num_turns, s.turn_len, s.output_len)
    out = [
        Row(
            SHARED,
            PrefixRepetitionSpec(s.prefix_len, s.suffix_len, s.num_prefixes, s.output_len),
            s.num_requests,
            s.output_len,
        ),
        Row(MULTI_TURN, turns, s.num_turn_requests, s.output_len),
        Row(
            NEW_TOKENS,
            None,
            s.num_conversations * (s.num_turns - 1),
            s.output_len,
            input_len=s.turn_len + s.output_len,
        ),
    ]
    if s.image_size is not None:
        image = Row(IMAGE_MULTI_TURN, turns, s.num_turn_requests, s.output_len)
        out.append(dataclasses.replace(image, image_size=s.image_size))
    return tuple(out)


@dataclass(frozen=True)
class RowRun:
    """One row on one system: its records, its duration and prefill's cache counters."""

    row: Row
    cache: str  # "on" | "off"
    records: list[RequestRecord]
    turns: tuple[int, ...]  # each record's turn of its conversation, 0 first (0: no turns)
    duration_s: float
    queries: int  # prompt tokens planned with the cache on
    hits: int  # of them, read from the cache


@dataclass(frozen=True)
class Line:
    """A table line: a run, or a turn's share of a multi-turn run (no throughput, no counts)."""

    name: str
    cache: str
    num_ok: int
    num_requests: int
    mean_prompt_tokens: float | None
    ttft: LatencyStats | None
    request_throughput: float | None = None
    output_throughput: float | None = None
    queries: int | None = None
    hits: int | None = None

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries and self.hits is not None else None


def _workload(row: Row, dataset: PrefixRepetitionSpec | MultiTurnSpec | None) -> WorkloadSpec:
    num_images = int(row.image_size is not None)
    return WorkloadSpec(
        IntRange(row.input_len, row.input_len),
        IntRange(row.output_len, row.output_len),
        IntRange(num_images, num_images),
        row.image_size or (64, 64),
        ignore_eos=True,
        temperature=0.0,
        dataset=dataset,
    )


def _part(total: int, index: int, num_parts: int) -> int:
    """Part ``index`` of ``total`` dealt out over ``num_parts`` in turn."""
    return len(range(index, total, num_parts))


def client_configs(
    system: System, model: str, tokenizer: Path, row: Row, sizes: Sizes, seed: int, processes: int
) -> list[BenchConfig]:
    """Each client process's share of ``row``: its requests (whole conversations; of the shared
    prefix row, its own prefixes, so the processes together send ``--num-prefixes``), its
    concurrency and warm-up requests, its own seed."""
    turns = row.num_turns
    dataset = row.dataset
    units = row.num_requests // turns  # conversations, or requests
    if isinstance(dataset, PrefixRepetitionSpec):
        units = min(units, dataset.num_prefixes)
    num_parts = max(1, min(processes, units, sizes.concurrency))
    configs = []
    for i in range(num_parts):
        if isinstance(dataset, PrefixRepetitionSpec):
            part_dataset = dataclasses.replace(
                dataset, num_prefixes=_part(dataset.num_prefixes, i, num_parts)
            )
            num_requests = _part(row.num_requests, i, num_parts)
        else:
            part_dataset = dataset
            num_requests = _part(units, i, num_parts) * turns
        warmups = _part(math.ceil(sizes.num_warmups / turns), i, num_parts) * turns
        configs.append(
            BenchConfig(
                base_url=system.base_url,
                model=model,
                api_key=None,
                tokenizer=tokenizer,
                request_rate=float("inf"),
                max_concurrency=max(1, _part(sizes.concurrency, i, num_parts)),
                num_requests=num_requests,
                seed=seed + 7919 * i,
                workload=_workload(row, part_dataset),
                request_timeout_s=900.0,
                max_duration_s=3600.0,
                slo=Slo(),
                output_json=None,
                markdown=None,
                num_warmups=warmups,  # whole conversations: their later turns warm up too
            )
        )
    return configs


def _client(cfg: BenchConfig, ready, go, results) -> None:
    """One client process: builds and warms up, waits at ``ready`` and ``go``, then sends."""

    def start() -> None:
        ready.wait(BARRIER_S)
        go.wait(BARRIER_S)  # the parent reads the counters between the two

    try:
        run = asyncio.run(run_benchmark(cfg, before_start=start))
    except BaseException as exc:  # the parent reports it instead of waiting for a result
        ready.abort()
        go.abort()
        results.put(f"{type(exc).__name__}: {exc}")
        raise
    results.put((run.records, run.t0, run.duration_s))


def run_row(
    system: System,
    model: str,
    tokenizer: Path,
    row: Row,
    cache: str,
    sizes: Sizes,
    seed: int,
    processes: int,
) -> RowRun:
    """``row``'s requests through the client at ``sizes.concurrency``, spread over at most
    ``processes`` client processes that build and warm up, then start together; prefill's
    counters over the timed requests only."""
    configs = client_configs(system, model, tokenizer, row, sizes, seed, processes)
    context = multiprocessing.get_context("spawn")
    ready, go = context.Barrier(len(configs) + 1), context.Barrier(len(configs) + 1)
    results = context.Queue()
    clients = [context.Process(target=_client, args=(cfg, ready, go, results)) for cfg in configs]
    for client in clients:
        client.start()
    probe = MetricDelta(system, COUNTERS)
    try:
        try:
            ready.wait(BARRIER_S)
            probe.reset()
            go.wait(BARRIER_S)
        except threading.BrokenBarrierError:
            pass  # a client failed: its error is in the results
        outcomes = [results.get(timeout=7200) for _ in clients]
    finally:
        for client in clients:
            client.join(60)
            if client.is_alive():
                client.kill()
    errors = [outcome for outcome in outcomes if isinstance(outcome, str)]
    if errors:
        raise RuntimeError(f"{row.name} (cache {cache}): " + "; ".join(errors))
    turns = tuple(r.index % row.num_turns for records, _, _ in outcomes for r in records)
    records, duration_s = merge_runs(outcomes)  # renumbers them, in the order of ``turns``
    counts = probe.since()
    for record, turn in zip(records, turns, strict=True):
        if record.outcome is not Outcome.OK:
            print(f"{row.name} (cache {cache}): turn {turn + 1}: {record.error}", flush=True)
    return RowRun(
        row, cache, records, turns, duration_s, round(counts["queries"]), round(counts["hits"])
    )


def _share(name: str, cache: str, records: list[RequestRecord], num_requests: int) -> Line:
    ok = [r for r in records if r.outcome is Outcome.OK]
    prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    return Line(
        name,
        cache,
        len(ok),
        num_requests,
        sum(prompts) / len(prompts) if prompts else None,
        latency_stats([r.ttft_s for r in ok if r.ttft_s is not None]),
    )


def lines_of(run: RowRun) -> list[Line]:
    """The run's line, then for a multi-turn run its turn 1's and its later turns'."""
    row = run.row
    summary = summarize(run.records, run.duration_s, Slo(), row.num_requests)
    whole = dataclasses.replace(
        _share(row.name, run.cache, run.records, row.num_requests),
        request_throughput=summary.request_throughput,
        output_throughput=summary.output_token_throughput,
        queries=run.queries,
        hits=run.hits,
    )
    if row.num_turns == 1:
        return [whole]
    first = [r for r, turn in zip(run.records, run.turns, strict=True) if turn == 0]
    later = [r for r, turn in zip(run.records, run.turns, strict=True) if turn > 0]
    num_first = row.num_requests // row.num_turns
    return [
        whole,
        _share(row.name + FIRST_TURN, run.cache, first, num_first),
        _share(row.name + LATER_TURNS, run.cache, later, row.num_requests - num_first),
    ]


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _p50(line: Line | None) -> float | None:
    return line.ttft.median if line and line.ttft else None


HEADER = (
    "row",
    "cache",
    "ok",
    "prompt tokens",
    "req/s",
    "out tok/s",
    "TTFT p50 ms",
    "TTFT p90 ms",
    "queried tokens",
    "hit tokens",
    "hit rate",
    "req/s on/off",
    "TTFT p50 on/off",
)


def ordered(lines: list[Line]) -> list[Line]:
    """Each line name's cache-on line, then its cache-off line, names in first-seen order."""
    names = list(dict.fromkeys(line.name for line in lines))
    by_key = {(line.name, line.cache): line for line in lines}
    return [by_key[n, c] for n in names for c in CACHE_STATES if (n, c) in by_key]


def table_lines(lines: list[Line]) -> list[str]:
    by_key = {(line.name, line.cache): line for line in lines}

    def cells(line: Line) -> tuple[str, ...]:
        off = by_key.get((line.name, "off")) if line.cache == "on" else None
        return (
            line.name,
            line.cache,
            f"{line.num_ok}/{line.num_requests}",
            fmt(line.mean_prompt_tokens, ".0f"),
            fmt(line.request_throughput, ".2f"),
            fmt(line.output_throughput, ".0f"),
            fmt(_p50(line), ".1f"),
            fmt(line.ttft and line.ttft.at(90), ".1f"),
            fmt(line.queries, "d"),
            fmt(line.hits, "d"),
            fmt(line.hit_rate, ".3f"),
            fmt(_ratio(line.request_throughput, off and off.request_throughput), ".2f"),
            fmt(_ratio(_p50(line), _p50(off)), ".2f"),
        )

    return markdown_table(HEADER, [cells(line) for line in ordered(lines)])


def _verdict(value: float | None, is_met: Callable[[float], bool]) -> str:
    if value is None:
        return "not measured (a row had no successful request)"
    return "**met**" if is_met(value) else "**not met**"


def target_lines(lines: list[Line], sizes: Sizes) -> list[str]:
    """The issue's targets, each with this run's numbers and whether it is met."""
    by_key = {(line.name, line.cache): line for line in lines}
    s = sizes
    shared_on, shared_off = by_key.get((SHARED, "on")), by_key.get((SHARED, "off"))
    speedup = _ratio(
        shared_on and shared_on.request_throughput, shared_off and shared_off.request_throughput
    )
    out = [
        "Targets (issue 38), computed from the table:",
        "",
        f"- Shared system prompt, cache on >= {SHARED_SPEEDUP:g}x the request throughput of "
        f"cache off (the issue's: a 4k-token prefix + 200 new tokens at c = 64 on one GPU; "
        f"here {s.num_prefixes} x {s.prefix_len} + {s.suffix_len} at c = {s.concurrency}): "
        f"{fmt(speedup, '.2f')}x, {_verdict(speedup, lambda v: v >= SHARED_SPEEDUP)}.",
    ]
    reference = _p50(by_key.get((NEW_TOKENS, "on")))
    for name in (MULTI_TURN, IMAGE_MULTI_TURN):
        if (name + LATER_TURNS, "on") not in by_key:
            continue  # no image row
        later = _p50(by_key[name + LATER_TURNS, "on"])
        ratio = _ratio(later, reference)
        out.append(
            f"- {name}, turn >= 2 TTFT within {TURN_SPEEDUP:g}x the TTFT of a prompt of only the "
            f"new tokens (p50, cache on): {fmt(later, '.1f')} ms against {fmt(reference, '.1f')} "
            f"ms, {fmt(ratio, '.2f')}x, {_verdict(ratio, lambda v: v <= TURN_SPEEDUP)}."
        )
    out.append(
        "- L2 hit (a 32k-token prefix back from host memory >= 5x faster than recomputing it): "
        "not measured here (whole requests, not the tier's moves): "
        "`python -m benchmarks.host_tier`."
    )
    return out


NOTES = [
    "How to read it: each row ran on two systems started one after the other on the same",
    "checkpoint, the prefix cache on (up's default), then off; closed loop at the concurrency,",
    "greedy, ignore_eos, after warm-up requests of the row's own that are not counted. *req/s*",
    "and *out tok/s*: successful requests and their completion tokens over the row's duration",
    "(first send to last end); TTFT is the client's (POST to the first content chunk). A",
    "multi-turn row's `: turn 1` and `: turns >= 2` lines split its requests' TTFT by turn (no",
    "throughput of their own). *queried* and *hit tokens*: the increase of prefill's",
    "`stageserve_prefill_prefix_cache_queries_total` (prompt tokens planned with the cache on)",
    "and `..._hits_total` (those read from the cache) over the row; *hit rate* = hits /",
    "queries. *on/off*: the cache-on line's value over the cache-off line's (req/s above 1 and",
    "TTFT below 1 are the cache's gain). *new tokens only*: prompts as long as a later turn's",
    "new tokens (the previous reply and the new user turn), the reference of the turn target;",
    "its hits with the cache on are the chat template's leading tokens, which every prompt",
    "shares. The cache lives in prefill's KV pool (its pages no plan uses keep recent prompts'",
    "full pages; up's `--prefill-num-pages`: 8192 pages of 16 tokens here, 1024 by default",
    "and in `--quick`), so that pool bounds what stays cached between a conversation's turns; the",
    "scheduler also counts each prompt's whole pages against it when it fills a batch.",
]


def _up_args(quick: bool, model_dir: Path, sizes: Sizes) -> list[str]:
    if quick:
        return [*CPU_UP, "--model", str(model_dir), "--num-pages", "1024"]
    s = sizes
    width, height = s.image_size or (0, 0)
    image_tokens = math.ceil(width / 28) * math.ceil(height / 28) + 8 if s.image_size else 0
    longest = max(
        s.prefix_len + s.suffix_len + TEMPLATE_SLACK,
        s.num_turns * (s.turn_len + s.output_len + TEMPLATE_SLACK) + image_tokens,
    )
    num_pages = s.concurrency * math.ceil((longest + s.output_len) / PAGE_TOKENS) + 64
    return [
        *GPU_UP,
        "--model",
        str(model_dir),
        "--num-pages",
        str(num_pages),
        "--prefill-num-pages",  # the cache's room: 128k tokens, ~7.5 GB at 7B dims
        "8192",
        "--max-running-requests",  # every request in flight decodes at once; fewer graphs
        str(s.concurrency),
        "--max-concurrent-requests",
        str(max(2 * s.concurrency, 64)),
        "--ready-timeout-s",
        "1800",
    ]


@contextlib.contextmanager
def cache_system(
    up_args: list[str], cache: str, workdir: Path | None, keep: list[System]
) -> Iterator[System]:
    """``stageserve up`` with ``up_args`` (the cache's flags included) in ``workdir``'s
    ``cache-<cache>``, kept in ``keep``."""
    sub = workdir / f"cache-{cache}" if workdir else None
    with running_system(up_args, sub, f"stageserve-prefix-cache-{cache}-") as system:
        keep.append(system)
        yield system


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.prefix_cache", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="CPU smoke run: tiny model, tiny sizes")
    add_system_args(p)
    for flag, text in (
        ("--concurrency", "requests in flight (default 64; --quick 4)"),
        ("--num-requests", "the shared-prefix row's requests (default 128; --quick 8)"),
        ("--prefix-len", "tokens of each shared prefix (default 4096; --quick 256)"),
        ("--suffix-len", "tokens after it, each request's own (default 200; --quick 32)"),
        ("--num-prefixes", "distinct shared prefixes (default 2; --quick 2)"),
        ("--output-len", "max_tokens of every request (default 64; --quick 8)"),
        ("--num-turns", "user turns per conversation, >= 2 (default 4; --quick 2)"),
        ("--turn-len", "tokens of each user turn (default 256; --quick 32)"),
        ("--num-conversations", "per multi-turn row (default: --concurrency)"),
        ("--num-warmups", "warm-up requests per row, whole conversations (default 8; --quick 2)"),
        ("--client-processes", "most client processes per row (default: one per 32 in flight)"),
    ):
        p.add_argument(flag, type=int, default=None, help=text)
    p.add_argument("--image-size", default=None, help="WxH (default 640x480; --quick 160x120)")
    p.add_argument("--no-image-row", action="store_true", help="leave out the image multi-turn")
    p.add_argument(
        "--host-cache-gb",
        type=float,
        default=None,
        help="up's --host-cache-gb for the cache-on system (default: up's, no host tier)",
    )
    args = p.parse_args(argv)
    for name in ("concurrency", "num_requests", "prefix_len", "output_len", "turn_len"):
        if (getattr(args, name) or 1) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if (args.num_turns or 2) < 2:
        p.error("--num-turns must be >= 2 (a later turn is what the multi-turn rows measure)")
    for name in ("suffix_len", "num_warmups"):
        if (getattr(args, name) or 0) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    for name in ("num_prefixes", "num_conversations", "client_processes"):
        if (getattr(args, name) or 1) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def sizes_from_args(args: argparse.Namespace) -> Sizes:
    quick = args.quick

    def pick(value: int | None, full: int, small: int) -> int:
        return value if value is not None else (small if quick else full)

    concurrency = pick(args.concurrency, 64, 4)
    image = None if args.no_image_row else (args.image_size or ("160x120" if quick else "640x480"))
    return Sizes(
        concurrency=concurrency,
        num_requests=pick(args.num_requests, 128, 8),
        prefix_len=pick(args.prefix_len, 4096, 256),
        suffix_len=pick(args.suffix_len, 200, 32),
        num_prefixes=pick(args.num_prefixes, 2, 2),
        output_len=pick(args.output_len, 64, 8),
        num_turns=pick(args.num_turns, 4, 2),
        turn_len=pick(args.turn_len, 256, 32),
        num_conversations=args.num_conversations or concurrency,
        image_size=parse_size(image) if image else None,
        num_warmups=pick(args.num_warmups, 8, 2),
    )


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    sizes = sizes_from_args(args)
    model_dir = BUNDLED_MODEL if args.quick else write_checkpoint(args.checkpoint_dir, "cuda")
    up_args = _up_args(args.quick, model_dir, sizes)
    tokenizer = model_dir / "tokenizer.json"  # the checkpoint's own: what the server counts
    processes = args.client_processes or math.ceil(sizes.concurrency / 32)
    host = [] if args.host_cache_gb is None else ["--host-cache-gb", f"{args.host_cache_gb:g}"]
    cache_args = {"on": host, "off": ["--disable-prefix-cache"]}
    runs: list[RowRun] = []
    systems: list[System] = []
    for cache in CACHE_STATES:
        with cache_system([*up_args, *cache_args[cache]], cache, args.workdir, systems) as system:
            model = system.served_model() or model_dir.name
            for seed, row in enumerate(rows(sizes), start=1):
                run = run_row(
                    system, model, tokenizer, row, cache, sizes, seed * 1_000_003, processes
                )
                runs.append(run)
                line = lines_of(run)[0]
                print(table_lines([line])[-1], flush=True)
    lines = [line for run in runs for line in lines_of(run)]
    table = table_lines(lines)
    targets = target_lines(lines, sizes)
    print("\n".join([*table, "", *targets]))
    s = sizes
    weights = (
        "bundled tiny model" if args.quick else "7B dimensions (vision tower included), random bf16"
    )
    codes = " / ".join(str(system.process.returncode) for system in systems)
    image = f"{s.image_size[0]}x{s.image_size[1]} noise JPEG" if s.image_size else "no image row"
    info = [
        f"- model: {weights}, a byte-level BPE vocabulary of "
        f"{TextProcessor.from_dir(model_dir).vocab_size:,} ids; cache on: `stageserve up "
        f"{shlex.join([*up_args, *cache_args['on']])}`; cache off: the same with "
        f"`{shlex.join(cache_args['off'])}`; stop exit codes (on / off) {codes}",
        f"- workload: concurrency {s.concurrency}, greedy, ignore_eos, output {s.output_len} "
        f"tokens; shared prefix: {s.num_requests} requests, {s.num_prefixes} x {s.prefix_len} "
        f"prefix tokens + {s.suffix_len}; multi-turn: {s.num_conversations} conversations x "
        f"{s.num_turns} turns of {s.turn_len} tokens; new tokens only: "
        f"{s.num_conversations * (s.num_turns - 1)} prompts of {s.turn_len + s.output_len} "
        f"tokens; image: {image} in each conversation's first turn; {s.num_warmups} warm-up "
        f"requests per row (whole conversations); client processes per row: at most "
        f"{processes}",
    ]
    command = command_line("benchmarks.prefix_cache", argv)
    write_run_section(args.out, SECTION_TITLE, command, info, [*table, "", *targets], NOTES)
    return 0 if all(line.num_ok == line.num_requests for line in lines) else 1


if __name__ == "__main__":
    raise SystemExit(main())
