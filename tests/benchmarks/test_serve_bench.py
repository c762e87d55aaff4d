"""The serving benchmark client against a fake OpenAI-compatible server on 127.0.0.1.

The fake streams ``max_tokens`` tokens (one word each, ``batch-3`` packs three per chunk)
with small sleeps, reports usage (prompt tokens = words + 100 per image + 5), and fails
on demand by model name. No assertion is on wall time beyond orderings.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import threading
import time

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from PIL import Image

from benchmarks.serve import main
from benchmarks.serve_client import Outcome, RequestRecord, per_token_itl
from benchmarks.serve_metrics import Slo, summarize
from benchmarks.serve_workload import IntRange, WorkloadSpec, arrival_offsets, make_requests, png_bytes

TEMPLATE_TOKENS = 5
IMAGE_TOKENS = 100


class FakeState:
    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.auth_headers: list[str | None] = []
        self.num_in_flight = 0
        self.max_in_flight = 0


STATE = FakeState()


def _chunk(delta: dict, finish_reason: str | None = None) -> str:
    event = {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }
    return f"data: {json.dumps(event)}\n\n"


def _prompt_tokens(body: dict) -> int:
    content = body["messages"][0]["content"]
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    words = sum(len(p["text"].split()) for p in parts if p["type"] == "text")
    return words + IMAGE_TOKENS * sum(p["type"] == "image_url" for p in parts) + TEMPLATE_TOKENS


async def _events(body: dict):
    model, num_tokens = body["model"], body["max_tokens"]
    per_chunk = 3 if model == "batch-3" else 1
    delay = 5.0 if model == "slow" else 0.002
    STATE.num_in_flight += 1
    STATE.max_in_flight = max(STATE.max_in_flight, STATE.num_in_flight)
    try:
        yield _chunk({"role": "assistant", "content": ""})
        await asyncio.sleep(0.01)
        for start in range(0, num_tokens, per_chunk):
            if model == "error-event" and start == 2:
                yield f"data: {json.dumps({'error': {'message': 'engine died', 'code': 503}})}\n\n"
                return
            yield _chunk({"content": " tok" * min(per_chunk, num_tokens - start)})
            await asyncio.sleep(delay)
        yield _chunk({}, finish_reason="length")
        usage = {"prompt_tokens": _prompt_tokens(body), "completion_tokens": num_tokens}
        usage["total_tokens"] = usage["prompt_tokens"] + num_tokens
        yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        STATE.num_in_flight -= 1


def fake_app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        STATE.bodies.append(body)
        STATE.auth_headers.append(request.headers.get("authorization"))
        if body["model"] == "fail-500":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        if body["model"] == "fail-400":
            return JSONResponse({"error": {"message": "bad prompt", "type": "invalid_request_error"}}, 400)
        return StreamingResponse(_events(body), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module")
def base_url():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(fake_app(), log_level="warning", timeout_graceful_shutdown=1)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "fake server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}/v1"
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture
def state() -> FakeState:
    STATE.__init__()
    return STATE


def run(base_url: str, tmp_path, *args: str) -> tuple[int, dict]:
    out = tmp_path / "run.json"
    rc = main(["--base-url", base_url, "--output-json", str(out), "--request-timeout-s", "10", *args])
    return rc, json.loads(out.read_text())


def test_records_from_a_streamed_run(base_url, tmp_path, state):
    rc, report = run(
        base_url,
        tmp_path,
        "--num-requests",
        "4",
        "--input-len",
        "8",
        "--output-len",
        "5",
        "--ignore-eos",
        "--api-key",
        "sk-test",
    )
    assert rc == 0
    assert report["config"]["model"] == "fake-model"  # the first of GET /v1/models
    assert report["config"]["api_key"] == "<redacted>" and state.auth_headers == ["Bearer sk-test"] * 4
    assert report["summary"]["num_ok"] == 4 and report["summary"]["num_failed"] == 0
    for record in report["requests"]:
        assert record["outcome"] == "ok" and record["error"] == ""
        assert record["completion_tokens"] == 5 and record["num_chunks"] == 5
        assert record["prompt_tokens"] == 8 + TEMPLATE_TOKENS
        assert 0 < record["ttft_s"] <= record["e2e_s"]
        assert len(record["itl_s"]) == 4 and record["tpot_s"] > 0
    for body in state.bodies:
        assert body["ignore_eos"] is True and body["stream"] is True and body["max_tokens"] == 5
        assert body["stream_options"] == {"include_usage": True}
        assert len(body["messages"][0]["content"].split()) == 8


def test_itl_is_per_token_when_chunks_carry_several(base_url, tmp_path, state):
    rc, report = run(base_url, tmp_path, "--model", "batch-3", "--num-requests", "2", "--output-len", "7")
    assert rc == 0
    for record in report["requests"]:
        assert record["num_chunks"] == 3 and record["completion_tokens"] == 7
        assert len(record["itl_s"]) == 6


def test_per_token_itl_splits_chunk_gaps():
    assert per_token_itl([0.0, 1.0, 3.0], 5) == [0.5, 0.5, 1.0, 1.0]
    assert per_token_itl([0.0, 1.0, 3.0], 4) == [0.5, 0.5, 2.0]
    assert per_token_itl([0.0, 1.0, 3.0], None) == [1.0, 2.0]
    assert per_token_itl([0.0, 1.0, 3.0], 2) == [1.0, 2.0]  # more chunks than tokens: raw gaps
    assert per_token_itl([0.5], 9) == []


def _ok(ttft_ms: float, e2e_ms: float, completion_tokens: int = 11, prompt_tokens: int = 50) -> RequestRecord:
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


def test_summary_percentiles_throughput_and_goodput():
    records = [_ok(10, 100), _ok(20, 200), _ok(30, 300), _ok(40, 400)]
    records += [
        RequestRecord(4, 50, 11, 0, Outcome.FAILED, error="HTTP 500"),
        RequestRecord(5, 50, 11, 0, Outcome.ABORTED),
    ]
    summary = summarize(records, duration_s=2.0, slo=Slo(ttft_ms=25, tpot_ms=30), num_requests=7)
    assert (summary.num_ok, summary.num_failed, summary.num_aborted, summary.num_not_sent) == (4, 1, 1, 1)
    assert summary.ttft.count == 4
    assert summary.ttft.mean == pytest.approx(25.0)
    assert summary.ttft.p50 == pytest.approx(25.0)
    assert summary.ttft.p90 == pytest.approx(37.0)  # linear: 10 + 0.9 * 3 * 10
    assert summary.ttft.p99 == pytest.approx(39.7)
    assert summary.tpot.p50 == pytest.approx(22.5)  # TPOTs 9, 18, 27, 36 ms
    assert summary.itl.count == 40 and summary.e2e.p99 == pytest.approx(397.0)
    assert summary.request_throughput == pytest.approx(2.0)
    assert summary.input_token_throughput == pytest.approx(100.0)
    assert summary.output_token_throughput == pytest.approx(22.0)
    assert summary.num_good == 2 and summary.goodput == pytest.approx(1.0)  # TTFT <= 25 and TPOT <= 30
    assert summarize(records, 2.0, Slo(e2e_ms=300), 7).num_good == 3
    no_slo = summarize(records, 2.0, Slo(), 7)
    assert no_slo.goodput is None and no_slo.num_good is None


def test_request_rate_mode_completes_all(base_url, tmp_path, state):
    rc, report = run(base_url, tmp_path, "--request-rate", "200", "--num-requests", "8", "--output-len", "3")
    assert rc == 0 and report["summary"]["num_ok"] == 8 and len(state.bodies) == 8
    assert report["config"]["request_rate"] == 200.0
    starts = [r["start_s"] for r in report["requests"]]
    assert starts[-1] >= starts[0] >= 0


def test_concurrency_mode_caps_requests_in_flight(base_url, tmp_path, state):
    rc, report = run(base_url, tmp_path, "--max-concurrency", "2", "--num-requests", "6", "--output-len", "4")
    assert rc == 0 and report["summary"]["num_ok"] == 6
    assert report["config"]["request_rate"] == "inf"
    assert 1 <= state.max_in_flight <= 2


@pytest.mark.parametrize(
    "model, status", [("fail-500", "HTTP 500"), ("fail-400", "HTTP 400"), ("error-event", "error event")]
)
def test_failures_are_counted_with_their_error(base_url, tmp_path, state, model, status):
    rc, report = run(base_url, tmp_path, "--model", model, "--num-requests", "3", "--output-len", "4")
    assert rc == 1
    summary = report["summary"]
    assert summary["num_failed"] == 3 and summary["num_ok"] == 0 and summary["ttft"] is None
    assert all(r["outcome"] == "failed" and r["error"].startswith(status) for r in report["requests"])


def test_request_timeout_and_max_duration_bound_the_run(base_url, tmp_path, state):
    rc, report = run(
        base_url, tmp_path, "--model", "slow", "--num-requests", "2", "--request-timeout-s", "0.3"
    )
    assert rc == 1 and report["summary"]["num_failed"] == 2
    assert all("timeout" in r["error"] for r in report["requests"])
    rc, report = run(
        base_url,
        tmp_path,
        "--model",
        "slow",
        "--num-requests",
        "4",
        "--max-concurrency",
        "2",
        "--max-duration-s",
        "0.4",
    )
    summary = report["summary"]
    assert rc == 1 and (summary["num_aborted"], summary["num_not_sent"]) == (2, 2)
    assert summary["duration_s"] < 10


def test_images_and_length_ranges(base_url, tmp_path, state):
    args = ["--num-requests", "6", "--images-per-request", "1:2", "--image-size", "32x16"]
    rc, report = run(base_url, tmp_path, *args, "--input-len-range", "3:9", "--output-len-range", "2:4")
    assert rc == 0 and report["summary"]["num_ok"] == 6
    urls = []
    for body, record in zip(state.bodies, sorted(report["requests"], key=lambda r: r["index"]), strict=True):
        images = [p["image_url"]["url"] for p in body["messages"][0]["content"] if p["type"] == "image_url"]
        assert len(images) == record["num_images"] and 1 <= len(images) <= 2
        assert 3 <= record["input_len"] <= 9 and record["completion_tokens"] == record["output_len"]
        assert record["prompt_tokens"] == record["input_len"] + IMAGE_TOKENS * len(images) + TEMPLATE_TOKENS
        urls += images
    assert len(set(urls)) == len(urls)  # every image differs: no cache can hit
    png = base64.b64decode(urls[0].removeprefix("data:image/png;base64,"))
    assert Image.open(io.BytesIO(png)).size == (32, 16)


def test_markdown_is_appended(base_url, tmp_path, state):
    md = tmp_path / "bench.md"
    for _ in range(2):
        run(
            base_url,
            tmp_path,
            "--num-requests",
            "2",
            "--output-len",
            "3",
            "--markdown",
            str(md),
            "--slo-ttft-ms",
            "5000",
        )
    text = md.read_text()
    assert text.count("### fake-model @ ") == 2 and text.count("| TTFT |") == 2
    assert "goodput (req/s meeting SLOs)" in text and "stageserve bench serve" in text


def test_unreachable_endpoint_fails_fast(tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"  # bound, not listening: connection refused
    rc, report = run(url, tmp_path, "--model", "m", "--num-requests", "2")
    assert rc == 1 and report["summary"]["num_failed"] == 2
    assert main(["--base-url", url, "--num-requests", "1"]) == 1  # no --model and no /models
    sock.close()


def test_workload_is_deterministic_and_png_decodes():
    workload = WorkloadSpec(IntRange(4, 40), IntRange.parse("8"), IntRange.parse("0:1"), (24, 8), False, 0.0)
    first, again = make_requests("m", workload, 5, seed=3), make_requests("m", workload, 5, seed=3)
    assert first == again and make_requests("m", workload, 5, seed=4) != first
    image = np.asarray(Image.open(io.BytesIO(png_bytes(24, 8, seed=9))))
    assert image.shape == (8, 24, 3) and image[5, 20, 0] == (20 + 9 * 7) % 256
    assert arrival_offsets(3, float("inf"), 0) == [0.0, 0.0, 0.0]
    offsets = arrival_offsets(20_000, 50.0, 0)
    assert offsets == sorted(offsets) and offsets[-1] / len(offsets) == pytest.approx(1 / 50, rel=0.05)
    with pytest.raises(ValueError):
        IntRange.parse("5:2")
