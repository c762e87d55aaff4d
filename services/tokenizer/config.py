"""Configuration of one tokenizer process, built once from the command line."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_PIXELS = 64 * 1000 * 1000
MAX_QUEUED_BYTES = 256 * 1024 * 1024  # four of the largest gRPC messages (64 MiB)
MAX_DEFAULT_WORKERS = 4
WORKER_LIVENESS_TIMEOUT_S = 10.0  # a worker process silent this long is killed and replaced


def default_num_workers() -> int:
    """One worker process per CPU this process may run on, at most ``MAX_DEFAULT_WORKERS``."""
    try:
        num_cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        num_cpus = os.cpu_count() or 1
    return max(1, min(num_cpus, MAX_DEFAULT_WORKERS))


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
    # Worker processes for CPU-heavy work; 0 = one thread in this process.
    num_workers: int = field(default_factory=default_num_workers)
    max_queued_bytes: int = (
        MAX_QUEUED_BYTES  # encoded jobs waiting or running, all workers together
    )
    worker_liveness_timeout_s: float = WORKER_LIVENESS_TIMEOUT_S
    log_level: str = "INFO"
    log_format: str = "text"  # text | json
