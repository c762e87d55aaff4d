"""Configuration of one tokenizer process, built once from the command line."""

from __future__ import annotations

import os
from dataclasses import dataclass

from services.common.service_main import ServiceConfig
from services.common.settings import at_least, flag, non_negative_int, positive, positive_int

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
class TokenizerConfig(ServiceConfig):
    """The tokenizer's flags; ``max_model_len`` None until ``__main__`` reads the checkpoint."""

    num_workers: int = flag(
        default_factory=default_num_workers,
        type=non_negative_int,
        help="worker processes for tokenization and image decoding (default: one per CPU, "
        "at most 4; 0: one thread in this process)",
    )
    max_queued_bytes: int = flag(
        MAX_QUEUED_BYTES,
        type=positive_int,
        help="encoded requests waiting for or held by the workers; past it a request is "
        "refused as overloaded (RESOURCE_EXHAUSTED)",
    )
    worker_liveness_timeout_s: float = flag(
        WORKER_LIVENESS_TIMEOUT_S,
        type=positive,
        help="a worker process that does not beat for this long (stopped, hung) is killed and "
        "the workers restarted; the jobs they held fail as unavailable",
    )
    max_model_len: int | None = flag(
        None,
        type=at_least(2),
        help="prompts must be shorter than this many tokens (default: config.json "
        "max_position_embeddings)",
    )
    max_image_bytes: int = flag(MAX_IMAGE_BYTES, type=positive_int, help="largest compressed image")
    max_image_pixels: int = flag(
        MAX_IMAGE_PIXELS, type=positive_int, help="largest decoded image (w*h)"
    )

    @property
    def limits(self) -> Limits:
        assert self.max_model_len is not None, "resolved from the checkpoint by __main__"
        return Limits(self.max_model_len, self.max_image_bytes, self.max_image_pixels)
