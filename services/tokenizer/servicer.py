"""gRPC face of the tokenizer: proto in, domain types inside, proto out."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from services.common import telemetry
from services.common.errors import InvalidRequestError, StageServeError
from services.common.grpc_errors import handle_errors
from services.common.malloc import MemoryReleaser
from services.common.pb.stageserve.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from services.common.types import ChatMessage as DomainChatMessage
from services.common.types import ContentPart, ImagePart, TextPart, TokenizedPrompt
from services.engine.processing.chat import template_kwargs_from_json
from services.tokenizer.config import Limits
from services.tokenizer.metrics import TokenizerMetrics
from services.tokenizer.pipeline import header_from_input
from services.tokenizer.workers import ChatJob, PromptJob, WorkerPool

SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name
_tracer = telemetry.tracer("tokenizer")


def _part_from_proto(part: common_pb2.ContentPart, param: str, limits: Limits) -> ContentPart:
    kind = part.WhichOneof("part")
    if kind == "text":
        return TextPart(part.text)
    if kind == "image_header":
        h = part.image_header
        return header_from_input(h.content_hash, h.height, h.width, h.num_bytes, limits)
    if kind != "image":
        raise InvalidRequestError(f"{param} is empty: set text, image or image_header", param=param)
    if part.image.WhichOneof("source") == "url":
        raise InvalidRequestError(
            "the tokenizer takes image bytes, not URLs (the router fetches them)",
            param=f"{param}.image.url",
        )
    return ImagePart(part.image.data)  # empty data: decode_image rejects it


def job_from_proto(request: tokenizer_pb2.TokenizeRequest, limits: Limits) -> ChatJob | PromptJob:
    kind = request.WhichOneof("input")
    if kind == "prompt":
        for name in ("continue_final_message", "chat_template_kwargs"):
            if getattr(request, name):
                raise InvalidRequestError(f"{name} applies to a chat, not to a prompt", param=name)
        return PromptJob(request.prompt)
    if kind != "chat":
        raise InvalidRequestError("the request has no input: set chat or prompt", param="messages")
    template_kwargs = template_kwargs_from_json(request.chat_template_kwargs)
    messages = tuple(
        _message_from_proto(message, f"messages[{i}]", limits)
        for i, message in enumerate(request.chat.messages)
    )
    return ChatJob(
        messages,
        request.add_generation_prompt,
        request.continue_final_message,
        template_kwargs,
    )


def _message_from_proto(
    message: common_pb2.ChatMessage, param: str, limits: Limits
) -> DomainChatMessage:
    for name in ("tool_calls", "tool_call_id"):
        if getattr(message, name):
            raise InvalidRequestError(
                f"the tokenizer takes no {name}: the router writes tool turns into the text",
                param=f"{param}.{name}",
            )
    return DomainChatMessage(
        role=message.role,
        content=tuple(
            _part_from_proto(part, f"{param}.content[{j}]", limits)
            for j, part in enumerate(message.content)
        ),
    )


def prompt_to_proto(prompt: TokenizedPrompt) -> tokenizer_pb2.TokenizeResponse:
    return tokenizer_pb2.TokenizeResponse(
        token_ids=prompt.token_ids,
        image_spans=[
            common_pb2.ImageSpan(
                offset=s.offset,
                length=s.length,
                content_hash=s.content_hash,
                grid_t=s.grid_thw[0],
                grid_h=s.grid_thw[1],
                grid_w=s.grid_thw[2],
            )
            for s in prompt.spans
        ],
        mrope_position_delta=prompt.mrope_position_delta,
    )


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    """Tokenize runs on the worker pool."""

    def __init__(self, pool: WorkerPool, metrics: TokenizerMetrics) -> None:
        self._pool = pool
        self._metrics = metrics
        self._releaser = MemoryReleaser()

    @handle_errors
    async def Tokenize(
        self, request: tokenizer_pb2.TokenizeRequest, context: Any
    ) -> tokenizer_pb2.TokenizeResponse:
        """Chat or prompt -> token ids, image spans, distinct images, M-RoPE delta."""
        parent = telemetry.extract_context(context.invocation_metadata())
        start, outcome = time.perf_counter(), "INTERNAL"
        with _tracer.start_as_current_span("tokenizer.tokenize", context=parent) as span:
            span.set_attribute("request_id", request.request_id)
            try:
                prompt = await self._pool.run(job_from_proto(request, self._pool.limits))
                outcome = "OK"
            except StageServeError as exc:
                outcome = exc.grpc_code
                raise
            except asyncio.CancelledError:
                outcome = "CANCELLED"
                raise
            finally:
                self._metrics.requests.labels("Tokenize", outcome).inc()
                self._metrics.tokenize_latency.observe(time.perf_counter() - start)
                self._releaser.request_done(request.ByteSize())
            span.set_attribute("num_prompt_tokens", len(prompt.token_ids))
            span.set_attribute("num_images", len(prompt.spans))
        self._record_prompt(prompt)
        return prompt_to_proto(prompt)

    def _record_prompt(self, prompt: TokenizedPrompt) -> None:
        self._metrics.prompt_tokens.inc(len(prompt.token_ids))
        self._metrics.prompt_len.observe(len(prompt.token_ids))
        self._metrics.images_decoded.inc(len(prompt.images))
        self._metrics.image_bytes.inc(sum(len(data) for data in prompt.images.values()))
