"""Summary of a serving benchmark run: latency percentiles, throughput and goodput.

``summarize`` is a pure function of the per-request records and the run's duration.
Latency statistics cover successful requests only. ITL percentiles pool the per-token
ITL values of all requests (so long outputs weigh more); TTFT, TPOT and E2E have one
value per request. Percentiles interpolate linearly (numpy's default). Throughputs
divide by the run's duration (first send → last request finished, or the
``--max-duration-s`` cut). Goodput counts successful requests that meet every SLO given;
a TPOT SLO is met by requests with a single completion token (they have no TPOT).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from benchmarks.serve_client import Outcome, RequestRecord

PERCENTILES = (50, 90, 99)


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
    p50: float
    p90: float
    p99: float


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
    num_good: int | None  # successful requests meeting all SLOs; None without SLOs
    goodput: float | None  # num_good / s
    mean_prompt_tokens: float | None
    mean_completion_tokens: float | None
    ttft: LatencyStats | None
    itl: LatencyStats | None
    tpot: LatencyStats | None
    e2e: LatencyStats | None


def latency_stats(values_s: Sequence[float]) -> LatencyStats | None:
    if not len(values_s):
        return None
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    p50, p90, p99 = np.percentile(ms, PERCENTILES)
    return LatencyStats(len(ms), float(ms.mean()), float(p50), float(p90), float(p99))


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
        assert record.ttft_s is not None
        times = record.start_s + record.ttft_s + np.concatenate(([0.0], np.cumsum(record.itl_s)))
        num_tokens += int(np.count_nonzero((times >= begin) & (times <= end)))
    return num_tokens / (end - begin)


def _mean(values: list[int]) -> float | None:
    return float(np.mean(values)) if values else None


def summarize(
    records: Sequence[RequestRecord], duration_s: float, slo: Slo, num_requests: int
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
        num_good=num_good,
        goodput=None if num_good is None else num_good * per_s,
        mean_prompt_tokens=_mean(prompt_tokens),
        mean_completion_tokens=_mean(completion_tokens),
        ttft=latency_stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        itl=latency_stats([v for r in ok for v in r.itl_s]),
        tpot=latency_stats([r.tpot_s for r in ok if r.tpot_s is not None]),
        e2e=latency_stats([r.e2e_s for r in ok if r.e2e_s is not None]),
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


def format_table(summary: Summary) -> str:
    """The plain-text table printed at the end of a run."""
    counts = _count_rows(summary)
    width = max(len(name) for name, _ in counts)
    lines = [f"{name:<{width}}  {value}" for name, value in counts]
    lines += ["", f"{'latency (ms)':<12} {'mean':>10} {'p50':>10} {'p90':>10} {'p99':>10} {'n':>8}"]
    for name, stats in _latency_rows(summary):
        if stats is None:
            lines.append(f"{name:<12} {'-':>10} {'-':>10} {'-':>10} {'-':>10} {0:>8}")
        else:
            values = " ".join(f"{v:>10.2f}" for v in (stats.mean, stats.p50, stats.p90, stats.p99))
            lines.append(f"{name:<12} {values} {stats.count:>8}")
    return "\n".join(lines)


def markdown_table(summary: Summary, title: str, command: str) -> str:
    """A markdown section (heading, command, two tables) to append to a results file."""
    lines = [f"### {title}", "", f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}", "", f"`{command}`", ""]
    lines += ["| metric | value |", "|---|---|"]
    lines += [f"| {name} | {value} |" for name, value in _count_rows(summary)]
    lines += ["", "| latency (ms) | mean | p50 | p90 | p99 |", "|---|---:|---:|---:|---:|"]
    for name, stats in _latency_rows(summary):
        cells = (
            ["-"] * 4
            if stats is None
            else [f"{v:.2f}" for v in (stats.mean, stats.p50, stats.p90, stats.p99)]
        )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\n"
