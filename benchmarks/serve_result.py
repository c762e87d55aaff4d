"""The serving benchmark's result JSON: ``vllm bench serve``'s fields, then ours.

vLLM's (its ``--save-result --save-detailed`` file): ``date``, ``endpoint_type``, ``backend``,
``label``, ``model_id``, ``tokenizer_id``, ``num_prompts``, ``request_rate`` (``"inf"`` when
infinite), ``burstiness``, ``max_concurrency``, ``duration``, ``completed``, ``failed``,
``total_input_tokens``, ``total_output_tokens``, ``request_throughput``, ``request_goodput``,
``output_throughput``, ``total_token_throughput``, ``max_output_tokens_per_s``,
``max_concurrent_requests``, per request (every request sent, in order) ``input_lens``,
``output_lens``, ``ttfts`` (s), ``itls`` (s), ``generated_texts``, ``errors``, and for each of
``ttft``, ``tpot``, ``itl``, ``e2el``: ``mean_*_ms``, ``median_*_ms``, ``std_*_ms`` and
``p{percentile}_*_ms`` for every ``--metric-percentiles``. As in vLLM a failed request has TTFT
0 and 0 output tokens; a statistic with no value is null (vLLM writes 0). Ours: ``percentiles``,
``mean_concurrency``, ``warmup`` (requests sent / succeeded), ``config``, ``summary`` and
``requests`` (per-request records, without the text).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.serve_client import Outcome, RequestRecord
from benchmarks.serve_metrics import LatencyStats, Summary, percentile_name
from benchmarks.serve_run import BenchConfig, BenchRun

_LATENCY_NAMES = (("ttft", "ttft"), ("tpot", "tpot"), ("itl", "itl"), ("e2el", "e2e"))


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


def _latency_fields(name: str, stats: LatencyStats | None, summary: Summary) -> dict:
    fields = {
        f"mean_{name}_ms": stats and stats.mean,
        f"median_{name}_ms": stats and stats.median,
        f"std_{name}_ms": stats and stats.std,
    }
    for p in summary.percentiles:
        fields[f"p{percentile_name(p)}_{name}_ms"] = stats and stats.at(p)
    return fields


def _per_request(records: list[RequestRecord]) -> dict:
    ok = [r.outcome is Outcome.OK for r in records]
    return {
        "input_lens": [r.input_len for r in records],
        "output_lens": [
            (r.completion_tokens or 0) if o else 0 for r, o in zip(records, ok, strict=True)
        ],
        "ttfts": [(r.ttft_s or 0.0) if o else 0.0 for r, o in zip(records, ok, strict=True)],
        "itls": [r.itl_s for r in records],
        "generated_texts": [r.generated_text for r in records],
        "errors": [r.error for r in records],
    }


def _without_text(record: dict) -> dict:
    return {key: value for key, value in record.items() if key != "generated_text"}


def vllm_fields(cfg: BenchConfig, run: BenchRun, summary: Summary) -> dict:
    """The fields ``vllm bench serve`` writes, from a run and its summary."""
    result = {
        "date": time.strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": cfg.workload.backend,
        "backend": cfg.workload.backend,
        "label": None,
        "model_id": run.model,
        "tokenizer_id": run.tokenizer,
        "num_prompts": cfg.num_requests,
        "request_rate": cfg.request_rate,
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
        "duration": summary.duration_s,
        "completed": summary.num_ok,
        "failed": summary.num_failed + summary.num_aborted,
        "total_input_tokens": summary.total_input_tokens,
        "total_output_tokens": summary.total_output_tokens,
        "request_throughput": summary.request_throughput,
        "request_goodput": summary.goodput,
        "output_throughput": summary.output_token_throughput,
        "total_token_throughput": summary.total_token_throughput,
        **_per_request(run.records),
        "max_output_tokens_per_s": summary.max_output_tokens_per_s,
        "max_concurrent_requests": summary.max_concurrent_requests,
    }
    for name, attribute in _LATENCY_NAMES:
        result.update(_latency_fields(name, getattr(summary, attribute), summary))
    return result


def write_json(path: Path, cfg: BenchConfig, run: BenchRun, summary: Summary) -> None:
    num_warmups_ok = sum(r.outcome is Outcome.OK for r in run.warmups)
    report = {
        **vllm_fields(cfg, run, summary),
        "percentiles": list(summary.percentiles),
        "mean_concurrency": summary.mean_concurrency,
        "warmup": {"num_requests": len(run.warmups), "num_ok": num_warmups_ok},
        "config": {
            **asdict(cfg),
            "model": run.model,
            "api_key": "<redacted>" if cfg.api_key else None,
        },
        "summary": asdict(summary),
        "requests": [_without_text(asdict(r)) for r in run.records],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_jsonable(report), indent=1))
