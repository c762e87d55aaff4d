"""One encoder rank's share of a step: its cache hits, its encodes (one ViT call), its sends.

``EncoderWorker.execute(payload, received_mono)`` works on the spans this rank owns: it
takes the cached rows of its LOCAL_HIT spans (one that is not cached goes into the
manifest as missing, and this rank sends nothing for its job: the leader plans the job
again), decodes the images it must encode (on up to ``DECODE_THREADS`` threads, which
libjpeg-turbo and PIL use without the GIL: one image per thread, or a step's one JPEG by
bands of rows on all of them, ``jpeg_rows``), turns them into pixels and runs ONE ViT
forward over all of them, caches the new rows, then writes each job's owned rows into
each of the job's destinations with one batched transfer. A job's failure (bad image,
grid mismatch, transfer error) is reported for that job only; the other jobs go on.
Anything else it raises fails this rank's step: the calls with a span on this rank.

A TP follower (a process of a ``--tp`` rank other than its TP rank 0: no cache, no sender)
runs only the step's encodes, the same ViT forward over the same images as TP rank 0 (which
images a step encodes follows from its payload alone), and answers an empty result.
"""

from __future__ import annotations

import io
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
from PIL import Image

from services.common.errors import ErrorRecord, InvalidRequestError, StageServeError
from services.engine import ops
from services.engine.model.qwen2_5_vl import Qwen2_5_VLModel
from services.engine.processing.image import ImageProcessor
from services.engine.processing.image_file import decode_pixels
from services.engine.processing.jpeg_rows import BandDecoder, load_band_decoder
from services.engine.vision_graph import VisionGraphs
from services.transfer.embeddings import BaseEmbeddingSender, RowRun
from services.vision_encoder.cache import EmbeddingCacheManager
from services.vision_encoder.pixels import prepare_pixels, resolve_method
from services.vision_encoder.rank_messages import (
    EncodeStepPayload,
    EncodeStepResult,
    JobError,
    RankJob,
    RankManifest,
    RankSpan,
    SpanAction,
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Owned = tuple[RankJob, RankSpan]
WARMUP_SIZES = ((56, 56), (448, 336))  # (width, height): a batch of two, as calls come
DECODE_THREADS = 4  # a step's distinct images decode in parallel, up to this many at once


@dataclass
class _Step:
    rows: dict[str, torch.Tensor] = field(default_factory=dict)  # hash -> [length, row width]
    errors: dict[int, JobError] = field(default_factory=dict)  # job_id -> its first error
    missing: dict[str, None] = field(default_factory=dict)  # planned hits not cached
    skipped: set[int] = field(default_factory=set)  # jobs with a missing hit: replanned
    num_encoded: int = 0
    num_forwards: int = 0
    preprocess_s: float = 0.0
    vit_s: float = 0.0

    def fail(self, job: RankJob, exc: StageServeError) -> None:
        if job.job_id not in self.errors:
            error = JobError(job.job_id, ErrorRecord.of(exc))
            self.errors[job.job_id] = error


class EncoderWorker:
    def __init__(
        self,
        rank: int,
        model: Qwen2_5_VLModel,
        processor: ImageProcessor,
        cache: EmbeddingCacheManager | None,  # None, as the sender: a TP follower
        sender: BaseEmbeddingSender | None,
        max_image_bytes: int,
        pixel_method: str = "auto",  # pixels.PIXEL_METHODS
        vit_cuda_graphs: int = 0,  # layouts whose ViT graph a CUDA rank keeps; 0: eager
    ) -> None:
        assert model.visual is not None, "the encoder needs the vision tower"
        assert (cache is None) == (sender is None), "a follower has neither"
        self.rank = rank
        self.model = model
        self.processor = processor
        self.cache = cache
        self.sender = sender
        self.max_image_bytes = max_image_bytes
        self.device = next(model.visual.parameters()).device
        self.pixel_method = resolve_method(pixel_method, self.device)
        self.vit_graphs = (
            VisionGraphs(model.visual, vit_cuda_graphs)
            if vit_cuda_graphs and self.device.type == "cuda"
            else None
        )
        num_threads = min(DECODE_THREADS, os.cpu_count() or 1)
        self._decoders = ThreadPoolExecutor(num_threads, thread_name_prefix=f"decode-{rank}")
        self._bands = load_band_decoder(self._decoders, num_threads)  # None: one thread per JPEG

    def execute(self, payload: EncodeStepPayload, received_mono: float) -> EncodeStepResult:
        owned = [(j, s) for j in payload.jobs for s in j.spans if s.owner_rank == self.rank]
        step = _Step()
        if self.cache is None:  # a TP follower: the forward, for its shards' collectives
            self._encode(owned, payload.images, step)
            return EncodeStepResult(rank=self.rank)
        self._take_hits(owned, step)
        self._encode(owned, payload.images, step)
        num_bytes = 0
        for job in payload.jobs:
            if job.job_id in step.errors or job.job_id in step.skipped:
                continue
            try:
                num_bytes += self._send(job, step.rows, received_mono + job.timeout_s)
            except StageServeError as exc:
                step.fail(job, exc)
        held = dict.fromkeys(
            s.content_hash for _, s in owned if self.cache.contains(s.content_hash)
        )
        manifest = RankManifest(tuple(held), tuple(self.cache.take_evicted()), tuple(step.missing))
        return EncodeStepResult(
            rank=self.rank,
            errors=tuple(step.errors.values()),
            manifest=manifest,
            num_images_encoded=step.num_encoded,
            num_vit_forwards=step.num_forwards,
            preprocess_s=step.preprocess_s,
            vit_s=step.vit_s,
            num_bytes_sent=num_bytes,
            cache_bytes=self.cache.num_bytes,
            cache_entries=self.cache.num_entries,
        )

    def warmup(self) -> None:
        """A ViT forward over two synthetic images of different sizes (nothing cached or sent);
        with ViT graphs, twice more: the second captures their graph, the third replays it."""
        images = []
        for size in WARMUP_SIZES:
            buf = io.BytesIO()
            Image.new("RGB", size, (127, 127, 127)).save(buf, format="PNG")
            images.append(decode_pixels(buf.getvalue(), self.max_image_bytes))
        grids = [self.processor.grid_for_size(*image.shape[:2]) for image in images]
        for _ in range(3 if self.vit_graphs is not None else 1):
            self._vit(self._pixels(images), grids)

    def _take_hits(self, owned: list[Owned], step: _Step) -> None:
        assert self.cache is not None
        for job, span in owned:
            if span.action is not SpanAction.LOCAL_HIT:
                continue
            entry = self.cache.lookup_entry(span.content_hash)
            if entry is None:  # the ledger is wrong (an eviction it missed, a restarted rank)
                step.missing[span.content_hash] = None
                step.skipped.add(job.job_id)
                continue
            if entry.grid_thw != span.grid_thw:
                step.fail(job, _grid_mismatch(span, entry.grid_thw))
            step.rows[span.content_hash] = entry.rows

    def _encode(self, owned: list[Owned], images: dict[str, bytes], step: _Step) -> None:
        users: dict[str, list[Owned]] = {}
        for job, span in owned:
            if span.action is SpanAction.OWNER_ENCODE:
                users.setdefault(span.content_hash, []).append((job, span))
        start = time.perf_counter()
        decoded: dict[str, np.ndarray] = {}
        grids: list[tuple[int, int, int]] = []
        outcomes = self._decode([images[h] for h in users])  # first appearance order
        for (content_hash, spans), image in zip(users.items(), outcomes, strict=True):
            if isinstance(image, InvalidRequestError):
                for job, span in spans:
                    step.fail(job, _bad_image(span, image))
                continue
            grid = self.processor.grid_for_size(*image.shape[:2])
            for job, span in spans:
                if span.grid_thw != grid:
                    step.fail(job, _grid_mismatch(span, grid))
            decoded[content_hash] = image
            grids.append(grid)
        if not decoded:
            return
        pixels = self._pixels(list(decoded.values()))
        vit_start = time.perf_counter()
        embeds = self._vit(pixels, grids)
        step.preprocess_s += vit_start - start
        step.vit_s += time.perf_counter() - vit_start
        step.num_forwards += 1
        step.num_encoded += len(decoded)
        for content_hash, grid, rows in zip(decoded, grids, embeds, strict=True):
            step.rows[content_hash] = rows
            if self.cache is not None:
                self.cache.insert(content_hash, rows, grid)

    def _decode(self, datas: list[bytes]) -> list[np.ndarray | InvalidRequestError]:
        """Each image's [H, W, 3] uint8 pixels, or why its bytes are not an image."""

        def decode(
            data: bytes, bands: BandDecoder | None = None
        ) -> np.ndarray | InvalidRequestError:
            try:
                return decode_pixels(data, self.max_image_bytes, bands=bands)
            except InvalidRequestError as exc:
                return exc

        if len(datas) == 1:  # on this thread, its bands (if any) on the pool's
            return [decode(datas[0], self._bands)]
        return list(self._decoders.map(decode, datas))

    @torch.inference_mode()
    def _pixels(self, images: list[np.ndarray]) -> torch.Tensor:
        pixels = prepare_pixels(self.processor, images, self.device, self.pixel_method)
        if self.device.type == "cuda":  # preprocess_s counts the device work, not its launch
            torch.cuda.synchronize(self.device)
        return pixels

    @torch.inference_mode()
    def _vit(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        with ops.on_device(self.device):
            if self.vit_graphs is not None:
                embeds = self.vit_graphs.forward(pixels, grids)
            else:
                embeds = self.model.encode_images(pixels, grids)  # [image tokens, row width]
            if self.device.type == "cuda":  # the ViT's time, not its launch (the sends wait anyway)
                torch.cuda.synchronize(self.device)
        return list(embeds.split([self.processor.num_image_tokens(g) for g in grids]))

    def _send(
        self, job: RankJob, rows_by_hash: dict[str, torch.Tensor], deadline_mono: float
    ) -> int:
        """Write this rank's spans of ``job`` into every destination; bytes written."""
        mine = [s for s in job.spans if s.owner_rank == self.rank]
        if not mine or not job.destinations:  # a cache_only job: its rows are cached already
            return 0
        parts = [rows_by_hash[s.content_hash] for s in mine]
        runs: list[RowRun] = []
        offset = 0
        for span, part in zip(mine, parts, strict=True):
            assert part.shape[0] == span.length
            runs.append((offset, span.dest_row, span.length))
            offset += span.length
        rows = torch.cat(parts)  # [rows of this rank's spans, row width]
        num_bytes = 0
        for dst in job.destinations:
            out = rows.to(_DTYPES[dst.dtype]).contiguous()
            result = self.sender.send_runs(job.request_id, out, runs, dst, deadline_mono)
            num_bytes += result.num_bytes
        return num_bytes


def _grid_mismatch(span: RankSpan, grid: tuple[int, int, int]) -> InvalidRequestError:
    t, h, w = span.grid_thw
    return InvalidRequestError(
        f"spans[{span.index}] grid {t}x{h}x{w} does not match the image's grid "
        f"{grid[0]}x{grid[1]}x{grid[2]}",
        param=f"spans[{span.index}].span",
    )


def _bad_image(span: RankSpan, exc: InvalidRequestError) -> InvalidRequestError:
    param = f"spans[{span.index}].image_data"
    return InvalidRequestError(f"{param}: {exc.message}", param=param)
