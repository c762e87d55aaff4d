"""Typed client of the prefill service, and the protobuf <-> domain conversions it shares with it.

The ``common.proto`` conversions (KvRef, SamplingParams, ImageSpan, FinishReason) are
``services.common.wire``'s.

``PrefillClient(address).prefill(...)`` runs one prompt on a prefill worker: the worker
encodes the prompt's images (through the vision encoder), runs the forward pass, writes
the prompt's KV into the decode pages described by ``kv_ref`` and returns the first token.
"""

from __future__ import annotations

import time

import grpc
import msgspec

from services.common import telemetry
from services.common.auth import Credentials
from services.common.client import create_channel
from services.common.clients.sent_hashes import REMEMBERED_IMAGES, SentHashes
from services.common.errors import DeadlineExceededError, ImageDataNeededError
from services.common.grpc_errors import error_from_rpc
from services.common.kv_ref import KvRefInfo, kv_ref_to_proto
from services.common.pb.stageserve.v1 import prefill_pb2, prefill_pb2_grpc
from services.common.server import REQUEST_ID_KEY
from services.common.types import FinishReason, SamplingParams, TokenizedPrompt, TokenLogprob
from services.common.wire import (
    finish_reason_from_proto,
    finish_reason_to_proto,
    image_span_to_proto,
    sampling_params_to_proto,
    token_logprob_from_proto,
    token_logprob_to_proto,
)


class PrefillResult(msgspec.Struct, frozen=True):
    """Outcome of one prefill; the prompt's KV is fully written into decode's pages."""

    first_token_id: int
    num_kv_bytes: int
    kv_transfer_us: int
    kv_written_proof: bytes  # hand to DecodeClient.generate: decode starts the request only with it
    num_cached_image_tokens: int = 0
    num_prefix_cached_tokens: int = 0  # leading prompt tokens whose KV the prefix cache held
    num_prefix_cached_image_tokens: int = 0  # the image tokens among them
    # Set when the first token already ends the request (EOS / stop token,
    # max_new_tokens == 1, context limit): the router aborts decode's reservation.
    finish_reason: FinishReason | None = None
    first_logprob: TokenLogprob | None = None  # set when the request asked (return_logprobs)
    # prompt tokens 1..n-1's logprobs when the request asked (num_prompt_logprobs >= 0)
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


class PrefillClient:
    """Client of one prefill worker at ``address`` ("host:port").

    It sends an image's bytes only until a call with them succeeded; later calls name the
    image by its hash and the worker takes the bytes from its image store. When the worker no
    longer holds one (evicted, restarted) it answers ``ImageDataNeededError`` before doing
    anything (the KvRef still unused), and the call goes again once with every image's bytes.
    """

    def __init__(
        self,
        address: str,
        *,
        auth: Credentials | None = None,
        remembered_images: int = REMEMBERED_IMAGES,
    ) -> None:
        """``auth``: the internal token sent on every call (None: none)."""
        self.address = address
        self._channel = create_channel(address, auth=auth)
        self._stub = prefill_pb2_grpc.PrefillStub(self._channel)
        self._sent = SentHashes(remembered_images)  # hashes whose bytes this worker got

    async def prefill(
        self,
        request_id: str,
        prompt: TokenizedPrompt,
        params: SamplingParams,
        kv_ref: KvRefInfo,
        deadline_unix_s: float,
    ) -> PrefillResult:
        """Prefill ``prompt`` and write its KV into ``kv_ref``'s pages, by ``deadline_unix_s``.

        ``kv_ref`` is what ``DecodeClient.reserve`` returned, signed by decode; prefill
        accepts it once, for ``request_id``, until it expires.

        ``deadline_unix_s`` is absolute: seconds since the Unix epoch (``time.time()`` clock).
        Raises the ``StageServeError`` the worker answered with (``InvalidRequestError``,
        ``CapacityError``, ``UnavailableError``, ``DeadlineExceededError``, ...).
        """
        held = frozenset(h for h in prompt.images if h in self._sent)
        try:
            response = await self._prefill(
                prefill_request_to_proto(request_id, prompt, params, kv_ref, deadline_unix_s, held),
                request_id,
                deadline_unix_s,
            )
        except ImageDataNeededError:
            if not held:
                raise
            self._sent.forget(held)
            response = await self._prefill(
                prefill_request_to_proto(request_id, prompt, params, kv_ref, deadline_unix_s),
                request_id,
                deadline_unix_s,
            )
        self._sent.remember(prompt.images)
        return prefill_result_from_proto(response)

    async def _prefill(
        self, request: prefill_pb2.PrefillRequest, request_id: str, deadline_unix_s: float
    ) -> prefill_pb2.PrefillResponse:
        timeout_s = deadline_unix_s - time.time()
        if timeout_s <= 0:
            raise DeadlineExceededError(
                f"prefill of {request_id} not sent: its deadline has passed"
            )
        metadata = telemetry.inject_metadata([(REQUEST_ID_KEY, request_id)])
        try:
            return await self._stub.Prefill(request, timeout=timeout_s, metadata=metadata)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, service="prefill") from exc

    async def close(self) -> None:
        await self._channel.close()


# --- conversions (also used by the prefill servicer) ---------------------------------


def prefill_request_to_proto(
    request_id: str,
    prompt: TokenizedPrompt,
    params: SamplingParams,
    kv_ref: KvRefInfo,
    deadline_unix_s: float,
    held: frozenset[str] = frozenset(),  # images the worker holds: sent by hash alone
) -> prefill_pb2.PrefillRequest:
    request = prefill_pb2.PrefillRequest(
        request_id=request_id,
        token_ids=prompt.token_ids,
        image_spans=[image_span_to_proto(span) for span in prompt.spans],
        sampling_params=sampling_params_to_proto(params),
        kv_ref=kv_ref_to_proto(kv_ref),
        deadline_unix_ms=int(deadline_unix_s * 1000),
        prompt_embeds=prompt.prompt_embeds,
        prompt_embeds_dtype=prompt.prompt_embeds_dtype,
    )
    for content_hash, data in prompt.images.items():  # add(): the bytes are copied once
        if content_hash not in held:
            request.images.add(content_hash=content_hash, data=data)
    return request


def prefill_result_to_proto(result: PrefillResult) -> prefill_pb2.PrefillResponse:
    response = prefill_pb2.PrefillResponse(
        first_token_id=result.first_token_id,
        finish_reason=finish_reason_to_proto(result.finish_reason),
        num_kv_bytes=result.num_kv_bytes,
        kv_transfer_us=result.kv_transfer_us,
        num_cached_image_tokens=result.num_cached_image_tokens,
        num_prefix_cached_tokens=result.num_prefix_cached_tokens,
        num_prefix_cached_image_tokens=result.num_prefix_cached_image_tokens,
        kv_written_proof=result.kv_written_proof,
    )
    if result.first_logprob is not None:
        response.first_logprob.CopyFrom(token_logprob_to_proto(result.first_logprob))
    response.prompt_logprobs.extend(token_logprob_to_proto(p) for p in result.prompt_logprobs)
    return response


def prefill_result_from_proto(response: prefill_pb2.PrefillResponse) -> PrefillResult:
    return PrefillResult(
        first_token_id=response.first_token_id,
        num_kv_bytes=response.num_kv_bytes,
        kv_transfer_us=response.kv_transfer_us,
        kv_written_proof=response.kv_written_proof,
        num_cached_image_tokens=response.num_cached_image_tokens,
        num_prefix_cached_tokens=response.num_prefix_cached_tokens,
        num_prefix_cached_image_tokens=response.num_prefix_cached_image_tokens,
        finish_reason=finish_reason_from_proto(response.finish_reason),
        first_logprob=(
            token_logprob_from_proto(response.first_logprob)
            if response.HasField("first_logprob")
            else None
        ),
        prompt_logprobs=tuple(token_logprob_from_proto(p) for p in response.prompt_logprobs),
    )
