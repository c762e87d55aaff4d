"""gRPC ``stageserve.v1.Router``: proto in, the shared generation pipeline, proto out.

The router names every request itself (``gen-<uuid>``). A client's ``request_id`` is a
label: echoed in its responses and recorded on the request's span, never used inside,
so two calls with one label are two requests and neither can abort the other.

Fields follow the HTTP API's rules: nothing is ignored. A field this server's protos do
not define (a newer client's) is INVALID_ARGUMENT naming its number; an explicit
``sampling_params.max_new_tokens`` above what the context leaves is INVALID_ARGUMENT
(unset, it is the documented 16, fitted to the context). An image given by URL
(``ImageInput.url``) is loaded by the HTTP API's ``ImageLoader``, with its guards and limits.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet
from opentelemetry import trace

from services.common import telemetry
from services.common.errors import InvalidRequestError, NotFoundError, StageServeError
from services.common.grpc_errors import handle_errors
from services.common.malloc import MemoryReleaser
from services.common.pb.stageserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.common.types import ChatMessage, ContentPart, ImagePart, SamplingParams, TextPart
from services.common.wire import (
    finish_reason_to_proto,
    sampling_params_from_proto,
    token_logprob_to_proto,
    usage_to_proto,
)
from services.router import prompt_embeds
from services.router.generation import GenerationPipeline
from services.router.images import ImageLoader, check_image
from services.router.metrics import RequestTracker, RouterMetrics
from services.router.openai_prompt import ROLES
from services.router.types import GenerationDelta, GenerationRequest

GRPC_ENDPOINT = "grpc:Generate"
MAX_CLIENT_REQUEST_ID_LEN = 256
_tracer = telemetry.tracer("router")
logger = logging.getLogger(__name__)


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(
        self,
        pipeline: GenerationPipeline,
        metrics: RouterMetrics,
        served_model_name: str,
        request_timeout_s: float,
        max_stop_strings: int,
        max_image_bytes: int,
        max_context_len: int,
        images: ImageLoader,
    ) -> None:
        self._pipeline = pipeline
        self._metrics = metrics
        self._served_model_name = served_model_name
        self._request_timeout_s = request_timeout_s
        self._max_stop_strings = max_stop_strings
        self._max_image_bytes = max_image_bytes
        self._max_context_len = max_context_len
        self._images = images
        self._releaser = MemoryReleaser()

    @handle_errors
    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Tokenize, route, prefill and decode one request; stream its text as it is generated."""
        tracker = RequestTracker(self._metrics, GRPC_ENDPOINT)
        outcome = "internal_error"  # unless it ends otherwise
        parent = telemetry.extract_context(context.invocation_metadata())
        span = _tracer.start_span(
            "router.generate_rpc",
            context=parent,
            attributes={"client_request_id": request.request_id},
        )
        deltas: AsyncIterator[GenerationDelta] | None = None
        try:
            generation = await self._to_generation(request, context)
            span.set_attribute("request_id", generation.request_id)
            label = request.request_id or generation.request_id  # what the client sees
            deltas = self._pipeline.stream(generation)
            with trace.use_span(span):  # the pipeline's spans start under this one
                delta = await anext(deltas)
            while True:
                yield _to_proto(label, delta)
                if delta.finish_reason is not None:
                    outcome = "ok"
                    tracker.finish(outcome, delta.usage)
                    return
                delta = await anext(deltas)
        except StageServeError as exc:
            outcome = exc.openai_type
            telemetry.mark_error(span, exc)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            tracker.finish(outcome)
            span.end()
            self._releaser.request_done(request.ByteSize())
            if deltas is not None:
                await deltas.aclose()  # type: ignore[attr-defined]

    async def _to_generation(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> GenerationRequest:
        if request.model not in ("", self._served_model_name):
            raise NotFoundError(
                f"the model {request.model!r} does not exist; this server serves {self._served_model_name!r}",
                param="model",
            )
        check_known_fields(request)
        params = _sampling_params(request.sampling_params)
        await self._pipeline.check_grammar(params, "sampling_params.grammar")
        stop = tuple(request.stop)
        if len(stop) > self._max_stop_strings or not all(stop):
            raise InvalidRequestError(
                f"stop takes up to {self._max_stop_strings} non-empty strings", param="stop"
            )
        timeout_s = request.timeout_ms / 1000 if request.timeout_ms else self._request_timeout_s
        remaining = context.time_remaining()
        if remaining is not None:
            timeout_s = min(timeout_s, remaining)
        if len(request.request_id) > MAX_CLIENT_REQUEST_ID_LEN:
            raise InvalidRequestError(
                f"request_id has {len(request.request_id)} characters; the limit is "
                f"{MAX_CLIENT_REQUEST_ID_LEN}",
                param="request_id",
            )
        request_id = f"gen-{uuid.uuid4().hex}"  # never the client's: see the module docstring
        logger.debug("request %s has the client request_id %r", request_id, request.request_id)
        common = {
            "params": params,
            "max_tokens": params.max_new_tokens,
            "stop": stop,
            "timeout_s": timeout_s,
            "max_tokens_param": (
                "max_new_tokens" if request.sampling_params.HasField("max_new_tokens") else None
            ),
        }
        if request.WhichOneof("input") == "prompt":
            return GenerationRequest(request_id, prompt=request.prompt, **common)
        if request.WhichOneof("input") == "chat":
            return GenerationRequest(
                request_id, messages=await self._messages(request.chat), **common
            )
        if request.WhichOneof("input") == "prompt_embeds":
            embeds = prompt_embeds.from_saved(request.prompt_embeds, self._max_context_len)
            return GenerationRequest(request_id, prompt_embeds=embeds, **common)
        raise InvalidRequestError(
            "the request needs a prompt, a chat or prompt_embeds", param="input"
        )

    async def _messages(self, chat: common_pb2.ChatMessages) -> tuple[ChatMessage, ...]:
        if not chat.messages:
            raise InvalidRequestError("chat needs at least one message", param="chat.messages")
        messages = []
        for i, message in enumerate(chat.messages):
            role = ROLES.get(message.role)
            if role is None:
                raise InvalidRequestError(
                    f"unknown role {message.role!r}", param=f"chat.messages[{i}].role"
                )
            parts = [
                await self._part(part, f"chat.messages[{i}].content[{j}]")
                for j, part in enumerate(message.content)
            ]
            messages.append(ChatMessage(role, tuple(parts)))
        return tuple(messages)

    async def _part(self, part: common_pb2.ContentPart, param: str) -> ContentPart:
        kind = part.WhichOneof("part")
        if kind == "text":
            return TextPart(part.text)
        if kind != "image":
            raise InvalidRequestError("a content part needs text or an image", param=param)
        if part.image.WhichOneof("source") == "url":
            return ImagePart(await self._images.load(part.image.url, f"{param}.image.url"))
        check_image(part.image.data, self._max_image_bytes, f"{param}.image.data")
        return ImagePart(part.image.data)


def check_known_fields(message: Message, path: str = "") -> None:
    """``InvalidRequestError`` when ``message`` or a message inside it carries fields unknown
    here."""
    unknown = sorted({field.field_number for field in UnknownFieldSet(message)})
    if unknown:
        where = path or type(message).DESCRIPTOR.name
        raise InvalidRequestError(
            f"{where} has fields this server does not know (field numbers "
            f"{', '.join(map(str, unknown))}); unknown fields are refused, not ignored",
            param=path or None,
        )
    for descriptor, value in message.ListFields():
        if descriptor.message_type is None:
            continue
        name = f"{path}.{descriptor.name}" if path else descriptor.name
        if descriptor.is_repeated:
            for i, item in enumerate(value):
                check_known_fields(item, f"{name}[{i}]")
        else:
            check_known_fields(value, name)


def _sampling_params(message: common_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields take the engine defaults (the proto's documented ones)."""
    params = sampling_params_from_proto(message)
    params.validate()
    if params.num_prompt_logprobs >= 0:
        raise InvalidRequestError(
            "num_prompt_logprobs is not supported on Router.Generate (use /v1/completions)",
            param="num_prompt_logprobs",
        )
    return params


def _to_proto(request_id: str, delta: GenerationDelta) -> router_pb2.GenerateResponse:
    response = router_pb2.GenerateResponse(
        request_id=request_id,
        text_delta=delta.text,
        token_ids=delta.token_ids,
        finish_reason=finish_reason_to_proto(delta.finish_reason),
        logprobs=[token_logprob_to_proto(logprob) for logprob in delta.logprobs],
    )
    if delta.usage is not None:
        response.usage.CopyFrom(usage_to_proto(delta.usage))
    return response
