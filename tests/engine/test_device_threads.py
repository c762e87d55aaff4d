"""A model on the second GPU, driven from a thread whose current device is the first.

Services run the model on a worker thread (decode's engine thread, prefill's worker, the
encoder's engine thread). CUDA's current device is per thread and starts at GPU 0, and
Triton launches on the current device, so every model entry point must make its own
device current (``ops.on_device``); without it a decode on cuda:1 failed at its first
Triton kernel on 2 x H200.
"""

from __future__ import annotations

import threading

import pytest
import torch

from services.engine.attention import ForwardMode
from services.engine.loader import load_model
from services.engine.model_runner import KVCacheConfig, ModelRunner
from services.engine.step_inputs import StepInput
from tests.conftest import TINY_MODEL_DIR

pytestmark = pytest.mark.gpu


def _in_a_fresh_thread(fn):
    box: dict = {}

    def run() -> None:
        try:
            assert torch.cuda.current_device() == 0  # what a new thread starts with
            box["value"] = fn()
        except BaseException as exc:  # re-raised in the test's thread
            box["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(timeout=120)
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_a_model_on_gpu_1_runs_from_a_thread_whose_current_device_is_gpu_0():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    device = torch.device("cuda", 1)
    model = load_model(TINY_MODEL_DIR, device=str(device), dtype="bfloat16")
    runner = ModelRunner(model, KVCacheConfig(64, 16), "torch")
    ids = list(range(3, 40))
    runner.page_table.reserve("r", len(ids) + 2)
    step = StepInput("r", ids, torch.arange(len(ids)).expand(3, -1), 0)
    logits = _in_a_fresh_thread(
        lambda: runner.forward(ForwardMode.EXTEND, [step])
    )  # Triton kernels inside
    assert logits.device == device and torch.isfinite(logits).all()
    token = int(logits.argmax(-1))
    decode = StepInput("r", [token], torch.full((3, 1), len(ids), dtype=torch.long), len(ids))
    assert _in_a_fresh_thread(lambda: runner.forward(ForwardMode.DECODE, [decode])).device == device
    pixels = torch.randn(
        16,
        model.config.vision.in_channels
        * model.config.vision.temporal_patch_size
        * model.config.vision.patch_size**2,
    )
    embeds = _in_a_fresh_thread(lambda: runner.encode_images(pixels, [(1, 4, 4)]))
    assert embeds.device == device and torch.isfinite(embeds).all()
