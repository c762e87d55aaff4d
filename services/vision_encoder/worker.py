"""Rank worker: owns the ViT, this rank's embedding cache and the transfer sender; executes plans.

``execute(batch, plan)`` for one rank: take the cached rows of the spans this rank owns
(LOCAL_HIT), decode and preprocess the images it must encode, run ONE ViT forward over
all of them, cache the new rows, then write each job's rows (every span, coalesced) into
each of its destinations with one batched transfer. A job's failure (bad image, grid
mismatch, transfer error) is recorded for that job only; the other jobs go on.
"""

from __future__ import annotations

import io
import time
from collections.abc import Sequence

import torch
from PIL import Image

from services.common.errors import InvalidRequestError, StageServeError
from services.engine import ops
from services.engine.model.qwen2_5_vl import Qwen2_5_VLModel
from services.engine.processing.image import ImageProcessor, ProcessedImage, decode_image
from services.transfer.embeddings import BaseEmbeddingSender, RowRun
from services.vision_encoder.cache import EmbeddingCacheManager
from services.vision_encoder.job import EncodeJob
from services.vision_encoder.plan import EncodePlan, Manifest, PlanError, SpanAction
from services.vision_encoder.scheduler import BatchResult, EncodeBatch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Located = tuple[EncodeJob, int]  # (job, span index)


class EncoderWorker:
    def __init__(
        self,
        model: Qwen2_5_VLModel,
        processor: ImageProcessor,
        cache: EmbeddingCacheManager,
        sender: BaseEmbeddingSender,
        max_image_bytes: int,
        rank: int = 0,
    ) -> None:
        assert model.visual is not None, "the encoder needs the vision tower"
        self.model = model
        self.processor = processor
        self.cache = cache
        self.sender = sender
        self.max_image_bytes = max_image_bytes
        self.rank = rank
        param = next(model.visual.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.hidden_size = model.config.vision.out_hidden_size
        self.merge_size = model.config.vision.spatial_merge_size

    def manifest(self, content_hashes: Sequence[str]) -> Manifest:
        """Which of ``content_hashes`` this rank's cache holds."""
        return Manifest(self.rank, tuple(content_hashes), tuple(self.cache.contains(h) for h in content_hashes))

    def execute(self, batch: EncodeBatch, plan: EncodePlan) -> BatchResult:
        located = [(job, i) for job in batch.jobs for i in range(len(job.spans))]  # parallel to plan.spans
        result = BatchResult()
        rows: dict[str, torch.Tensor] = {}  # content hash -> [length, hidden]
        self._take_hits(located, plan, rows, result.errors)
        self._encode_misses(located, plan, rows, result)
        for job in batch.jobs:
            if job.job_id in result.errors:
                continue
            try:
                result.num_bytes_sent += self._send(job, rows)
            except StageServeError as exc:
                result.errors[job.job_id] = exc
        return result

    def warmup(self) -> None:
        """One ViT forward on a small synthetic image (nothing cached, nothing sent)."""
        buf = io.BytesIO()
        Image.new("RGB", (56, 56), (127, 127, 127)).save(buf, format="PNG")
        processed = self._preprocess(buf.getvalue())
        self._vit([processed])

    def _take_hits(
        self, located: list[Located], plan: EncodePlan, rows: dict[str, torch.Tensor], errors: dict[int, BaseException]
    ) -> None:
        for (job, i), span_plan in zip(located, plan.spans, strict=True):
            if span_plan.owner_rank != self.rank or span_plan.action is not SpanAction.LOCAL_HIT:
                continue
            entry = self.cache.lookup_entry(span_plan.content_hash)
            if entry is None:  # nothing evicts between manifest and execute on this thread
                errors[job.job_id] = PlanError(f"planned cache hit {span_plan.content_hash[:16]}... is not cached")
                continue
            if entry.grid_thw != job.spans[i].span.grid_thw:
                errors[job.job_id] = _grid_mismatch(job, i, entry.grid_thw)
            rows[span_plan.content_hash] = entry.rows

    def _encode_misses(
        self, located: list[Located], plan: EncodePlan, rows: dict[str, torch.Tensor], result: BatchResult
    ) -> None:
        by_hash: dict[str, list[Located]] = {}
        for (job, i), span_plan in zip(located, plan.spans, strict=True):
            by_hash.setdefault(span_plan.content_hash, []).append((job, i))
        todo: list[tuple[str, ProcessedImage]] = []
        for content_hash in plan.encode_hashes(self.rank):
            users = by_hash[content_hash]
            first_job, first_i = users[0]
            try:
                processed = self._preprocess(first_job.spans[first_i].image_data)
            except InvalidRequestError as exc:
                for job, i in users:
                    result.errors[job.job_id] = InvalidRequestError(
                        f"spans[{i}].image_data: {exc.message}", param=f"spans[{i}].image_data"
                    )
                continue
            for job, i in users:
                if job.spans[i].span.grid_thw != processed.grid_thw:
                    result.errors[job.job_id] = _grid_mismatch(job, i, processed.grid_thw)
            todo.append((content_hash, processed))
        if not todo:
            return
        start = time.perf_counter()
        embeds = self._vit([p for _, p in todo])
        result.vit_s += time.perf_counter() - start
        result.num_vit_forwards += 1
        result.num_images_encoded += len(todo)
        for (content_hash, processed), chunk in zip(todo, embeds, strict=True):
            rows[content_hash] = chunk
            self.cache.insert(content_hash, chunk, processed.grid_thw)

    def _preprocess(self, data: bytes) -> ProcessedImage:
        return self.processor.preprocess(decode_image(data, self.max_image_bytes))

    @torch.inference_mode()
    def _vit(self, images: list[ProcessedImage]) -> list[torch.Tensor]:
        pixels = torch.cat([p.pixel_values for p in images]).to(self.device)
        grids = [p.grid_thw for p in images]
        with ops.on_device(self.device):  # on the engine thread, whose current device is GPU 0
            embeds = self.model.encode_images(pixels, grids)  # [sum of image tokens, hidden]
        return list(embeds.split([self.processor.num_image_tokens(g) for g in grids]))

    def _send(self, job: EncodeJob, rows_by_hash: dict[str, torch.Tensor]) -> int:
        if not job.spans:
            return 0
        parts = [rows_by_hash[s.span.content_hash] for s in job.spans]
        runs: list[RowRun] = []
        offset = 0
        for span, part in zip(job.spans, parts, strict=True):
            assert part.shape[0] == span.span.length
            runs.append((offset, span.dest_row, span.span.length))
            offset += span.span.length
        rows = torch.cat(parts)  # [job.num_rows, hidden]
        num_bytes = 0
        for dst in job.destinations:
            out = rows.to(_DTYPES[dst.dtype]).contiguous()
            num_bytes += self.sender.send_runs(job.request_id, out, runs, dst, job.deadline).num_bytes
        return num_bytes


def _grid_mismatch(job: EncodeJob, i: int, grid: tuple[int, int, int]) -> InvalidRequestError:
    t, h, w = job.spans[i].span.grid_thw
    return InvalidRequestError(
        f"spans[{i}] grid {t}x{h}x{w} does not match the image's grid {grid[0]}x{grid[1]}x{grid[2]}",
        param=f"spans[{i}].span",
    )
