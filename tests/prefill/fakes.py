"""The prefill tests' fakes: decode's registered KV pool and a vision encoder over gRPC."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch

from services.common import signing
from services.common.clients.vision_encoder import (
    SpanResult,
    SpanStatus,
    embedding_destination_from_proto,
    encode_span_from_proto,
    span_result_to_proto,
)
from services.common.errors import UnavailableError
from services.common.grpc_errors import handle_errors
from services.common.kv_ref import KvRefInfo, issue_kv_ref
from services.common.pb.stageserve.v1 import vision_encoder_pb2, vision_encoder_pb2_grpc
from services.engine.processing import decode_image
from services.transfer.embeddings_shm import ShmEmbeddingSender
from tests.prefill import cp_ranks

KEY = signing.key_of("prefill-test-token")  # the internal secret the fake decode signs with


# --- the fake decode pool -------------------------------------------------------------


class DecodePool(cp_ranks.DecodePool):
    """Decode's registered KV pool (shm): pages handed out shuffled and zeroed, so position
    order matters and a page nobody wrote reads as zeros."""

    def __init__(self, model_config, num_pages: int = 512) -> None:
        super().__init__(model_config, num_pages)

    def reserve(self, request_id: str, num_tokens: int, extra_pages: int = 2):
        return super().reserve(request_id, num_tokens, extra_pages)

    @staticmethod
    def kv_ref(dst, expires_in_s: float = 60.0, key: bytes = KEY) -> KvRefInfo:
        """The KvRef decode issues for ``dst``: signed, with a fresh nonce."""
        expires_unix_ms = int((time.time() + expires_in_s) * 1000)
        return issue_kv_ref(dst, key, signing.new_nonce(), expires_unix_ms)

    def is_written(self, dst) -> bool:
        """Whether any byte of ``dst``'s pages changed since ``reserve`` zeroed them."""
        pages = list(dst.page_ids)
        return bool(self.pool.k_buffer[:, pages].any() or self.pool.v_buffer[:, pages].any())


# --- the fake vision encoder ------------------------------------------------------------


class FakeVisionEncoder(vision_encoder_pb2_grpc.VisionEncoderServicer):
    """Encodes every span with the real ViT (no cache: a span sent without bytes needs them),
    writes rows to every destination over shm; ``mode`` injects faults."""

    def __init__(self, pipeline) -> None:
        self.pipeline = pipeline
        self.sender = ShmEmbeddingSender()
        self.mode = "ok"  # ok | unavailable | invalid | slow
        self.delay_s = 0.0
        self.num_calls = 0
        self.num_destinations: list[int] = []

    @handle_errors
    async def Encode(self, request: Any, context: Any) -> vision_encoder_pb2.EncodeResponse:
        self.num_calls += 1
        if self.mode == "unavailable":
            raise UnavailableError("fake encoder: ViT rank is down")
        if self.mode == "slow":
            await asyncio.sleep(self.delay_s)
        spans = [encode_span_from_proto(s) for s in request.spans]
        destinations = [embedding_destination_from_proto(ref) for ref in request.embedding_refs]
        self.num_destinations.append(len(destinations))
        results = []
        for span in spans:
            if self.mode == "invalid":
                results.append(
                    SpanResult(
                        span.span.content_hash, SpanStatus.INVALID_IMAGE, False, 0, "not an image"
                    )
                )
                continue
            if not span.image_data:  # no cache here: every image needs its bytes
                results.append(
                    SpanResult(span.span.content_hash, SpanStatus.NEEDS_IMAGE_DATA, False)
                )
                continue
            rows = self._encode(span.image_data)
            for dst in destinations:
                self.sender.send_rows(
                    request.request_id, rows, dst, span.dest_row, time.monotonic() + 10
                )
            results.append(
                SpanResult(span.span.content_hash, SpanStatus.WRITTEN, is_cache_hit=False)
            )
        return vision_encoder_pb2.EncodeResponse(results=[span_result_to_proto(r) for r in results])

    def _encode(self, data: bytes) -> torch.Tensor:
        processed = self.pipeline.images.preprocess(decode_image(data, 20 * 1024 * 1024))
        rows = self.pipeline.engine.runner.encode_images(
            processed.pixel_values, [processed.grid_thw]
        )
        return rows.contiguous()  # [n, hidden] fp32
