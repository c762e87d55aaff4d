"""The serving benchmark client against a fake OpenAI-compatible server on 127.0.0.1.

The fake streams ``max_tokens`` tokens (one word each, ``batch-3`` packs three per chunk)
with small sleeps, reports usage (prompt tokens = words + 100 per image + 5; completions:
words), counts tokens as words on ``/tokenize``, and fails on demand by model name. No
assertion is on wall time beyond orderings.
"""

from __future__ import annotations

import socket

import pytest

from benchmarks.serve import main
from benchmarks.serve_tokens import WORDS
from tests.benchmarks.conftest import TEMPLATE_TOKENS, run
from tests.conftest import TINY_MODEL_DIR


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
    assert main(["--base-url", url, "--model", "m", "--num-requests", "1"]) == 1  # no tokenizer
    server = ["--tokenizer", "server"]  # no /tokenize to count with
    assert main(["--base-url", url, "--model", "m", "--num-requests", "1", *server]) == 1
    sock.close()
