"""gRPC surface of the vision encoder: proto in -> EncodeJob -> leader -> proto out."""

from __future__ import annotations

import asyncio

import grpc

from services.common import telemetry
from services.common.clients.vision_encoder import (
    embedding_destination_from_proto,
    encode_span_from_proto,
    span_result_to_proto,
)
from services.common.deadlines import deadline_mono
from services.common.grpc_errors import handle_errors
from services.common.pb.stageserve.v1 import vision_encoder_pb2, vision_encoder_pb2_grpc
from services.vision_encoder.job import EncodeJob, JobLimits, validate_job
from services.vision_encoder.leader import EncoderLeader

_tracer = telemetry.tracer("vision_encoder")


class VisionEncoderServicer(vision_encoder_pb2_grpc.VisionEncoderServicer):
    def __init__(self, leader: EncoderLeader, limits: JobLimits, default_timeout_s: float) -> None:
        self._leader = leader
        self._limits = limits
        self._default_timeout_s = default_timeout_s

    @handle_errors
    async def Encode(
        self, request: vision_encoder_pb2.EncodeRequest, context: grpc.aio.ServicerContext
    ) -> vision_encoder_pb2.EncodeResponse:
        """Write every span's rows into every ``embedding_refs`` buffer; one result per span."""
        parent = telemetry.extract_context(context.invocation_metadata())
        name = "vision_encoder.cache" if request.cache_only else "vision_encoder.encode"
        with _tracer.start_as_current_span(name, context=parent) as span:
            span.set_attribute("request_id", request.request_id)
            span.set_attribute("num_spans", len(request.spans))
            span.set_attribute("cache_only", request.cache_only)
            job = self._job_from_proto(request, context)
            if any(s.image_data for s in job.spans):  # hashing megabytes: off the event loop
                await asyncio.to_thread(validate_job, job, self._limits)
            else:  # spans by hash alone: checks of a few fields, no thread hop
                validate_job(job, self._limits)
            results = await self._leader.encode(job)
            span.set_attribute("num_cache_hits", sum(r.is_cache_hit for r in results))
        return vision_encoder_pb2.EncodeResponse(results=[span_result_to_proto(r) for r in results])

    def _job_from_proto(
        self, request: vision_encoder_pb2.EncodeRequest, context: grpc.aio.ServicerContext
    ) -> EncodeJob:
        return EncodeJob(
            job_id=self._leader.next_job_id(),
            request_id=request.request_id,
            spans=tuple(encode_span_from_proto(s) for s in request.spans),
            destinations=tuple(embedding_destination_from_proto(r) for r in request.embedding_refs),
            deadline_mono=deadline_mono(
                request.deadline_unix_ms, context.time_remaining(), self._default_timeout_s
            ),
            cache_only=request.cache_only,
        )
