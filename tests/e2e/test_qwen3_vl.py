"""Qwen3-VL through every service: ``stageserve up --model tiny-qwen3-vl`` with prefill on two
CP ranks (every batch sharded, blocks of one page) serves chat requests with images whose
greedy output equals ``stageserve generate``'s and transformers'. The image spans straddle
the CP shard blocks, so each rank adds the DeepStack rows of its own tokens; the second
request's first image comes from the encoder's cache."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.common.types import SamplingParams
from services.engine.attention.context_parallel import CpShard
from services.engine.config import ModelConfig
from services.engine.offline import OfflinePipeline
from tests.conftest import REPO, TINY_MODEL_DIR, image_bytes
from tests.e2e.openai_api.helpers import chat
from tests.e2e.system import openai_client, running_system
from tests.engine.test_model_parity import hf_inputs

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
QWEN3_DIR = TINY_MODEL_DIR.parent / "tiny-qwen3-vl"
MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0)
ENCODER = "stageserve_vision_encoder"
BLOCK_TOKENS = 16  # --prefill-cp-block-tokens: one page of prefill's default size
FIRST, SECOND = image_bytes(224, 224, seed=21), image_bytes(90, 200, seed=22)
CASES = (
    ("What is shown here?", [FIRST]),
    ("Compare the two pictures.", [FIRST, SECOND]),  # FIRST: an encoder cache hit
)


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    with running_system(
        tmp_path_factory.mktemp("system"),
        *("--model", str(QWEN3_DIR), "--num-pages", "512"),
        *("--prefill-cp", "2", "--prefill-cp-min-tokens", "1"),
        *("--prefill-cp-block-tokens", str(BLOCK_TOKENS)),
    ) as system:
        yield system


@pytest.fixture(scope="module")
def client(system):
    return openai_client(system)


@pytest.fixture(scope="module")
def pipeline() -> OfflinePipeline:
    return OfflinePipeline.from_dir(QWEN3_DIR)


def generate_cli(
    text: str, images: list[bytes], tmp_path, model_dir: Path = QWEN3_DIR
) -> tuple[str, int]:
    """``stageserve generate``'s greedy continuation and its prompt token count."""
    args = [sys.executable, "-m", "services.cli", "generate", "--model", str(model_dir)]
    for i, data in enumerate(images):
        path = tmp_path / f"image{i}.png"
        path.write_bytes(data)
        args += ["--image", str(path)]
    args += ["--prompt", text, "--max-tokens", str(MAX_TOKENS)]
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300, check=True)
    num_prompt = re.search(r"\[(\d+) prompt tokens", done.stderr)
    assert num_prompt is not None, done.stderr
    return done.stdout.removesuffix("\n"), int(num_prompt.group(1))


def transformers_text(
    pipeline: OfflinePipeline, text: str, images: list[bytes], model_dir: Path = QWEN3_DIR
) -> str:
    from transformers import AutoModelForImageTextToText

    hf = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    content = [*({"type": "image"} for _ in images), {"type": "text", "text": text}]
    request = pipeline.build_request([{"role": "user", "content": content}], images, GREEDY)
    with torch.no_grad():
        out = hf.generate(**hf_inputs(request), max_new_tokens=MAX_TOKENS, do_sample=False)
    tokens = out[0, len(request.prompt_ids) :].tolist()
    return pipeline.text.decode(tokens, skip_special_tokens=True)


def assert_straddles(pipeline: OfflinePipeline, text: str, images: list[bytes]) -> list[int]:
    """The rows of each image, after checking each image straddles the CP shard blocks."""
    content = [*({"type": "image"} for _ in images), {"type": "text", "text": text}]
    request = pipeline.build_request([{"role": "user", "content": content}], images, GREEDY)
    shard = CpShard(0, 2, BLOCK_TOKENS)
    for span in request.spans:
        owners = {shard.owner(i) for i in range(span.offset, span.offset + span.length)}
        assert owners == {0, 1} and span.offset % BLOCK_TOKENS, span
    return [span.length for span in request.spans]


def test_chats_with_images_match_generate_and_transformers(system, client, pipeline, tmp_path):
    model = client.models.list().data[0].id
    for text, images in CASES:
        rows = assert_straddles(pipeline, text, images)
        expected, num_prompt = generate_cli(text, images, tmp_path)
        assert expected == transformers_text(pipeline, text, images)
        reply = client.chat.completions.create(
            model=model, messages=chat(text, images), max_tokens=MAX_TOKENS, temperature=0
        )
        assert reply.choices[0].message.content == expected
        assert reply.usage.prompt_tokens == num_prompt
    # each image went through the ViT once; the cache holds all of the rows of both (the last
    # case's images), DeepStack rows included
    assert system.metric("vision_encoder", f"{ENCODER}_images_encoded_total") == 2
    row_bytes = ModelConfig.from_dir(QWEN3_DIR).embedding_row_width * 4  # fp32
    assert system.metric("vision_encoder", f"{ENCODER}_cache_bytes") == sum(rows) * row_bytes
