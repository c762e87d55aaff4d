"""Offline engine behaviour: stopping rules, seeds, capacity and bad input; no page is ever lost."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.common.errors import CapacityError, InvalidRequestError
from services.common.types import FinishReason, SamplingParams
from services.engine.llm import EngineRequest, LLMEngine
from tests.conftest import REPO, TINY_MODEL_DIR, image_bytes


@pytest.fixture(scope="module")
def small_engine() -> LLMEngine:
    return LLMEngine.from_dir(TINY_MODEL_DIR, page_size=4, num_pages=24)


def request(ids, **params) -> EngineRequest:
    return EngineRequest(
        f"r{len(ids)}-{sorted(params.items())}", list(ids), SamplingParams(**params)
    )


def test_stop_token_and_eos(small_engine):
    free = small_engine.runner.page_manager.num_free_pages
    greedy = small_engine.generate(
        [request(range(10, 30), temperature=0.0, max_new_tokens=8, ignore_eos=True)]
    )[0]
    third = greedy.token_ids[2]
    stopped = small_engine.generate(
        [request(range(10, 30), temperature=0.0, max_new_tokens=8, stop_token_ids=(third,))]
    )[0]
    assert stopped.finish_reason is FinishReason.STOP
    assert stopped.token_ids == greedy.token_ids[: greedy.token_ids.index(third) + 1]
    assert greedy.finish_reason is FinishReason.LENGTH and len(greedy.token_ids) == 8
    small_engine.eos_token_ids.add(third)
    try:
        eos = small_engine.generate([request(range(10, 30), temperature=0.0, max_new_tokens=8)])[0]
    finally:
        small_engine.eos_token_ids.discard(third)
    assert eos.finish_reason is FinishReason.STOP and eos.token_ids[-1] == third
    assert small_engine.runner.page_manager.num_free_pages == free


def test_context_limit_stops_with_length():
    engine = LLMEngine.from_dir(TINY_MODEL_DIR, page_size=4, num_pages=64)
    engine.max_context_len = 24
    out = engine.generate(
        [request(range(10, 30), temperature=0.0, max_new_tokens=100, ignore_eos=True)]
    )[0]
    assert out.finish_reason is FinishReason.LENGTH
    assert out.num_prompt_tokens + len(out.token_ids) == 24
    with pytest.raises(InvalidRequestError, match="context limit is 24"):
        engine.generate([request(range(10, 40))])


def test_same_seed_same_tokens(small_engine):
    def sample(seed):
        return small_engine.generate(
            [request(range(40, 50), temperature=1.0, seed=seed, max_new_tokens=12, ignore_eos=True)]
        )[0].token_ids

    assert sample(3) == sample(3)
    assert sample(3) != sample(4)


def test_capacity_error_holds_no_pages(small_engine):
    free = small_engine.runner.page_manager.num_free_pages
    too_many = [request(range(10, 10 + n), max_new_tokens=2) for n in (40, 41, 42)]
    with pytest.raises(CapacityError):
        small_engine.generate(too_many)
    assert small_engine.runner.page_manager.num_free_pages == free


def test_running_out_of_pages_mid_decode_releases_everything(small_engine):
    free = small_engine.runner.page_manager.num_free_pages
    long = request(range(10, 80), temperature=0.0, max_new_tokens=200, ignore_eos=True)
    with pytest.raises(CapacityError):
        small_engine.generate([long])
    assert small_engine.runner.page_manager.num_free_pages == free


@pytest.mark.parametrize(
    ("req", "param"),
    [
        (EngineRequest("e", []), "prompt"),
        (EngineRequest("v", [10, 99999]), "prompt"),
        (EngineRequest("t", [10], SamplingParams(temperature=-1.0)), "temperature"),
        (EngineRequest("m", [10], SamplingParams(max_new_tokens=0)), "max_new_tokens"),
    ],
)
def test_bad_requests(small_engine, req, param):
    with pytest.raises(InvalidRequestError) as info:
        small_engine.generate([req])
    assert info.value.param == param


def test_generate_command_prints_a_continuation(tmp_path):
    image = tmp_path / "in.png"
    image.write_bytes(image_bytes(90, 60, seed=9))
    cmd = [
        sys.executable,
        "-m",
        "services.cli",
        "generate",
        "--prompt",
        "What is this?",
        "--image",
        str(image),
        "--max-tokens",
        "6",
    ]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "6 generated, finish_reason=length" in done.stderr
    assert done.stdout.strip()


def test_generate_command_rejects_non_image(tmp_path):
    bad = tmp_path / "not-an-image.png"
    bad.write_bytes(b"plain text, not pixels")
    cmd = [sys.executable, "-m", "services.cli", "generate", "--prompt", "x", "--image", str(bad)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "not an image" in done.stderr


def test_min_tokens_holds_back_an_eos_that_logit_bias_forces(small_engine):
    eos = min(small_engine.eos_token_ids)
    forced = {"temperature": 0.0, "max_new_tokens": 8, "logit_bias": ((eos, 100.0),)}
    at_once = small_engine.generate([request(range(10, 30), **forced)])[0]
    assert (at_once.token_ids, at_once.finish_reason) == ([eos], FinishReason.STOP)
    held = small_engine.generate([request(range(10, 30), **forced, min_tokens=4)])[0]
    assert len(held.token_ids) == 5 and held.token_ids[-1] == eos and eos not in held.token_ids[:-1]
    assert held.finish_reason is FinishReason.STOP


def test_logprobs_are_the_raw_log_softmax_of_each_sampled_token(small_engine):
    prompt = list(range(10, 30))
    params = dict(max_new_tokens=6, ignore_eos=True, return_logprobs=True, num_top_logprobs=3)
    out = small_engine.generate([request(prompt, temperature=1.5, seed=7, **params)])[0]
    plain = small_engine.generate(
        [request(prompt, temperature=1.5, seed=7, max_new_tokens=6, ignore_eos=True)]
    )[0]
    assert plain.token_ids == out.token_ids and plain.logprobs == []  # asking changes no token
    full = request(prompt + out.token_ids[:-1])
    logits = small_engine.prompt_logits([full])[0][len(prompt) - 1 :]  # the rows sampled from
    reference = logits.float().log_softmax(dim=-1)
    assert len(out.logprobs) == len(out.token_ids)
    for row, token, logprob in zip(reference, out.token_ids, out.logprobs, strict=True):
        assert logprob.token_id == token
        assert abs(logprob.logprob - row[token].item()) < 1e-4
        top = row.topk(3)
        assert list(logprob.top_token_ids) == top.indices.tolist()
        values = top.values.tolist()
        assert all(abs(a - b) < 1e-4 for a, b in zip(logprob.top_logprobs, values, strict=True))
