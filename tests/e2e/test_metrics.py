"""Every service's ``/metrics`` under ``stageserve up --metrics-port-base N --log-format json``:
the fixed ports (in the state file and the ready table), vLLM's names with the ``model_name``
label, histograms that move after a request, and JSON log lines with the request's ids."""

from __future__ import annotations

import asyncio
import json
import random
import socket
import urllib.request

import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from services.common.client import create_channel
from services.launch_spec import METRICS_PORT_ORDER
from tests.e2e.system import running_system

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MODEL = "tiny-qwen2.5-vl"
ROUTER_NAMES = (  # vLLM's names under our prefix, served by the router (it sees every request)
    "num_requests_running",
    "num_requests_waiting",
    "prompt_tokens_total",
    "generation_tokens_total",
    "time_to_first_token_seconds",
    "time_per_output_token_seconds",
    "inter_token_latency_seconds",
    "request_time_per_output_token_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "request_inference_time_seconds",
    "e2e_request_latency_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "request_success_total",
)
MOVED_ONCE = (
    "time_to_first_token_seconds",
    "request_time_per_output_token_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "e2e_request_latency_seconds",
    "request_generation_tokens",
)
NUM_TOKENS = 8


def free_port_run(length: int) -> int:
    """A port N such that N .. N + length - 1 are free now, below the kernel's ephemeral
    range: the system's own port-0 binds (its gRPC servers) cannot take one of them before the
    service that was given it binds it."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10_000, ephemeral_low - length)
        try:
            for port in range(base, base + length):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no run of free ports")


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    base = free_port_run(len(METRICS_PORT_ORDER))
    with running_system(
        tmp_path_factory.mktemp("metrics"),
        "--num-pages",
        "512",
        "--metrics-port-base",
        str(base),
        "--log-format",
        "json",
    ) as system:
        system.metrics_port_base = base
        yield system


def scrape(system, service: str) -> dict[str, list]:
    """Samples by name (``_bucket``/``_count``/``_sum``/``_total`` kept), of ``service``."""
    with urllib.request.urlopen(system.metrics_url(service), timeout=10) as reply:
        text = reply.read().decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def total(samples: dict[str, list], name: str, **labels: str) -> float:
    return sum(
        s.value for s in samples.get(f"stageserve_{name}", ()) if labels.items() <= s.labels.items()
    )


def test_each_service_serves_metrics_on_its_fixed_port_listed_in_the_ready_table(system) -> None:
    for index, name in enumerate(METRICS_PORT_ORDER):
        port = system.metrics_port_base + index
        assert int(system.state[name]["metrics_port"]) == port
        row = system.wait_for_output(f"http://127.0.0.1:{port}/metrics", timeout_s=5)[0].split()
        assert row[0] == name and row[1] == str(system.state[name]["pid"])


def test_every_sample_of_every_service_has_the_model_label(system) -> None:
    asyncio.run(health_check_router(system))  # so the router's gRPC server metrics have a sample
    for name in METRICS_PORT_ORDER:
        samples = scrape(system, name)
        assert all(
            s.labels.get("model_name") == MODEL for group in samples.values() for s in group
        ), name
        (info,) = samples["stageserve_model_info"]
        assert info.labels["service"] == name and info.value == 1
        assert total(samples, "grpc_server_handled_total") > 0, name
        assert "stageserve_grpc_server_handling_seconds_bucket" in samples, name
    decode = scrape(system, "decode")
    (usage,) = decode["stageserve_kv_cache_usage_perc"]
    assert 0.0 <= usage.value <= 1.0
    encoder = scrape(system, "vision_encoder")
    assert {"stageserve_mm_cache_queries_total", "stageserve_mm_cache_hits_total"} <= encoder.keys()


async def health_check_router(system) -> None:
    channel = create_channel(system.address("router"))
    try:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    finally:
        await channel.close()


def chat(text: str, **extra) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
        "max_tokens": NUM_TOKENS,
        "ignore_eos": True,
        **extra,
    }


def test_request_histograms_move_after_a_request(system) -> None:
    before = scrape(system, "router")
    response = httpx.post(
        f"{system.base_url}/chat/completions", json=chat("Count to ten."), timeout=120
    )
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert usage["completion_tokens"] == NUM_TOKENS
    after = scrape(system, "router")
    for name in ROUTER_NAMES:
        assert any(key.startswith(f"stageserve_{name}") for key in after), name
    for name in MOVED_ONCE:
        assert total(after, f"{name}_count") == total(before, f"{name}_count") + 1, name
    for name in ("inter_token_latency_seconds", "time_per_output_token_seconds"):
        assert total(after, f"{name}_count") == total(before, f"{name}_count") + NUM_TOKENS - 1, (
            name
        )
    assert (
        total(after, "generation_tokens_total")
        == total(before, "generation_tokens_total") + NUM_TOKENS
    )
    prompt_tokens = total(after, "prompt_tokens_total") - total(before, "prompt_tokens_total")
    assert prompt_tokens == usage["prompt_tokens"]
    assert (
        total(after, "request_success_total", finished_reason="length")
        == total(before, "request_success_total", finished_reason="length") + 1
    )
    le_300 = [
        s
        for s in after["stageserve_e2e_request_latency_seconds_bucket"]
        if s.labels["le"] == "300.0"
    ]
    assert le_300, "the e2e buckets reach the 300 s request timeout"


def test_log_lines_are_json_and_a_requests_lines_carry_its_ids(system) -> None:
    trace_id = "6e0c63257de34c926f9efcd03927272e"
    first = httpx.post(
        f"{system.base_url}/chat/completions", json=chat("Tell me a story."), timeout=120
    )
    text = first.json()["choices"][0]["message"]["content"]
    stop = text[1:3]
    assert stop.strip(), f"the greedy output {text!r} has no usable stop string"
    # The same greedy request, long and stopped by the router: it aborts the request on decode,
    # whose Abort handler logs "aborted <request id>".
    long = chat("Tell me a story.", max_tokens=3000, stop=[stop])
    response = httpx.post(
        f"{system.base_url}/chat/completions",
        json=long,
        timeout=120,
        headers={"traceparent": f"00-{trace_id}-a2fb4a1d1a96d312-01"},
    )
    assert response.status_code == 200, response.text
    request_id = response.json()["id"]
    lines = wait_for_log_line(system, "decode", lambda e: e["request_id"] == request_id)
    (aborted,) = [
        e for e in lines if e["request_id"] == request_id and e["message"].startswith("aborted")
    ]
    assert aborted["trace_id"] == trace_id and aborted["service"] == "decode"
    for name in METRICS_PORT_ORDER:  # every line of every service's log is one JSON object
        entries = log_entries(system, name)  # json.loads of each line
        keys = {"time", "level", "logger", "message", "request_id", "trace_id"}
        assert all(keys <= e.keys() for e in entries), name


def log_entries(system, service: str) -> list[dict]:
    path = system.workdir / "logs" / f"{service}.log"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for_log_line(system, service: str, predicate, timeout_s: float = 30) -> list[dict]:
    import time

    deadline_mono = time.monotonic() + timeout_s
    while True:
        entries = log_entries(system, service)
        if any(predicate(e) for e in entries):
            return entries
        assert time.monotonic() < deadline_mono, f"no such line in {service}'s log"
        time.sleep(0.1)
