"""What the encoder's leader and its ranks exchange: the rank init, one step's payload and result.

Each rank is a rank group of its own and gets its share of the batch only: the jobs with
a span it owns, those spans (with their plans) and each job's destinations. Image bytes
travel only for the images it encodes in this step; a planned cache hit carries none. Each
rank's result reports its jobs' errors, its counters and its manifest: what its cache holds of the step's images afterwards, what it evicted, and which
planned hits it did not hold (the leader's ledger was wrong; those jobs are planned again).
With ``--tp`` every process of the rank gets the same payload; TP rank 0's result is the
rank's, the others answer an empty one (``EncodeStepResult(rank)``).
"""

from __future__ import annotations

import enum

import msgspec

from services.common.destinations import EmbeddingDestination
from services.common.errors import ErrorRecord
from services.common.kv_transfer import TransferSpec


class SpanAction(enum.Enum):
    LOCAL_HIT = "local_hit"  # the owner's cache holds the rows: it sends them
    OWNER_ENCODE = "owner_encode"  # the owner runs the ViT (once per distinct image), caches, sends


class EncoderRankInit(msgspec.Struct, frozen=True):
    model: str  # checkpoint directory (the vision tower and preprocessor_config.json)
    dtype: str | None  # None: the checkpoint's
    cache_bytes: int  # this rank's embedding cache budget
    max_image_bytes: int
    transfer: TransferSpec  # how each rank builds its embedding sender
    pixel_method: str = "auto"  # pixels.PIXEL_METHODS: "auto" | "pil" | "torch"
    vit_cuda_graphs: int = 8  # ViT graphs a CUDA rank keeps (vision_graph.py); 0: eager
    rank: int = 0  # this rank among the encoder's W (each a rank group of --tp processes)
    num_ranks: int = 1  # W


class RankSpan(msgspec.Struct, frozen=True):
    index: int  # the span's index in its Encode call (errors name it: spans[index])
    content_hash: str
    grid_thw: tuple[int, int, int]
    length: int  # embedding rows
    dest_row: int  # first row in every destination window
    owner_rank: int
    action: SpanAction


class RankJob(msgspec.Struct, frozen=True):
    job_id: int
    request_id: str
    timeout_s: float  # the call's deadline, in seconds after the rank received the step
    spans: tuple[RankSpan, ...]  # every span of the call, prompt order
    destinations: tuple[EmbeddingDestination, ...]  # each gets every span's rows


class EncodeStepPayload(msgspec.Struct, frozen=True, tag="encode"):
    jobs: tuple[RankJob, ...]
    images: dict[str, bytes]  # content hash -> compressed bytes, for every OWNER_ENCODE image


class JobError(msgspec.Struct, frozen=True):
    """Why one job failed on this rank (its other jobs went on)."""

    job_id: int
    error: ErrorRecord


class RankManifest(msgspec.Struct, frozen=True):
    held: tuple[str, ...]  # the step's images this rank owns that its cache holds afterwards
    evicted: tuple[str, ...]  # images its cache evicted during the step
    missing: tuple[str, ...]  # planned LOCAL_HIT images its cache did not hold


class EncodeStepResult(msgspec.Struct, frozen=True):
    rank: int
    errors: tuple[JobError, ...] = ()
    manifest: RankManifest = RankManifest((), (), ())
    num_images_encoded: int = 0
    num_vit_forwards: int = 0
    preprocess_s: float = 0.0  # decoding and preparing the pixels of the step's encodes
    vit_s: float = 0.0  # the ViT forward
    num_bytes_sent: int = 0
    cache_bytes: int = 0  # after the step
    cache_entries: int = 0
