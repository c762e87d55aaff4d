"""On the encoder2 layout (``stageserve up --encoder-ranks 2``), after the image tests of
``test_api.py``: both encoder ranks encoded images, and a JPEG cut short in its pixel data
(which only the encoder's decode can tell) is a 400."""

from __future__ import annotations

import base64
import re
import urllib.request

import httpx
import pytest

from tests.conftest import image_bytes
from tests.e2e.openai_api.helpers import assert_400, chat, only_on

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def images_encoded_by_rank(system) -> dict[str, float]:
    text = urllib.request.urlopen(system.metrics_url("vision_encoder"), timeout=10).read().decode()
    pattern = (
        r'^stageserve_vision_encoder_images_encoded_total\{(?:[^}]*,)?rank="(\d+)"[^}]*\} (\S+)$'
    )
    return {m.group(1): float(m.group(2)) for m in re.finditer(pattern, text, re.M)}


def test_y_both_encoder_ranks_encoded(request, system) -> None:
    only_on(request, "encoder2", "one encoder rank in this layout")
    by_rank = images_encoded_by_rank(system)  # after test_api.py's image tests
    assert set(by_rank) == {"0", "1"} and all(n > 0 for n in by_rank.values()), by_rank


def test_y_a_jpeg_cut_in_its_pixel_data_is_a_400(request, system, model_name) -> None:
    only_on(request, "encoder2", "checked on the encoder2 layout")
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
    error = assert_400(system, "chat/completions", body)
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
