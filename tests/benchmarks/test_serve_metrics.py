"""The serving benchmark's metrics and workload, unit by unit: per-token ITL, the summary's
percentiles and goodput, and the deterministic workload."""

from __future__ import annotations

import pytest

from benchmarks.serve_client import Outcome, RequestRecord, per_token_itl
from benchmarks.serve_metrics import Slo, steady_output_throughput, summarize
from benchmarks.serve_workload import IntRange, WorkloadSpec, arrival_offsets, make_requests
from tests.benchmarks.conftest import WordCounter


def test_per_token_itl_splits_chunk_gaps():
    assert per_token_itl([0.0, 1.0, 3.0], 5) == [0.5, 0.5, 1.0, 1.0]
    assert per_token_itl([0.0, 1.0, 3.0], 4) == [0.5, 0.5, 2.0]
    assert per_token_itl([0.0, 1.0, 3.0], None) == [1.0, 2.0]
    assert per_token_itl([0.0, 1.0, 3.0], 2) == [1.0, 2.0]  # more chunks than tokens: raw gaps
    assert per_token_itl([0.5], 9) == []


def _ok(
    ttft_ms: float, e2e_ms: float, completion_tokens: int = 11, prompt_tokens: int = 50
) -> RequestRecord:
    tpot_s = (e2e_ms - ttft_ms) / 1e3 / (completion_tokens - 1)
    return RequestRecord(
        0,
        50,
        completion_tokens,
        0,
        Outcome.OK,
        ttft_s=ttft_ms / 1e3,
        e2e_s=e2e_ms / 1e3,
        tpot_s=tpot_s,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        itl_s=[tpot_s] * (completion_tokens - 1),
    )


def _timed(start_s: float, ttft_s: float, itl_s: list[float]) -> RequestRecord:
    record = RequestRecord(0, 50, len(itl_s) + 1, 0, Outcome.OK, start_s=start_s, ttft_s=ttft_s)
    record.e2e_s, record.itl_s = ttft_s + sum(itl_s), itl_s
    return record


def test_steady_throughput_counts_tokens_from_the_last_clients_first_token_to_the_last_start():
    records = [  # two clients
        _timed(0.0, 1.0, [1.0, 1.0]),  # tokens at 1, 2, 3: 2 and 3 inside
        _timed(0.0, 2.0, [1.0] * 5),  # 2 .. 7: the second first token, the window's start
        _timed(3.0, 1.0, [1.0] * 3),  # 4 .. 7: 4, 5 inside
        _timed(5.0, 0.5, [1.0]),  # starts at 5, the window's end; tokens at 5.5, 6.5
        RequestRecord(0, 50, 4, 0, Outcome.FAILED, start_s=1.0),
    ]
    assert steady_output_throughput(records, 2) == pytest.approx((2 + 4 + 2) / 3.0)
    # one client's window starts at its first token (1) and ends at the last start (5)
    assert steady_output_throughput(records, 1) == pytest.approx((3 + 4 + 2) / 4.0)
    # every request started before the last client's first token: no window
    assert steady_output_throughput(records[:2], 2) is None
    assert steady_output_throughput(records, 5) is None  # fewer first tokens than clients
    assert steady_output_throughput([], 1) is None


def test_summary_percentiles_throughput_and_goodput():
    records = [_ok(10, 100), _ok(20, 200), _ok(30, 300), _ok(40, 400)]
    records += [
        RequestRecord(4, 50, 11, 0, Outcome.FAILED, error="HTTP 500"),
        RequestRecord(5, 50, 11, 0, Outcome.ABORTED),
    ]
    summary = summarize(records, duration_s=2.0, slo=Slo(ttft_ms=25, tpot_ms=30), num_requests=7)
    assert (summary.num_ok, summary.num_failed, summary.num_aborted, summary.num_not_sent) == (
        4,
        1,
        1,
        1,
    )
    assert summary.ttft.count == 4
    assert summary.ttft.mean == pytest.approx(25.0)
    assert summary.ttft.median == summary.ttft.at(50) == pytest.approx(25.0)
    assert summary.ttft.std == pytest.approx(125**0.5)  # TTFTs 10, 20, 30, 40 ms
    assert summary.ttft.at(90) == pytest.approx(37.0)  # linear: 10 + 0.9 * 3 * 10
    assert summary.ttft.at(99) == pytest.approx(39.7)
    assert summary.tpot.median == pytest.approx(22.5)  # TPOTs 9, 18, 27, 36 ms
    assert summary.itl.count == 40 and summary.e2e.at(99) == pytest.approx(397.0)
    assert summary.request_throughput == pytest.approx(2.0)
    assert summary.input_token_throughput == pytest.approx(100.0)
    assert summary.output_token_throughput == pytest.approx(22.0)
    assert summary.total_token_throughput == pytest.approx(122.0)
    assert (summary.total_input_tokens, summary.total_output_tokens) == (200, 44)
    assert summary.max_concurrent_requests == 4  # all four start at 0
    assert summary.mean_concurrency == pytest.approx((0.1 + 0.2 + 0.3 + 0.4) / 2.0)
    assert summary.max_output_tokens_per_s == 44  # every token within the first second
    assert summary.num_good == 2 and summary.goodput == pytest.approx(
        1.0
    )  # TTFT <= 25 and TPOT <= 30
    assert summarize(records, 2.0, Slo(e2e_ms=300), 7).num_good == 3
    no_slo = summarize(records, 2.0, Slo(), 7)
    assert no_slo.goodput is None and no_slo.num_good is None


def test_configured_percentiles_and_measured_concurrency():
    first, second = _timed(0.0, 0.5, [0.5] * 3), _timed(1.0, 0.5, [0.5] * 3)  # 0-2 s and 1-3 s
    third = _timed(2.0, 0.5, [])  # starts as the first ends: not in flight together
    summary = summarize([first, second, third], 4.0, Slo(), 3, percentiles=(25.0, 99.9))
    assert summary.percentiles == (25.0, 99.9)
    assert set(summary.ttft.percentiles) == {"25", "99.9"}
    assert summary.max_concurrent_requests == 2
    assert summary.mean_concurrency == pytest.approx((2.0 + 2.0 + 0.5) / 4.0)
    # tokens at 0.5, 1, 1.5, 2 | 1.5, 2, 2.5, 3 | 2.5: per whole second 1, 3, 4, 1
    assert summary.max_output_tokens_per_s == 4


def test_burstiness_keeps_the_rate_and_changes_the_spread():
    poisson = arrival_offsets(20_000, 50.0, 0)
    assert arrival_offsets(20_000, 50.0, 0, burstiness=1.0) == poisson
    for burstiness in (0.25, 4.0):
        offsets = arrival_offsets(20_000, 50.0, 0, burstiness)
        assert offsets[-1] / len(offsets) == pytest.approx(1 / 50, rel=0.05)
        gaps = [b - a for a, b in zip(offsets[1:], offsets[2:], strict=False)]
        mean = sum(gaps) / len(gaps)
        cv2 = sum((g - mean) ** 2 for g in gaps) / len(gaps) / mean**2
        assert cv2 == pytest.approx(1 / burstiness, rel=0.1)  # a gamma's squared CV: 1 / shape


async def test_workload_is_deterministic():
    workload = WorkloadSpec(
        IntRange(4, 40), IntRange.parse("8"), IntRange.parse("0:1"), (24, 8), False, 0.0
    )
    first = await make_requests("m", workload, 5, 3, WordCounter())
    assert first == await make_requests("m", workload, 5, 3, WordCounter())
    assert await make_requests("m", workload, 5, 4, WordCounter()) != first
    assert arrival_offsets(3, float("inf"), 0) == [0.0, 0.0, 0.0]
    offsets = arrival_offsets(20_000, 50.0, 0)
    assert offsets == sorted(offsets) and offsets[-1] / len(offsets) == pytest.approx(
        1 / 50, rel=0.05
    )
    with pytest.raises(ValueError):
        IntRange.parse("5:2")
