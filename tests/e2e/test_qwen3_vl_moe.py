"""Qwen3-VL-MoE through every service: ``stageserve up --model tiny-qwen3-vl-moe`` serves a
chat with an image and a text-only one whose greedy output equals ``stageserve generate``'s
and transformers'. Prefill and decode run the checkpoint's MoE layers on their grouped
forward (``services/engine/model/moe.py``)."""

from __future__ import annotations

import pytest

from services.engine.offline import OfflinePipeline
from tests.conftest import TINY_MODEL_DIR, image_bytes
from tests.e2e.openai_api.helpers import chat
from tests.e2e.system import openai_client, running_system
from tests.e2e.test_qwen3_vl import MAX_TOKENS, generate_cli, transformers_text

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MOE_DIR = TINY_MODEL_DIR.parent / "tiny-qwen3-vl-moe"
CASES = (
    ("What is shown here?", [image_bytes(224, 160, seed=31)]),
    ("Tell me about the moon.", []),
)


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    with running_system(
        tmp_path_factory.mktemp("system"), *("--model", str(MOE_DIR), "--num-pages", "512")
    ) as system:
        yield system


def test_chats_match_generate_and_transformers(system, tmp_path):
    client = openai_client(system)
    pipeline = OfflinePipeline.from_dir(MOE_DIR)
    model = client.models.list().data[0].id
    for text, images in CASES:
        expected, num_prompt = generate_cli(text, images, tmp_path, MOE_DIR)
        assert expected, "an empty continuation would not test much"
        assert expected == transformers_text(pipeline, text, images, MOE_DIR)
        reply = client.chat.completions.create(
            model=model, messages=chat(text, images), max_tokens=MAX_TOKENS, temperature=0
        )
        assert reply.choices[0].message.content == expected
        assert reply.usage.prompt_tokens == num_prompt
