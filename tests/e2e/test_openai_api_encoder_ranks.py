"""The OpenAI API suite (``test_openai_api.py``) once more, on ``stageserve up --encoder-ranks 2``.

Every test of that module runs here against a system whose vision encoder has two rank
processes (outputs equal transformers with images); then both ranks are seen encoding,
and a JPEG cut short in its pixel data (which only the encoder's decode can tell) is a 400.
"""

from __future__ import annotations

import base64
import re
import urllib.request

import httpx
import pytest

from tests.conftest import image_bytes
from tests.e2e.system import pid_alive, start_system
from tests.e2e.test_openai_api import *  # noqa: F403 (the same tests, run on this module's system)
from tests.e2e.test_openai_api import chat

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def system(tmp_path_factory):
    system = start_system(
        tmp_path_factory.mktemp("system"), "--num-pages", "1024", "--encoder-ranks", "2"
    )
    yield system
    assert system.stop() == 0
    assert not [pid for pid in system.child_pids() if pid_alive(pid)]


def images_encoded_by_rank(system) -> dict[str, float]:
    text = urllib.request.urlopen(system.metrics_url("vision_encoder"), timeout=10).read().decode()
    pattern = (
        r'^stageserve_vision_encoder_images_encoded_total\{(?:[^}]*,)?rank="(\d+)"[^}]*\} (\S+)$'
    )
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.M)}


def test_y_both_encoder_ranks_encoded(system) -> None:
    by_rank = images_encoded_by_rank(system)  # after the module's image tests
    assert set(by_rank) == {"0", "1"} and all(n > 0 for n in by_rank.values()), by_rank


def test_y_a_jpeg_cut_in_its_pixel_data_is_a_400(system, model_name) -> None:
    whole = image_bytes(300, 200, seed=4242, fmt="JPEG")
    cut = whole[: len(whole) // 2]
    url = "data:image/jpeg;base64," + base64.b64encode(cut).decode()
    body = {
        "model": model_name,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "what is it?"},
                ],
            }
        ],
        "max_tokens": 4,
    }
    response = httpx.post(f"{system.base_url}/chat/completions", json=body, timeout=120)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "truncated or corrupt" in error["message"]
    reply = httpx.post(
        f"{system.base_url}/chat/completions",
        json={
            "model": model_name,
            "messages": chat("still there?", [image_bytes(64, 64, seed=4243)]),
            "max_tokens": 4,
        },
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
