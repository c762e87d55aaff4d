"""The serving benchmark client against a fake OpenAI-compatible server on 127.0.0.1.

The fake streams ``max_tokens`` tokens (one word each, ``batch-3`` packs three per chunk)
with small sleeps, reports usage (prompt tokens = words + 100 per image + 5; completions:
words), counts tokens as words on ``/tokenize``, and fails on demand by model name. No
assertion is on wall time beyond orderings.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from PIL import Image

from benchmarks.serve import main
from benchmarks.serve_client import Outcome, RequestRecord, per_token_itl
from benchmarks.serve_metrics import Slo, summarize
from benchmarks.serve_tokens import WORDS
from benchmarks.serve_workload import IntRange, WorkloadSpec, arrival_offsets, make_requests
from tests.conftest import TINY_MODEL_DIR

TEMPLATE_TOKENS = 5
IMAGE_TOKENS = 100


class FakeState:
    def __init__(self) -> None:
        self.bodies: list[dict] = []
        self.auth_headers: list[str | None] = []
        self.num_in_flight = 0
        self.max_in_flight = 0
        self.num_tokenize_calls = 0


STATE = FakeState()


def _chunk(delta: dict, finish_reason: str | None = None, is_chat: bool = True) -> str:
    if is_chat:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        event = {"object": "chat.completion.chunk", "choices": [choice]}
    else:
        choice = {"index": 0, "text": delta.get("content", ""), "finish_reason": finish_reason}
        event = {"object": "text_completion", "choices": [choice]}
    return f"data: {json.dumps(event)}\n\n"


class WordCounter:
    """Tokens are whitespace-separated words (what the fake server counts)."""

    async def count(self, texts) -> list[int]:
        return [len(text.split()) for text in texts]


def _prompt_tokens(body: dict) -> int:
    if "prompt" in body:
        return len(body["prompt"].split())
    content = body["messages"][0]["content"]
    parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
    words = sum(len(p["text"].split()) for p in parts if p["type"] == "text")
    return words + IMAGE_TOKENS * sum(p["type"] == "image_url" for p in parts) + TEMPLATE_TOKENS


async def _events(body: dict):
    model, num_tokens = body["model"], body["max_tokens"]
    per_chunk = 3 if model == "batch-3" else 1
    delay = 5.0 if model == "slow" else 0.002
    is_chat = "messages" in body
    STATE.num_in_flight += 1
    STATE.max_in_flight = max(STATE.max_in_flight, STATE.num_in_flight)
    try:
        if is_chat:
            yield _chunk({"role": "assistant", "content": ""})
        await asyncio.sleep(0.01)
        for start in range(0, num_tokens, per_chunk):
            if model == "error-event" and start == 2:
                yield f"data: {json.dumps({'error': {'message': 'engine died', 'code': 503}})}\n\n"
                return
            yield _chunk({"content": " tok" * min(per_chunk, num_tokens - start)}, is_chat=is_chat)
            await asyncio.sleep(delay)
        yield _chunk({}, finish_reason="length", is_chat=is_chat)
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

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        body = await request.json()
        STATE.num_tokenize_calls += 1
        assert body["add_special_tokens"] is False and body["model"]
        return {"count": len(body["prompt"].split()), "max_model_len": 4096, "tokens": []}

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        STATE.bodies.append(body)
        STATE.auth_headers.append(request.headers.get("authorization"))
        if body["model"] == "fail-500":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)
        if body["model"] == "fail-400":
            return JSONResponse(
                {"error": {"message": "bad prompt", "type": "invalid_request_error"}}, 400
            )
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


# Tokens are whitespace-separated words, as the fake server counts them (counting locally is fast).
WORD_TOKENIZER = Path(__file__).parent / "word_tokenizer.json"


def run(base_url: str, tmp_path, *args: str, tokenizer: bool = True) -> tuple[int, dict]:
    """One benchmark run; ``tokenizer=False`` counts tokens with the server's /tokenize."""
    out = tmp_path / "run.json"
    count_with = ["--tokenizer", str(WORD_TOKENIZER)] if tokenizer else []
    common = ["--base-url", base_url, "--output-json", str(out), "--request-timeout-s", "10"]
    rc = main([*common, *count_with, *args])
    return rc, json.loads(out.read_text())


def test_records_from_a_streamed_run(base_url, tmp_path, state):
    args = [
        "--num-requests",
        "4",
        "--input-len",
        "8",
        "--output-len",
        "5",
        "--ignore-eos",
        "--api-key",
        "sk-test",
    ]
    rc, report = run(
        base_url, tmp_path, *args, tokenizer=False
    )  # counted with the server's /tokenize
    assert rc == 0
    assert report["config"]["model"] == "fake-model"  # the first of GET /v1/models
    assert (
        report["config"]["api_key"] == "<redacted>" and state.auth_headers == ["Bearer sk-test"] * 4
    )
    assert report["summary"]["num_ok"] == 4 and report["summary"]["num_failed"] == 0
    for record in report["requests"]:
        assert record["outcome"] == "ok" and record["error"] == ""
        assert record["completion_tokens"] == 5 and record["num_chunks"] == 5
        assert record["prompt_tokens"] == 8 + TEMPLATE_TOKENS
        assert 0 < record["ttft_s"] <= record["e2e_s"]
        assert len(record["itl_s"]) == 4 and record["tpot_s"] > 0
    assert state.num_tokenize_calls >= 2 * len(WORDS) + 4  # each word twice, then each prompt
    for body in state.bodies:
        assert body["ignore_eos"] is True and body["stream"] is True and body["max_tokens"] == 5
        assert body["stream_options"] == {"include_usage": True}
        assert len(body["messages"][0]["content"].split()) == 8


def test_itl_is_per_token_when_chunks_carry_several(base_url, tmp_path, state):
    rc, report = run(
        base_url, tmp_path, "--model", "batch-3", "--num-requests", "2", "--output-len", "7"
    )
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
    assert summary.ttft.p50 == pytest.approx(25.0)
    assert summary.ttft.p90 == pytest.approx(37.0)  # linear: 10 + 0.9 * 3 * 10
    assert summary.ttft.p99 == pytest.approx(39.7)
    assert summary.tpot.p50 == pytest.approx(22.5)  # TPOTs 9, 18, 27, 36 ms
    assert summary.itl.count == 40 and summary.e2e.p99 == pytest.approx(397.0)
    assert summary.request_throughput == pytest.approx(2.0)
    assert summary.input_token_throughput == pytest.approx(100.0)
    assert summary.output_token_throughput == pytest.approx(22.0)
    assert summary.num_good == 2 and summary.goodput == pytest.approx(
        1.0
    )  # TTFT <= 25 and TPOT <= 30
    assert summarize(records, 2.0, Slo(e2e_ms=300), 7).num_good == 3
    no_slo = summarize(records, 2.0, Slo(), 7)
    assert no_slo.goodput is None and no_slo.num_good is None


def test_request_rate_mode_completes_all(base_url, tmp_path, state):
    rc, report = run(
        base_url, tmp_path, "--request-rate", "200", "--num-requests", "8", "--output-len", "3"
    )
    assert rc == 0 and report["summary"]["num_ok"] == 8 and len(state.bodies) == 8
    assert report["config"]["request_rate"] == 200.0
    starts = [r["start_s"] for r in report["requests"]]
    assert starts[-1] >= starts[0] >= 0


def test_concurrency_mode_caps_requests_in_flight(base_url, tmp_path, state):
    rc, report = run(
        base_url, tmp_path, "--max-concurrency", "2", "--num-requests", "6", "--output-len", "4"
    )
    assert rc == 0 and report["summary"]["num_ok"] == 6
    assert report["config"]["request_rate"] == "inf"
    assert 1 <= state.max_in_flight <= 2


@pytest.mark.parametrize(
    "model, status",
    [("fail-500", "HTTP 500"), ("fail-400", "HTTP 400"), ("error-event", "error event")],
)
def test_failures_are_counted_with_their_error(base_url, tmp_path, state, model, status):
    rc, report = run(
        base_url, tmp_path, "--model", model, "--num-requests", "3", "--output-len", "4"
    )
    assert rc == 1
    summary = report["summary"]
    assert summary["num_failed"] == 3 and summary["num_ok"] == 0 and summary["ttft"] is None
    assert all(
        r["outcome"] == "failed" and r["error"].startswith(status) for r in report["requests"]
    )


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


def _image_urls(body: dict) -> list[str]:
    return [
        p["image_url"]["url"] for p in body["messages"][0]["content"] if p["type"] == "image_url"
    ]


def _decode_data_url(url: str) -> Image.Image:
    header, _, data = url.partition(",")
    return Image.open(io.BytesIO(base64.b64decode(data)))


def test_images_and_length_ranges(base_url, tmp_path, state):
    args = [
        "--num-requests",
        "6",
        "--images-per-request",
        "1:2",
        "--image-size",
        "32x16",
        "--max-concurrency",
        "1",
    ]  # bodies arrive in request order
    rc, report = run(
        base_url, tmp_path, *args, "--input-len-range", "3:9", "--output-len-range", "2:4"
    )
    assert rc == 0 and report["summary"]["num_ok"] == 6
    urls = []
    for body, record in zip(
        state.bodies, sorted(report["requests"], key=lambda r: r["index"]), strict=True
    ):
        images = _image_urls(body)
        assert len(images) == record["num_images"] and 1 <= len(images) <= 2
        assert 3 <= record["input_len"] <= 9 and record["completion_tokens"] == record["output_len"]
        assert (
            record["prompt_tokens"]
            == record["input_len"] + IMAGE_TOKENS * len(images) + TEMPLATE_TOKENS
        )
        urls += images
    assert len(set(urls)) == len(urls)  # every image differs: no cache can hit
    assert all(url.startswith("data:image/jpeg;base64,") for url in urls)
    image = _decode_data_url(urls[0])
    assert image.format == "JPEG" and image.size == (32, 16)


def _neighbour_difference(image: Image.Image) -> float:
    pixels = np.asarray(image.convert("RGB"), dtype=np.int16)
    return float(np.abs(np.diff(pixels, axis=1)).mean())


def test_the_default_image_is_a_noise_jpeg_of_the_requested_size(base_url, tmp_path, state):
    rc, _ = run(
        base_url,
        tmp_path,
        "--num-requests",
        "1",
        "--images-per-request",
        "1",
        "--image-size",
        "320x200",
    )
    assert rc == 0
    [url] = _image_urls(state.bodies[0])
    image = _decode_data_url(url)
    assert (
        url.startswith("data:image/jpeg;base64,")
        and image.format == "JPEG"
        and image.size == (320, 200)
    )
    assert (
        _neighbour_difference(image) > 50
    )  # uniform noise: ~85 between neighbours; a gradient: ~1
    # Noise barely compresses: ~0.9 byte/pixel at quality 90 (a gradient JPEG: ~0.1).
    assert len(base64.b64decode(url.partition(",")[2])) > 0.5 * 320 * 200


@pytest.mark.parametrize(
    ("kind", "fmt", "max_difference"),
    [("gradient", "png", 10), ("blank", "png", 1), ("gradient", "jpeg", 10), ("noise", "png", 256)],
)
def test_other_image_kinds_and_formats(base_url, tmp_path, state, kind, fmt, max_difference):
    rc, _ = run(
        base_url,
        tmp_path,
        "--num-requests",
        "1",
        "--images-per-request",
        "1",
        "--image-size",
        "360p",
        "--image-kind",
        kind,
        "--image-format",
        fmt,
    )
    assert rc == 0
    [url] = _image_urls(state.bodies[0])
    image = _decode_data_url(url)
    assert image.format == fmt.upper() and image.size == (640, 360)
    assert _neighbour_difference(image) < max_difference


def test_completions_backend_streams_text(base_url, tmp_path, state):
    rc, report = run(
        base_url,
        tmp_path,
        "--backend",
        "openai",
        "--num-requests",
        "3",
        "--input-len",
        "12",
        "--output-len",
        "4",
    )
    assert rc == 0 and report["summary"]["num_ok"] == 3
    for body, record in zip(state.bodies, report["requests"], strict=True):
        assert "messages" not in body and len(body["prompt"].split()) == 12
        assert body["stream_options"] == {"include_usage": True}
        assert record["prompt_tokens"] == 12 and record["num_chunks"] == 4 and record["ttft_s"] > 0
    with pytest.raises(SystemExit) as info:
        main(["--base-url", base_url, "--backend", "openai", "--images-per-request", "1"])
    assert info.value.code == 2  # no images on text completions


SHAREGPT = Path(__file__).parent / "sharegpt_small.json"


def test_sharegpt_dataset_gives_its_prompts_and_reply_lengths(base_url, tmp_path, state):
    rc, report = run(
        base_url,
        tmp_path,
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        str(SHAREGPT),
        "--num-requests",
        "3",
    )
    assert rc == 0 and report["summary"]["num_ok"] == 3
    conversations = [c for c in json.loads(SHAREGPT.read_text()) if isinstance(c, dict)]
    usable = {}  # one-turn, short-reply ("Yes": 1 token) and no-value are skipped
    for c in conversations:
        if c["id"] in {"a", "b", "c", "d"}:
            turns = c.get("conversations") or c["conversation"]
            usable[turns[0]["value"]] = len(turns[1]["value"].split())
    assert len(usable) == 4
    prompts = [body["messages"][0]["content"] for body in state.bodies]
    assert len(set(prompts)) == 3 and set(prompts) <= set(usable)
    for body, record in zip(state.bodies, report["requests"], strict=True):
        prompt = body["messages"][0]["content"]
        assert body["max_tokens"] == usable[prompt] == record["output_len"]
        assert record["input_len"] == len(prompt.split())
    rc, report = run(
        base_url,
        tmp_path,
        "--dataset-name",
        "sharegpt",
        "--dataset-path",
        str(SHAREGPT),
        "--num-requests",
        "2",
        "--sharegpt-output-len",
        "5",
        "--seed",
        "1",
    )
    assert rc == 0 and all(r["output_len"] == 5 for r in report["requests"])


def test_sharegpt_with_too_few_conversations_or_a_bad_file_fails_clearly(
    base_url, tmp_path, state, capsys
):
    args = ["--base-url", base_url, "--dataset-name", "sharegpt"]
    assert main([*args, "--dataset-path", str(SHAREGPT), "--num-requests", "5"]) == 2
    assert "4 usable conversations, fewer than --num-requests 5" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a list"}')
    assert main([*args, "--dataset-path", str(bad)]) == 2
    assert "JSON list of conversations" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--base-url", base_url, "--dataset-name", "sharegpt"])  # no --dataset-path
    assert not state.bodies


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
    rc, report = run(
        url, tmp_path, "--model", "m", "--num-requests", "2", "--tokenizer", str(TINY_MODEL_DIR)
    )
    assert rc == 1 and report["summary"]["num_failed"] == 2
    assert main(["--base-url", url, "--num-requests", "1"]) == 1  # no --model and no /models
    assert (
        main(["--base-url", url, "--model", "m", "--num-requests", "1"]) == 1
    )  # no /tokenize to count with
    sock.close()


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
