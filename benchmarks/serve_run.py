"""One run of the serving benchmark: resolve the model and its tokenizer, build the requests,
send the warm-up requests (``num_warmups``, their own prompts and images, at most
``max_concurrency`` at once, not timed), then the requests on their schedule (gamma-distributed
gaps of shape ``burstiness``, Poisson at 1; all at once; or a closed loop of ``max_concurrency``
clients) and collect a record per request. ``benchmarks.serve`` is its command line; the system
benchmark's client processes (``benchmarks/system_load.py``) call ``run_benchmark`` directly.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from benchmarks.serve_client import Outcome, RequestRecord, new_record, send_request
from benchmarks.serve_metrics import PERCENTILES, Slo
from benchmarks.serve_tokens import (
    SERVER_TOKENIZER,
    LocalTokenCounter,
    ServerTokenCounter,
    TokenCounter,
    model_tokenizer,
    tokenize_url,
)
from benchmarks.serve_workload import (
    ENDPOINTS,
    RequestSpec,
    WorkloadSpec,
    arrival_offsets,
    follow_up,
    make_requests,
)


@dataclass(frozen=True)
class BenchConfig:
    base_url: str
    model: str | None  # None: the first of GET /models
    api_key: str | None
    tokenizer: Path | str | None  # tokenizer.json or its directory; None: the model's; "server"
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
    burstiness: float = 1.0  # gamma shape of the arrival gaps; 1: Poisson
    num_warmups: int = 0
    percentiles: tuple[float, ...] = PERCENTILES


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
        self.records: dict[int, RequestRecord] = {}  # by index, as each request ends
        self.t0 = 0.0

    async def _one(self, spec: RequestSpec, offset_s: float) -> None:
        await asyncio.sleep(max(0.0, self.t0 + offset_s - time.perf_counter()))
        await self._send(spec)

    async def _conversation(self, turns: list[RequestSpec], offset_s: float) -> None:
        """A conversation's turns in order, each sent once the previous one has answered with
        the history in front of it; after a failed turn the later ones fail unsent."""
        await asyncio.sleep(max(0.0, self.t0 + offset_s - time.perf_counter()))
        sent = turns[0]
        record = await self._send(sent)
        for spec in turns[1:]:
            if record.outcome is not Outcome.OK:
                self.records[spec.index] = replace(
                    new_record(spec), error=f"turn {spec.turn - 1} of its conversation failed"
                )
                continue
            sent = follow_up(sent.body, record.generated_text, spec)
            record = await self._send(sent)

    async def _send(self, spec: RequestSpec) -> RequestRecord:
        if self.slots is None:
            return await self._post(spec)
        async with self.slots:
            return await self._post(spec)

    async def _post(self, spec: RequestSpec) -> RequestRecord:
        self.started.add(spec.index)
        record = await send_request(
            self.client, self.url, self.headers, spec, self.cfg.request_timeout_s, self.t0
        )
        self.records[spec.index] = record
        return record

    async def run(self, specs: list[RequestSpec]) -> tuple[list[RequestRecord], float]:
        """Records of every request sent (aborted ones included) and the run's duration."""
        cfg = self.cfg
        groups = _schedule_groups(specs)
        offsets = (
            [group[0].arrival_s for group in groups]
            if groups and groups[0][0].arrival_s is not None
            else arrival_offsets(len(groups), cfg.request_rate, cfg.seed, cfg.burstiness)
        )
        self.t0 = time.perf_counter()
        tasks = [
            asyncio.create_task(
                self._one(group[0], offset)
                if group[0].conversation is None
                else self._conversation(group, offset)
            )
            for group, offset in zip(groups, offsets, strict=True)
        ]
        _, pending = await asyncio.wait(tasks, timeout=self.cfg.max_duration_s)
        duration_s = time.perf_counter() - self.t0
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        records = dict(self.records)
        for spec in specs:
            if spec.index in self.started and spec.index not in records:
                records[spec.index] = replace(
                    new_record(spec), outcome=Outcome.ABORTED, error="aborted at --max-duration-s"
                )
        return sorted(records.values(), key=lambda r: r.index), duration_s


def _schedule_groups(specs: list[RequestSpec]) -> list[list[RequestSpec]]:
    """What the arrival schedule spaces out: each independent request, each conversation."""
    groups: list[list[RequestSpec]] = []
    conversations: dict[int, list[RequestSpec]] = {}
    for spec in specs:
        if spec.conversation is None:
            groups.append([spec])
        elif spec.conversation in conversations:
            conversations[spec.conversation].append(spec)
        else:
            conversations[spec.conversation] = [spec]
            groups.append(conversations[spec.conversation])
    return groups


@dataclass(frozen=True)
class BenchRun:
    model: str
    records: list[RequestRecord]
    t0: float  # time.perf_counter() when sending began; each record's start_s counts from it
    duration_s: float  # t0 to the last request's end
    tokenizer: str = ""  # what counted the prompts' tokens: a file, or the /tokenize URL
    warmups: list[RequestRecord] = field(default_factory=list)


WARMUP_SEED = 1_000_000_007  # warm-up requests' seed offset: prompts and images of their own


def token_counter(
    cfg: BenchConfig, client: httpx.AsyncClient, model: str, headers: dict[str, str]
) -> tuple[TokenCounter, str]:
    """The counter of ``cfg.tokenizer`` (by default the model's tokenizer.json) and its name."""
    if cfg.tokenizer == SERVER_TOKENIZER:
        url = tokenize_url(cfg.base_url)
        return ServerTokenCounter(client, url, model, headers), url
    path = Path(cfg.tokenizer) if cfg.tokenizer else model_tokenizer(model)
    return LocalTokenCounter(path), str(path)


async def warm_up(
    cfg: BenchConfig, client: httpx.AsyncClient, headers: dict[str, str], specs: list[RequestSpec]
) -> list[RequestRecord]:
    """Send ``specs`` at most ``max_concurrency`` at once and wait for all (not timed)."""
    if not specs:
        return []
    print(f"warming up with {len(specs)} requests", file=sys.stderr)
    records, _ = await _Run(replace(cfg, request_rate=float("inf")), client, headers).run(specs)
    num_ok = sum(r.outcome is Outcome.OK for r in records)
    print(f"warm-up: {num_ok} of {len(specs)} requests succeeded", file=sys.stderr)
    return records


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
        counter, tokenizer = token_counter(cfg, client, model, headers)
        specs = await make_requests(model, cfg.workload, cfg.num_requests, cfg.seed, counter)
        warmup_specs = (
            await make_requests(
                model, cfg.workload, cfg.num_warmups, cfg.seed + WARMUP_SEED, counter
            )
            if cfg.num_warmups
            else []
        )
        warmups = await warm_up(cfg, client, headers, warmup_specs)
        if before_start is not None:
            before_start()
        run = _Run(cfg, client, headers)
        records, duration_s = await run.run(specs)
    return BenchRun(model, records, run.t0, duration_s, tokenizer, warmups)
