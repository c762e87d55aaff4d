"""The prefix cache benchmark's rows (``benchmarks/prefix_cache.py``): each workload, and
its run on one system through client processes that build and warm up, then start together
while prefill's cache counters are read around the timed requests."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import multiprocessing
import threading
from dataclasses import dataclass
from pathlib import Path

from benchmarks.serve_client import Outcome, RequestRecord
from benchmarks.serve_dataset import MultiTurnSpec, PrefixRepetitionSpec
from benchmarks.serve_metrics import Slo
from benchmarks.serve_run import BenchConfig, run_benchmark
from benchmarks.serve_workload import IntRange, WorkloadSpec
from benchmarks.system_load import BARRIER_S, MetricDelta, System, merge_runs, run_clients

COUNTERS = (
    ("queries", "prefill", "stageserve_prefill_prefix_cache_queries_total"),
    ("hits", "prefill", "stageserve_prefill_prefix_cache_hits_total"),
)

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
    probe = MetricDelta(system, COUNTERS)

    def start_together() -> None:
        try:
            ready.wait(BARRIER_S)
            probe.reset()
            go.wait(BARRIER_S)
        except threading.BrokenBarrierError:
            pass  # a client failed: its error is in the results

    outcomes = run_clients(clients, results, f"{row.name} (cache {cache})", start_together)
    turns = tuple(r.index % row.num_turns for records, _, _ in outcomes for r in records)
    records, duration_s = merge_runs(outcomes)  # renumbers them, in the order of ``turns``
    counts = probe.since()
    for record, turn in zip(records, turns, strict=True):
        if record.outcome is not Outcome.OK:
            print(f"{row.name} (cache {cache}): turn {turn + 1}: {record.error}", flush=True)
    return RowRun(
        row, cache, records, turns, duration_s, round(counts["queries"]), round(counts["hits"])
    )
