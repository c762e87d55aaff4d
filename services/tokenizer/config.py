"""Configuration of one tokenizer process, built once from the command line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_PIXELS = 64 * 1000 * 1000


@dataclass(frozen=True)
class Limits:
    """What one Tokenize request may ask for; over a limit is INVALID_ARGUMENT."""

    max_model_len: int  # a prompt must be shorter than this (tokens, image placeholders included)
    max_image_bytes: int = MAX_IMAGE_BYTES  # compressed size of one image
    max_image_pixels: int = MAX_IMAGE_PIXELS  # width * height of one decoded image


@dataclass(frozen=True)
class TokenizerConfig:
    model_dir: Path
    limits: Limits
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    num_workers: int = 1  # worker processes for CPU-heavy work; 0 = one thread in this process
    log_level: str = "INFO"
