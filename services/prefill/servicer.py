"""gRPC ``stageserve.v1.Prefill``: proto in -> domain types -> the leader -> proto out."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
from opentelemetry import propagate

from services.common import telemetry
from services.common.clients.prefill import PrefillResult, prefill_result_to_proto
from services.common.deadlines import deadline_mono
from services.common.errors import InvalidRequestError, UnavailableError
from services.common.grpc_errors import handle_errors
from services.common.kv_ref import KvRefInfo, kv_ref_from_proto
from services.common.pb.stageserve.v1 import prefill_pb2, prefill_pb2_grpc
from services.common.wire import image_span_from_proto, sampling_params_from_proto
from services.prefill import metrics
from services.prefill.image_store import ImageStore
from services.prefill.kv_refs import KvRefVerifier
from services.prefill.leader import PrefillLeader
from services.prefill.request import PrefillInput

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name
_tracer = telemetry.tracer("prefill")


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    """Answers UNAVAILABLE until ``attach`` hands it a started leader (model loaded).

    Every KvRef passes ``kv_refs.verify`` before the leader sees the request, so no
    connection or write happens for a KvRef decode did not issue for it. An image sent by
    hash alone comes from ``images`` (image_store.py); one it does not hold fails the call
    before the KvRef is verified, so the caller's resend with the bytes can still use it.
    """

    def __init__(
        self,
        default_timeout_s: float,
        kv_refs: KvRefVerifier,
        images: ImageStore,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.leader: PrefillLeader | None = None
        self.images = images
        self._default_timeout_s = default_timeout_s
        self._kv_refs = kv_refs
        self._clock = clock

    def attach(self, leader: PrefillLeader) -> None:
        self.leader = leader

    @handle_errors
    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        """Prefill one prompt, write its KV into ``kv_ref``'s pages; the first token and the
        proof."""
        with telemetry.rpc_span(
            _tracer,
            "prefill.request",
            context.invocation_metadata(),
            request_id=request.request_id,
            **{
                "gen_ai.usage.input_tokens": len(request.token_ids),
                "prefill.num_images": len({s.content_hash for s in request.image_spans}),
                "prefill.num_images_sent": len(request.images),
            },
        ) as span:  # queueing, the images' Encode, the forward and the KV write: all its children
            if self.leader is None:
                raise UnavailableError("prefill worker is still loading its model")
            kv_ref, prefill_input, images = self._to_domain(request, context)
            outcome = await self.leader.prefill(prefill_input, images)
            span.set_attribute("prefill.num_cached_image_tokens", outcome.num_cached_image_tokens)
            span.set_attribute("prefill.num_prefix_cached_tokens", outcome.num_prefix_cached_tokens)
        return prefill_result_to_proto(
            PrefillResult(
                first_token_id=outcome.first_token_id,
                num_kv_bytes=outcome.num_kv_bytes,
                kv_transfer_us=int(outcome.kv_transfer_s * 1e6),
                kv_written_proof=self._kv_refs.written_proof(
                    kv_ref
                ),  # the leader answered: KV landed
                num_cached_image_tokens=outcome.num_cached_image_tokens,
                num_prefix_cached_tokens=outcome.num_prefix_cached_tokens,
                num_prefix_cached_image_tokens=outcome.num_prefix_cached_image_tokens,
                finish_reason=outcome.finish_reason,
                first_logprob=outcome.first_logprob,
                prompt_logprobs=outcome.prompt_logprobs,
            )
        )

    def _to_domain(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> tuple[KvRefInfo, PrefillInput, dict[str, bytes]]:
        if not request.request_id:
            raise InvalidRequestError("request_id is empty", param="request_id")
        if not request.HasField("kv_ref"):
            raise InvalidRequestError("kv_ref is missing", param="kv_ref")
        kv_ref = kv_ref_from_proto(request.kv_ref)
        sent = {image.content_hash: image.data for image in request.images}
        images = self.images.resolve((s.content_hash for s in request.image_spans), sent)
        self._kv_refs.verify(kv_ref, request.request_id)
        self.images.put(sent)
        metrics.IMAGE_STORE_BYTES.set(self.images.num_bytes)
        carrier: dict[str, str] = {}
        propagate.inject(carrier)  # the current span: prefill.request
        prefill_input = PrefillInput(
            request_id=request.request_id,
            token_ids=tuple(request.token_ids),
            spans=tuple(image_span_from_proto(span) for span in request.image_spans),
            params=sampling_params_from_proto(request.sampling_params),
            kv_dst=kv_ref.to_destination(),
            kv_tp_dsts=kv_ref.to_destinations()[1:],
            # no write may start after decode let the KvRef's pages go
            deadline_mono=deadline_mono(
                request.deadline_unix_ms,
                context.time_remaining(),
                self._default_timeout_s,
                cap_unix_ms=kv_ref.expires_unix_ms,
                clock=self._clock,
            ),
            trace_carrier=carrier,
            prompt_embeds=request.prompt_embeds,
            embeds_dtype=request.prompt_embeds_dtype,
        )
        return kv_ref, prefill_input, images
