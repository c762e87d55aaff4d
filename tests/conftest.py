"""Shared test fixtures: the bundled tiny checkpoint, the Hugging Face reference model, images."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from services.common.auth import Credentials
from services.common.paths import BUNDLED_MODEL

REPO = Path(__file__).resolve().parent.parent
TINY_MODEL_DIR = BUNDLED_MODEL  # the package data of services/assets/
RANK_MAIN = "services.common.ranks.rank_main"  # the module every rank process runs

# Set at import time, so every service a test starts as a process inherits it (and requires it);
# in-process servers take INTERNAL_AUTH explicitly, or None on both sides.
os.environ["STAGESERVE_INTERNAL_TOKEN"] = "test-internal-token"
os.environ.pop("STAGESERVE_API_KEY", None)  # the router's API is open unless a test sets a key
INTERNAL_AUTH = Credentials(os.environ["STAGESERVE_INTERNAL_TOKEN"])


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """``values`` set in ``os.environ`` for the block (what spawned processes inherit), then
    each variable as it was."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def rank_children() -> list[int]:
    """Rank processes (and zombies) whose parent is this test process."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:  # it exited meanwhile
            continue
        if int(fields[1]) == os.getpid() and (RANK_MAIN.encode() in cmdline or fields[0] == "Z"):
            found.append(int(entry))
    return found


def _mooncake_import_error() -> str | None:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:  # the wheel or one of its shared libraries is missing
        return str(exc)
    return None


MOONCAKE_ERROR = _mooncake_import_error()
needs_mooncake = pytest.mark.skipif(
    MOONCAKE_ERROR is not None,
    reason=f"mooncake not importable ({MOONCAKE_ERROR}): install mooncake-transfer-engine-non-cuda "
    "and libibverbs1 librdmacm1 libnuma1",
)


def sdk_provider():
    """The OpenTelemetry SDK tracer provider, installed as the global one if it is not yet."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider

    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        trace.set_tracer_provider(TracerProvider())
        provider = trace.get_tracer_provider()
    assert isinstance(provider, TracerProvider)
    return provider


def count_progress_checks(progress) -> list[int]:
    """Count a ``ProgressWatchdog``'s health checks from now on; the returned ``[n]`` grows."""
    polls, check = [0], progress.check

    def counted(health) -> None:
        polls[0] += 1
        check(health)

    progress.check = counted
    return polls


def make_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """A deterministic image with smooth gradients and noise, so resizing and patches matter."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width, 1), y * 255 / max(height, 1), (x + y) % 256], axis=-1)
    pixels = np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, "RGB").convert(mode)


def image_bytes(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    make_image(width, height, seed).save(buf, format=fmt)
    return buf.getvalue()


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return TINY_MODEL_DIR


@pytest.fixture(scope="session")
def hf_model():
    """``transformers``' Qwen2.5-VL on the tiny checkpoint, fp32 on CPU."""
    import torch
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(TINY_MODEL_DIR), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def pipeline():
    """The offline pipeline with small pages, so prompts span many pages."""
    from services.engine.offline import OfflinePipeline

    return OfflinePipeline.from_dir(TINY_MODEL_DIR, page_size=4, num_pages=2048)
