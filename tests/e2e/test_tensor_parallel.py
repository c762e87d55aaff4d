"""Tensor parallelism through every service: ``stageserve up --prefill-tp`` / ``--decode-tp``
serves chats (text, images, a second turn) whose greedy output equals the one-process engine's,
each prefill rank writing its KV heads into the decode pools that hold them.

Layouts: the tiny Qwen3-VL MoE on two prefill CP ranks of two TP ranks each, experts split
over each TP group, every batch CP-sharded, DeepStack rows included, and decode at TP = EP = 2
(each prefill rank's heads into the decode rank's pool of the same heads); the tiny Qwen2.5-VL
with prefill at TP = 4 (more ranks than KV heads: each head on two ranks, one writes it) and two
decode DP ranks of TP = 2; the dense tiny Qwen3-VL with prefill at TP = 1 writing every head
into the two pools of a TP = 2 decode rank (its vision encoder at TP = 2: the ViT's heads split,
DeepStack rows included), and at TP = 2 into a TP = 4 decode rank (each KV
head on two decode processes: a prefill rank writes its head into both pools); the tiny MoE on
two prefill CP ranks into decode with DP attention over two ranks, experts split over both.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.types import SamplingParams
from services.engine.offline import OfflinePipeline
from tests.conftest import TINY_MODEL_DIR, image_bytes
from tests.e2e.openai_api.helpers import chat
from tests.e2e.system import openai_client, running_system

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MOE_DIR = TINY_MODEL_DIR.parent / "tiny-qwen3-vl-moe"
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=MAX_TOKENS)
PICTURE = image_bytes(224, 160, seed=31)
QWEN3_DIR = TINY_MODEL_DIR.parent / "tiny-qwen3-vl"
# name: (model, flags, prefill processes, decode processes)
LAYOUTS = {
    "moe-cp2-tp2-ep2": (
        MOE_DIR,
        (
            *("--prefill-cp", "2", "--prefill-tp", "2", "--prefill-ep", "2"),
            *("--prefill-cp-min-tokens", "1", "--prefill-cp-block-tokens", "16"),
            *("--decode-tp", "2", "--decode-ep", "2"),
        ),
        4,
        2,
    ),
    "qwen2.5-tp4-dp2-tp2": (
        TINY_MODEL_DIR,
        ("--prefill-tp", "4", "--decode-dp", "2", "--decode-tp", "2"),
        4,
        4,
    ),
    "qwen3-tp1-into-tp2": (
        QWEN3_DIR,
        ("--decode-tp", "2", "--encoder-ranks", "2", "--encoder-tp", "2"),
        1,
        2,
    ),
    "moe-cp2-into-dp-attention2-ep2": (
        MOE_DIR,
        (
            *("--prefill-cp", "2", "--prefill-cp-min-tokens", "1"),
            *("--decode-dp", "2", "--decode-dp-attention", "--decode-ep", "2"),
        ),
        2,
        2,
    ),
    "qwen3-tp2-into-tp4": (QWEN3_DIR, ("--prefill-tp", "2", "--decode-tp", "4"), 2, 4),
}


def conversations() -> list[tuple[list[dict], list[bytes]]]:
    """(OpenAI messages, their images in order): text, an image, and a second turn."""
    first = chat("What is in this picture?", [PICTURE])
    return [
        (chat("Name three colours of the sea.", []), []),
        (first, [PICTURE]),
        (
            [
                *first,
                {"role": "assistant", "content": "A small picture."},
                {"role": "user", "content": "And what colour is it?"},
            ],
            [PICTURE],
        ),
    ]


def engine_messages(messages: list[dict]) -> list[dict]:
    """The offline pipeline's form: image parts as placeholders (the images go apart)."""
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [
                {"type": "image"} if part["type"] == "image_url" else part for part in content
            ]
        out.append({**message, "content": content})
    return out


def expected_text(pipeline: OfflinePipeline, messages: list[dict], images: list[bytes]) -> str:
    request = pipeline.build_request(engine_messages(messages), images, GREEDY)
    [out] = pipeline.engine.generate([request])
    return pipeline.text.decode(out.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_tensor_parallel_services_match_the_engine(layout: str, tmp_path) -> None:
    model_dir, flags, num_prefill, num_decode = LAYOUTS[layout]
    pipeline = OfflinePipeline.from_dir(model_dir)
    cases = [(m, i, expected_text(pipeline, m, i)) for m, i in conversations()]
    with running_system(
        tmp_path, *("--model", str(model_dir), "--num-pages", "512"), *flags
    ) as system:
        client = openai_client(system)
        model = client.models.list().data[0].id
        for messages, _, expected in cases:
            reply = client.chat.completions.create(
                model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0
            )
            assert reply.choices[0].message.content == expected, (layout, messages)
        for service, num in (("prefill", num_prefill), ("decode", num_decode)):
            pid = system.state[service]["pid"]
            flag = f"--{service}-tp"
            if flag in flags:
                assert f"\0--tp\0{flags[flags.index(flag) + 1]}\0" in cmdline(pid), service
            assert len(rank_processes(pid)) == num, service
        if "--encoder-tp" in flags:
            pid = system.state["vision_encoder"]["pid"]
            assert "\0--tp\0" + "2\0" in cmdline(pid) and len(rank_processes(pid)) == 2


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_text()


def rank_processes(parent: int) -> list[int]:
    """The rank processes ``parent`` spawned."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == parent and "rank_main" in cmdline(int(entry.name)):
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return found
