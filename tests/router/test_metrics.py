"""The router's per-request metrics under vLLM's names: every phase of a finished request is
observed once, token gaps once per token, and the buckets reach the request timeout."""

from __future__ import annotations

import asyncio
import math

from prometheus_client import CollectorRegistry

from services.common.errors import UnavailableError
from services.router.config import FlowConfig
from services.router.metrics import RouterMetrics
from tests.router.conftest import MODEL_NAME
from tests.router.fakes import Script
from tests.router.served import Served, serve

CHAT = {
    "model": MODEL_NAME,
    "messages": [{"role": "user", "content": "Say hello."}],
    "max_tokens": 100,
}
PHASES = ("queue", "prefill", "decode", "inference")


def sample(served: Served, name: str, **labels: str) -> float:
    return served.app.metrics.registry.get_sample_value(f"stageserve_{name}", labels) or 0.0


async def test_a_streamed_request_moves_every_request_metric_once() -> None:
    script = Script(chunk_size=2, chunk_delay_s=0.01)
    async with serve(FlowConfig(), script) as served:
        response = await served.http.post(
            "/v1/chat/completions",
            json={**CHAT, "stream": True, "stream_options": {"include_usage": True}},
        )
        assert response.status_code == 200, response.text
        num_out = len(script.output_ids)
        assert sample(served, "time_to_first_token_seconds_count") == 1
        for name in ("inter_token_latency_seconds", "time_per_output_token_seconds"):
            assert sample(served, f"{name}_count") == num_out - 1, name
        assert sample(served, "request_time_per_output_token_seconds_count") == 1
        for phase in PHASES:
            assert sample(served, f"request_{phase}_time_seconds_count") == 1, phase
        decode_s = sample(served, "request_decode_time_seconds_sum")
        num_decode_messages = math.ceil((num_out - 1) / script.chunk_size)
        assert decode_s >= script.chunk_delay_s * (num_decode_messages - 1)  # the fake's pauses
        assert math.isclose(
            sample(served, "inter_token_latency_seconds_sum"), decode_s, rel_tol=1e-6
        )
        tpot = sample(served, "request_time_per_output_token_seconds_sum")
        assert math.isclose(tpot, decode_s / (num_out - 1), rel_tol=1e-6)
        assert sample(served, "request_success_total", finished_reason="stop") == 1
        assert sample(served, "generation_tokens_total") == num_out
        assert sample(served, "request_generation_tokens_sum") == num_out
        assert (
            sample(served, "prompt_tokens_total") == sample(served, "request_prompt_tokens_sum") > 0
        )
        assert sample(served, "request_params_max_tokens_sum") == 100
        assert (
            sample(served, "e2e_request_latency_seconds_count", endpoint="/v1/chat/completions")
            == 1
        )
        assert sample(served, "num_requests_running") == sample(served, "num_requests_waiting") == 0


async def test_queue_time_is_the_wait_for_an_admission_slot() -> None:
    script = Script(
        chunk_size=1, chunk_delay_s=0.02
    )  # the first request holds the one slot a while
    async with serve(FlowConfig(max_concurrent_requests=1), script) as served:
        first = asyncio.ensure_future(served.http.post("/v1/chat/completions", json=CHAT))
        while sample(served, "num_requests_running") < 1:
            await asyncio.sleep(0.01)
        second = asyncio.ensure_future(served.http.post("/v1/chat/completions", json=CHAT))
        while sample(served, "num_requests_waiting") < 1:
            await asyncio.sleep(0.01)
        assert (await first).status_code == (await second).status_code == 200
        assert sample(served, "request_queue_time_seconds_count") == 2
        waited = sample(served, "router_admission_wait_seconds_sum")
        assert waited > 0 and math.isclose(sample(served, "request_queue_time_seconds_sum"), waited)


async def test_a_failed_request_is_counted_but_observes_no_latency() -> None:
    script = Script(prefill_error=UnavailableError("prefill exploded"))
    async with serve(FlowConfig(), script) as served:
        response = await served.http.post("/v1/chat/completions", json=CHAT)
        assert response.status_code == 503
        endpoint = "/v1/chat/completions"
        assert (
            served.metric("requests_total", endpoint=endpoint, outcome="service_unavailable") == 1
        )
        assert sample(served, "e2e_request_latency_seconds_count", endpoint=endpoint) == 0
        for name in (
            "request_prefill_time_seconds_count",
            "time_to_first_token_seconds_count",
            "prompt_tokens_total",
        ):
            assert sample(served, name) == 0, name
        assert sample(served, "request_success_total", finished_reason="stop") == 0


def bucket_bounds(metrics: RouterMetrics, name: str) -> list[float]:
    (family,) = [f for f in metrics.registry.collect() if f.name == f"stageserve_{name}"]
    return [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket")]


def test_latency_buckets_end_at_the_request_timeout() -> None:
    metrics = RouterMetrics(CollectorRegistry(), max_latency_s=300.0, max_model_len=4096)
    metrics.e2e.labels("/v1/completions")  # a labelled histogram shows its buckets once used
    for name in (
        "e2e_request_latency_seconds",
        "time_to_first_token_seconds",
        "request_queue_time_seconds",
        "inter_token_latency_seconds",
    ):
        bounds = bucket_bounds(metrics, name)
        assert bounds[-2:] == [300.0, math.inf], name
    assert bucket_bounds(metrics, "request_prompt_tokens")[-3:] == [1000.0, 2000.0, math.inf]
    longer = RouterMetrics(CollectorRegistry(), max_latency_s=600.0)
    assert bucket_bounds(longer, "request_decode_time_seconds")[-3:] == [480.0, 600.0, math.inf]
