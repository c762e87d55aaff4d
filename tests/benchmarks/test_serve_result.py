"""The serving client at ``vllm bench serve``'s conventions, against the fake server of
``conftest``: its result JSON's fields, warm-up requests, ``--extra-body``, configured
percentiles, burstiness, non-streamed replies and local token counting by default."""

from __future__ import annotations

import json

import pytest

from benchmarks.serve import main
from tests.benchmarks.conftest import TEMPLATE_TOKENS, WORD_TOKENIZER, run
from tests.conftest import TINY_MODEL_DIR

VLLM_FIELDS = (
    "date endpoint_type backend label model_id tokenizer_id num_prompts request_rate burstiness "
    "max_concurrency duration completed failed total_input_tokens total_output_tokens "
    "request_throughput request_goodput output_throughput total_token_throughput input_lens "
    "output_lens ttfts itls generated_texts errors max_output_tokens_per_s "
    "max_concurrent_requests"
).split()


def test_the_result_has_vllms_fields_and_the_warmups_are_left_out(base_url, tmp_path, state):
    args = ["--num-requests", "4", "--input-len", "6", "--output-len", "5", "--num-warmups", "2"]
    args += ["--request-rate", "400", "--burstiness", "0.5", "--max-concurrency", "3"]
    args += ["--metric-percentiles", "50,99.9"]
    rc, report = run(base_url, tmp_path, *args)
    assert rc == 0 and len(state.bodies) == 6  # 2 warm-ups first, then the 4 timed
    warmup_prompts = {b["messages"][0]["content"] for b in state.bodies[:2]}
    assert not warmup_prompts & {b["messages"][0]["content"] for b in state.bodies[2:]}
    assert report["warmup"] == {"num_requests": 2, "num_ok": 2}
    assert [k for k in report if k in VLLM_FIELDS] == VLLM_FIELDS
    assert (report["completed"], report["failed"], report["num_prompts"]) == (4, 0, 4)
    assert report["model_id"] == "fake-model" and report["tokenizer_id"] == str(WORD_TOKENIZER)
    assert (report["request_rate"], report["burstiness"], report["max_concurrency"]) == (
        400.0,
        0.5,
        3,
    )
    assert report["input_lens"] == [6] * 4 and report["output_lens"] == [5] * 4
    assert report["total_input_tokens"] == 4 * (6 + TEMPLATE_TOKENS)
    assert report["total_output_tokens"] == 20
    assert report["total_token_throughput"] == pytest.approx(
        report["request_throughput"] * (6 + TEMPLATE_TOKENS + 5)
    )
    assert report["generated_texts"] == [" tok" * 5] * 4 and report["errors"] == [""] * 4
    assert all(len(itl) == 4 for itl in report["itls"]) and all(t > 0 for t in report["ttfts"])
    assert 1 <= report["max_concurrent_requests"] <= 3
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p99.9"):
            assert report[f"{stat}_{metric}_ms"] >= 0, (stat, metric)
        assert f"p99_{metric}_ms" not in report
    assert report["p99.9_e2el_ms"] >= report["median_e2el_ms"] >= report["p50_ttft_ms"]
    assert "generated_text" not in report["requests"][0]


def test_extra_body_is_merged_last_into_every_body(base_url, tmp_path, state):
    extra = {"top_k": 5, "temperature": 0.7, "chat_template_kwargs": {"enable_thinking": False}}
    args = ["--num-requests", "2", "--output-len", "3", "--extra-body", json.dumps(extra)]
    rc, _ = run(base_url, tmp_path, *args, "--temperature", "0")
    assert rc == 0 and len(state.bodies) == 2
    assert all(body.items() >= extra.items() for body in state.bodies)  # 0.7 over --temperature
    for bad in ("[1]", "{not json"):
        with pytest.raises(SystemExit):
            main(["--base-url", base_url, "--extra-body", bad])


@pytest.mark.parametrize("backend", ["openai-chat", "openai"])
def test_non_streamed_replies_have_ttft_e2e_and_no_itl(base_url, tmp_path, state, backend):
    args = ["--num-requests", "3", "--output-len", "4", "--disable-stream", "--backend", backend]
    rc, report = run(base_url, tmp_path, *args)
    assert rc == 0 and report["completed"] == 3
    assert all(body["stream"] is False and "stream_options" not in body for body in state.bodies)
    for record in report["requests"]:
        assert record["ttft_s"] == record["e2e_s"] > 0
        assert record["itl_s"] == [] and record["tpot_s"] is None
        assert record["completion_tokens"] == 4
    assert report["generated_texts"] == [" tok" * 4] * 3
    assert report["mean_tpot_ms"] is None and report["mean_itl_ms"] is None


def test_tokens_are_counted_with_the_models_tokenizer_by_default(base_url, tmp_path, state):
    out = tmp_path / "run.json"
    args = ["--base-url", base_url, "--model", str(TINY_MODEL_DIR), "--output-json", str(out)]
    assert main([*args, "--num-requests", "2", "--input-len", "9", "--output-len", "2"]) == 0
    report = json.loads(out.read_text())
    assert state.num_tokenize_calls == 0
    assert report["tokenizer_id"] == str(TINY_MODEL_DIR / "tokenizer.json")
    assert report["input_lens"] == [9, 9]  # the tiny model's tokens, not the fake's words
