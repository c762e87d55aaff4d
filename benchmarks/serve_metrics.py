"""Summary of a serving benchmark run: latency percentiles, throughput and goodput.

``summarize`` is a pure function of the per-request records and the run's duration.
Latency statistics cover successful requests only. ITL percentiles pool the per-token
ITL values of all requests (so long outputs weigh more); TTFT, TPOT and E2E have one
value per request. Each has its mean, standard deviation (numpy's, over the values), median
and the ``--metric-percentiles`` (default 50, 90, 99), which interpolate linearly (numpy's
default). Throughputs divide by the run's duration (first send → last request finished, or
the ``--max-duration-s`` cut); total token throughput is input plus output tokens. Measured
concurrency: the most successful requests in flight at once (from their start and end times)
and the mean (their summed E2E over the duration). Peak output throughput counts output tokens
per whole second of the run (a token's time is its content chunk's), as vLLM's
``max_output_tokens_per_s``. Goodput counts successful requests that meet every SLO given;
a TPOT SLO is met by requests with a single completion token (they have no TPOT).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from benchmarks.serve_client import Outcome, RequestRecord

PERCENTILES = (50.0, 90.0, 99.0)


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_ms, self.tpot_ms, self.e2e_ms))

    def is_met(self, record: RequestRecord) -> bool:
        if record.outcome is not Outcome.OK:
            return False
        checks = (
            (self.ttft_ms, record.ttft_s),
            (self.tpot_ms, record.tpot_s),
            (self.e2e_ms, record.e2e_s),
        )
        return all(
            limit is None or value is None or value * 1e3 <= limit for limit, value in checks
        )


@dataclass(frozen=True)
class LatencyStats:
    """Milliseconds."""

    count: int
    mean: float
    std: float
    median: float
    percentiles: dict[str, float]  # percentile_name(p) -> value

    def at(self, percentile: float) -> float:
        return self.percentiles[percentile_name(percentile)]


@dataclass(frozen=True)
class Summary:
    duration_s: float
    num_requests: int  # planned
    num_ok: int
    num_failed: int
    num_aborted: int  # in flight at the --max-duration-s cut
    num_not_sent: int  # never sent before the cut
    request_throughput: float  # successful requests / s
    input_token_throughput: float  # prompt tokens of successful requests / s
    output_token_throughput: float  # completion tokens of successful requests / s
    total_token_throughput: float  # both / s
    total_input_tokens: int
    total_output_tokens: int
    max_output_tokens_per_s: float | None  # the busiest whole second's output tokens
    max_concurrent_requests: int  # successful requests in flight at once, at the most
    mean_concurrency: float  # their summed E2E / duration
    num_good: int | None  # successful requests meeting all SLOs; None without SLOs
    goodput: float | None  # num_good / s
    mean_prompt_tokens: float | None
    mean_completion_tokens: float | None
    ttft: LatencyStats | None
    itl: LatencyStats | None
    tpot: LatencyStats | None
    e2e: LatencyStats | None
    percentiles: tuple[float, ...] = PERCENTILES  # those of each LatencyStats


def percentile_name(percentile: float) -> str:
    """vLLM's: ``99`` for 99.0, ``99.9`` for 99.9."""
    return str(int(percentile)) if int(percentile) == percentile else str(percentile)


def latency_stats(
    values_s: Sequence[float], percentiles: Sequence[float] = PERCENTILES
) -> LatencyStats | None:
    if not len(values_s):
        return None
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    values = np.percentile(ms, list(percentiles)) if percentiles else []
    by_name = {percentile_name(p): float(v) for p, v in zip(percentiles, values, strict=True)}
    return LatencyStats(len(ms), float(ms.mean()), float(ms.std()), float(np.median(ms)), by_name)


def _token_times(record: RequestRecord) -> np.ndarray:
    """Seconds from the run's start at which each output token arrived (content chunks')."""
    assert record.ttft_s is not None
    first = record.start_s + record.ttft_s
    if record.itl_s:
        return first + np.concatenate(([0.0], np.cumsum(record.itl_s)))
    return np.full(record.completion_tokens or 1, first)  # one chunk, or a whole reply


def max_output_tokens_per_s(records: Sequence[RequestRecord]) -> float | None:
    ok = [r for r in records if r.outcome is Outcome.OK and r.ttft_s is not None]
    if not ok:
        return None
    times = np.concatenate([_token_times(r) for r in ok])
    return float(np.bincount(np.floor(times).astype(np.int64)).max())


def max_concurrent_requests(records: Sequence[RequestRecord]) -> int:
    """The most successful requests in flight at one time (an end before a start at a tie)."""
    events = sorted(
        (t, delta)
        for r in records
        if r.outcome is Outcome.OK and r.e2e_s is not None
        for t, delta in ((r.start_s, 1), (r.start_s + r.e2e_s, -1))
    )
    in_flight = peak = 0
    for _, delta in events:
        in_flight += delta
        peak = max(peak, in_flight)
    return peak


def steady_output_throughput(records: Sequence[RequestRecord], concurrency: int) -> float | None:
    """Output tokens per second while all ``concurrency`` clients of a closed-loop run decoded.

    The window runs from the ``concurrency``-th first token (the first wave's prompts all
    prefilled: the ramp is over) to the last request's start (after it the clients go idle one
    by one: the drain), so it holds a full request's decode and, as the first wave ends, the
    next wave's prefills. A token's time is its content chunk's (TTFT, then the per-token ITL
    summed). None when the window is empty (fewer than two requests per client) or no
    successful request reported ITLs.
    """
    ok = [r for r in records if r.outcome is Outcome.OK and r.ttft_s is not None]
    first_tokens = sorted(r.start_s + (r.ttft_s or 0.0) for r in ok)
    if len(first_tokens) < concurrency or not records:
        return None
    begin = first_tokens[concurrency - 1]
    end = max(r.start_s for r in records)
    if end <= begin or not any(r.itl_s for r in ok):
        return None
    num_tokens = 0
    for record in ok:
        times = _token_times(record)
        num_tokens += int(np.count_nonzero((times >= begin) & (times <= end)))
    return num_tokens / (end - begin)


def _mean(values: list[int]) -> float | None:
    return float(np.mean(values)) if values else None


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    slo: Slo,
    num_requests: int,
    percentiles: Sequence[float] = PERCENTILES,
) -> Summary:
    ok = [r for r in records if r.outcome is Outcome.OK]
    prompt_tokens = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    completion_tokens = [r.completion_tokens for r in ok if r.completion_tokens is not None]
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    num_good = sum(slo.is_met(r) for r in ok) if slo.is_set() else None
    return Summary(
        duration_s=duration_s,
        num_requests=num_requests,
        num_ok=len(ok),
        num_failed=sum(r.outcome is Outcome.FAILED for r in records),
        num_aborted=sum(r.outcome is Outcome.ABORTED for r in records),
        num_not_sent=num_requests - len(records),
        request_throughput=len(ok) * per_s,
        input_token_throughput=sum(prompt_tokens) * per_s,
        output_token_throughput=sum(completion_tokens) * per_s,
        total_token_throughput=(sum(prompt_tokens) + sum(completion_tokens)) * per_s,
        total_input_tokens=sum(prompt_tokens),
        total_output_tokens=sum(completion_tokens),
        max_output_tokens_per_s=max_output_tokens_per_s(ok),
        max_concurrent_requests=max_concurrent_requests(ok),
        mean_concurrency=sum(r.e2e_s for r in ok if r.e2e_s is not None) * per_s,
        num_good=num_good,
        goodput=None if num_good is None else num_good * per_s,
        mean_prompt_tokens=_mean(prompt_tokens),
        mean_completion_tokens=_mean(completion_tokens),
        ttft=latency_stats([r.ttft_s for r in ok if r.ttft_s is not None], percentiles),
        itl=latency_stats([v for r in ok for v in r.itl_s], percentiles),
        tpot=latency_stats([r.tpot_s for r in ok if r.tpot_s is not None], percentiles),
        e2e=latency_stats([r.e2e_s for r in ok if r.e2e_s is not None], percentiles),
        percentiles=tuple(percentiles),
    )


def _fmt(value: float | int | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.{digits}f}"


def _latency_rows(summary: Summary) -> list[tuple[str, LatencyStats | None]]:
    return [
        ("TTFT", summary.ttft),
        ("ITL", summary.itl),
        ("TPOT", summary.tpot),
        ("E2E", summary.e2e),
    ]


def _count_rows(summary: Summary) -> list[tuple[str, str]]:
    return [
        (
            "requests ok / failed / aborted / not sent",
            f"{summary.num_ok} / {summary.num_failed} / "
            f"{summary.num_aborted} / {summary.num_not_sent}",
        ),
        ("duration (s)", _fmt(summary.duration_s)),
        ("request throughput (req/s)", _fmt(summary.request_throughput, 3)),
        ("input token throughput (tok/s)", _fmt(summary.input_token_throughput, 1)),
        ("output token throughput (tok/s)", _fmt(summary.output_token_throughput, 1)),
        ("total token throughput (tok/s)", _fmt(summary.total_token_throughput, 1)),
        ("peak output throughput (tok/s, 1 s)", _fmt(summary.max_output_tokens_per_s, 1)),
        (
            "concurrency max / mean (measured)",
            f"{summary.max_concurrent_requests} / {summary.mean_concurrency:.2f}",
        ),
        (
            "goodput (req/s meeting SLOs)",
            "-"
            if summary.goodput is None
            else f"{summary.goodput:.3f} ({summary.num_good} requests)",
        ),
        (
            "mean prompt / completion tokens",
            f"{_fmt(summary.mean_prompt_tokens, 1)} / {_fmt(summary.mean_completion_tokens, 1)}",
        ),
    ]


def _latency_columns(summary: Summary) -> list[str]:
    return ["mean", "std", "median", *(f"p{percentile_name(p)}" for p in summary.percentiles)]


def _latency_cells(summary: Summary, stats: LatencyStats | None) -> list[str]:
    if stats is None:
        return ["-"] * len(_latency_columns(summary))
    values = [stats.mean, stats.std, stats.median, *stats.percentiles.values()]
    return [f"{v:.2f}" for v in values]


def format_table(summary: Summary) -> str:
    """The plain-text table printed at the end of a run."""
    counts = _count_rows(summary)
    width = max(len(name) for name, _ in counts)
    lines = [f"{name:<{width}}  {value}" for name, value in counts]
    header = "".join(f" {c:>10}" for c in _latency_columns(summary))
    lines += ["", f"{'latency (ms)':<12}{header} {'n':>8}"]
    for name, stats in _latency_rows(summary):
        cells = "".join(f" {c:>10}" for c in _latency_cells(summary, stats))
        lines.append(f"{name:<12}{cells} {stats.count if stats else 0:>8}")
    return "\n".join(lines)


def markdown_table(summary: Summary, title: str, command: str) -> str:
    """A markdown section (heading, command, two tables) to append to a results file."""
    lines = [f"### {title}", "", f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}", "", f"`{command}`", ""]
    lines += ["| metric | value |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in _count_rows(summary)]
    columns = _latency_columns(summary)
    lines += ["", "| latency (ms) | " + " | ".join(columns) + " |"]
    lines.append("|---|" + "---:|" * len(columns))
    for name, stats in _latency_rows(summary):
        lines.append(f"| {name} | " + " | ".join(_latency_cells(summary, stats)) + " |")
    return "\n".join(lines) + "\n\n"
