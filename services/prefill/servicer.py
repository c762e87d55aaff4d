"""gRPC ``stageserve.v1.Prefill``: proto in -> domain types -> the leader -> proto out."""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
from opentelemetry import propagate

from services.common import telemetry
from services.common.clients.decode import kv_ref_from_proto, sampling_params_from_proto
from services.common.clients.prefill import PrefillResult, prefill_result_to_proto, span_from_proto
from services.common.errors import InvalidRequestError, UnavailableError
from services.common.grpc_errors import handle_errors
from services.common.pb.stageserve.v1 import prefill_pb2, prefill_pb2_grpc
from services.prefill.leader import PrefillLeader
from services.prefill.request import PrefillInput

SERVICE_NAME = prefill_pb2.DESCRIPTOR.services_by_name["Prefill"].full_name


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    """Answers UNAVAILABLE until ``attach`` hands it a started leader (model loaded)."""

    def __init__(self, default_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.leader: PrefillLeader | None = None
        self._default_timeout_s = default_timeout_s
        self._clock = clock

    def attach(self, leader: PrefillLeader) -> None:
        self.leader = leader

    @handle_errors
    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        """Prefill one prompt, write its KV into ``kv_ref``'s pages, return the first token."""
        if self.leader is None:
            raise UnavailableError("prefill worker is still loading its model")
        prefill_input, images = self._to_domain(request, context)
        outcome = await self.leader.prefill(prefill_input, images)
        return prefill_result_to_proto(
            PrefillResult(
                first_token_id=outcome.first_token_id,
                num_kv_bytes=outcome.num_kv_bytes,
                kv_transfer_us=int(outcome.kv_transfer_s * 1e6),
                num_cached_image_tokens=outcome.num_cached_image_tokens,
                finish_reason=outcome.finish_reason,
            )
        )

    def _to_domain(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> tuple[PrefillInput, dict[str, bytes]]:
        if not request.request_id:
            raise InvalidRequestError("request_id is empty", param="request_id")
        if not request.HasField("kv_ref"):
            raise InvalidRequestError("kv_ref is missing", param="kv_ref")
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=telemetry.extract_context(context.invocation_metadata()))
        prefill_input = PrefillInput(
            request_id=request.request_id,
            token_ids=tuple(request.token_ids),
            spans=tuple(span_from_proto(span) for span in request.image_spans),
            params=sampling_params_from_proto(request.sampling_params),
            kv_dst=kv_ref_from_proto(request.kv_ref).to_destination(request.request_id),
            deadline=self._deadline(request.deadline_unix_ms, context.time_remaining()),
            trace_carrier=carrier,
        )
        return prefill_input, {image.content_hash: image.data for image in request.images}

    def _deadline(self, deadline_unix_ms: int, grpc_remaining_s: float | None) -> float:
        """The request's deadline on the monotonic clock: the earlier of its own and the RPC's."""
        remaining = [] if grpc_remaining_s is None else [grpc_remaining_s]
        if deadline_unix_ms > 0:
            remaining.append(deadline_unix_ms / 1000 - time.time())
        return self._clock() + (min(remaining) if remaining else self._default_timeout_s)
