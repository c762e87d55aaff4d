"""The OpenAI-compatible HTTP API (FastAPI): chat and text completions, models, health.

Streams are server-sent events ending in ``data: [DONE]``. Errors before the first
token (bad input, no worker, deadline) are plain HTTP errors with an OpenAI error
body; an error after the stream has started is sent as a ``data: {"error": ...}``
event. A client that goes away, while waiting or while streaming, cancels its request
(the pipeline then aborts it on decode).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import inspect
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from services.common.errors import AbortedError, InvalidRequestError, StageServeError
from services.common.types import TokenLogprob
from services.engine.processing import TextProcessor
from services.router.auth import is_authorized
from services.router.body_limit import BodyLimitMiddleware
from services.router.fast_json import FastJSONRoute
from services.router.generation import GenerationPipeline
from services.router.http_errors import (
    GENERATION_RESPONSES,
    TOKENIZE_RESPONSES,
    install_error_handlers,
    openapi_without_422,
)
from services.router.images import ImageLoader
from services.router.metrics import RequestTracker, RouterMetrics
from services.router.openai_format import (
    LogprobFormatter,
    OpenAIJSONResponse,
    PromptLogprobs,
    ResponseFormatter,
    error_body_of,
    sse,
)
from services.router.openai_params import GenerationOptions, generation_options
from services.router.openai_schema import (
    ChatCompletionBody,
    CompletionBody,
    chat_messages,
    check_model,
    completion_input,
)
from services.router.registry import WorkerRegistry
from services.router.tokenize_api import TokenizeApi
from services.router.tools import ToolPlan, tool_plan
from services.router.tracing import TraceContextMiddleware
from services.router.types import GenerationDelta, GenerationRequest

T = TypeVar("T")
CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


@dataclass(frozen=True)
class ApiLimits:
    request_timeout_s: float
    max_stop_strings: int
    max_request_bytes: int  # larger HTTP bodies get 413 (BodyLimitMiddleware)


class VersionResponse(BaseModel):
    version: str


class OpenAIApi:
    """The handlers; ``create_app`` wires them into a FastAPI app. ``text``: the router's copy
    of the model's tokenizer (``/detokenize``, logprobs' token texts)."""

    def __init__(
        self,
        pipeline: GenerationPipeline,
        registry: WorkerRegistry,
        images: ImageLoader,
        metrics: RouterMetrics,
        served_model_name: str,
        max_context_len: int,
        limits: ApiLimits,
        text: TextProcessor,
    ) -> None:
        self.pipeline = pipeline
        self.registry = registry
        self.images = images
        self.metrics = metrics
        self.served_model_name = served_model_name
        self.max_context_len = max_context_len
        self.limits = limits
        self.created = int(time.time())
        self._token_bytes = text.token_bytes
        self.tokens = TokenizeApi(
            pipeline, images, text, served_model_name, max_context_len, limits.request_timeout_s
        )

    async def chat_completions(self, body: ChatCompletionBody, request: Request) -> Response:
        tracker = RequestTracker(self.metrics, CHAT_PATH)
        try:
            check_model(body.model, self.served_model_name)
            options = generation_options(body, self.limits.max_stop_strings)
            tools = tool_plan(body)
            grammar_param = "response_format"
            if tools is not None and tools.grammar is not None:
                params = msgspec.structs.replace(options.params, grammar=tools.grammar)
                options, grammar_param = dataclasses.replace(options, params=params), "tools"
            await self.pipeline.check_grammar(options.params, grammar_param)
            listed = None if tools is None else list(tools.tools)
            messages = await _until_disconnect(
                request, chat_messages(body.messages, self.images, listed)
            )
            generation = self._generation(
                f"chatcmpl-{uuid.uuid4().hex}", options, messages=messages
            )
            return await self._respond(
                generation,
                body.stream,
                body.stream_options,
                request,
                tracker,
                is_chat=True,
                tools=tools,
            )
        except StageServeError as exc:
            tracker.finish(exc.openai_type)
            raise

    async def completions(self, body: CompletionBody, request: Request) -> Response:
        tracker = RequestTracker(self.metrics, COMPLETIONS_PATH)
        try:
            check_model(body.model, self.served_model_name)
            options = generation_options(body, self.limits.max_stop_strings)
            await self.pipeline.check_grammar(options.params, "response_format")
            given = completion_input(body, self.max_context_len)
            prompt, embeds = (given, None) if isinstance(given, str) else (None, given)
            if embeds is not None and body.echo:
                raise InvalidRequestError(
                    "echo needs a text prompt, not prompt_embeds", param="echo"
                )
            if embeds is not None and body.prompt_logprobs is not None:
                raise InvalidRequestError(
                    "prompt_logprobs needs a text prompt, not prompt_embeds",
                    param="prompt_logprobs",
                )
            generation = self._generation(
                f"cmpl-{uuid.uuid4().hex}", options, prompt=prompt, prompt_embeds=embeds
            )
            echo = prompt if body.echo else ""
            return await self._respond(
                generation,
                body.stream,
                body.stream_options,
                request,
                tracker,
                is_chat=False,
                echo=echo,
                prompt_tops=(body.logprobs if body.echo else None, body.prompt_logprobs),
            )
        except StageServeError as exc:
            tracker.finish(exc.openai_type)
            raise

    def _generation(
        self, request_id: str, options: GenerationOptions, **prompt: Any
    ) -> GenerationRequest:
        return GenerationRequest(
            request_id,
            **prompt,
            params=options.params,
            max_tokens=options.max_tokens,
            max_tokens_param=options.max_tokens_param,
            stop=options.stop,
            timeout_s=self.limits.request_timeout_s,
        )

    async def _respond(
        self,
        generation: GenerationRequest,
        stream: bool,
        stream_options: Any,
        request: Request,
        tracker: RequestTracker,
        *,
        is_chat: bool,
        echo: str = "",
        tools: ToolPlan | None = None,
        prompt_tops: tuple[int | None, int | None] = (None, None),
    ) -> Response:
        """``echo``: text the output starts with (completions' echo: the prompt); ``tools``:
        the chat's tool plan (its output parsed for calls; never with ``stream``);
        ``prompt_tops``: ``ResponseFormatter``'s ``echo_top`` and ``prompt_top``."""
        logprobs = None
        if generation.params.return_logprobs:
            logprobs = LogprobFormatter(self._token_bytes)
        formatter = ResponseFormatter(
            generation.request_id,
            self.served_model_name,
            int(time.time()),
            is_chat=is_chat,
            logprobs=logprobs,
            echo_top=prompt_tops[0],
            prompt_top=prompt_tops[1],
            token_bytes=self._token_bytes,
        )
        deltas = self.pipeline.stream(generation)
        if not stream:
            collected = await _until_disconnect(request, _collect(deltas))
            text, last, token_logprobs, prompt = collected
            assert last.finish_reason is not None and last.usage is not None
            tracker.finish("ok", last.usage)
            parsed = None if tools is None else tools.parse(text)
            body = formatter.full(
                echo + text, last.finish_reason, last.usage, token_logprobs, parsed, prompt
            )
            return OpenAIJSONResponse(body)
        # The first delta comes before the headers, so errors up to prefill are plain HTTP errors.
        first = await _until_disconnect(request, anext(deltas))
        include_usage = bool(stream_options and stream_options.include_usage)
        events = _sse_events(formatter, first, deltas, include_usage, tracker, echo)
        return _SSEResponse(
            events, media_type="text/event-stream", headers={"cache-control": "no-cache"}
        )

    def version(self) -> VersionResponse:
        """The installed stageserve package's version (vLLM's ``GET /version``)."""
        return VersionResponse(version=importlib.metadata.version("stageserve"))

    def models(self) -> dict[str, Any]:
        model = {
            "id": self.served_model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "stageserve",
            "max_model_len": self.max_context_len,
        }
        return {"object": "list", "data": [model]}

    def health(self, request: Request) -> OpenAIJSONResponse:
        """200 while every needed kind has a ready worker, else 503; 503 ``draining`` once a
        SIGTERM started the shutdown. The body is the status alone, unless the caller may see
        the detail (``auth.is_authorized``): the missing kinds, every worker's address, state
        and load, and admission."""
        missing = [k.value for k in self.registry.missing_kinds()]
        status, code = ("unavailable", 503) if missing else ("ok", 200)
        if self.pipeline.tasks.is_draining:
            status, code = "draining", 503
        if not is_authorized(request.scope):
            return OpenAIJSONResponse({"status": status}, status_code=code)
        workers = [
            {
                "kind": w.kind.value,
                "address": w.address,
                "state": w.state.value,
                "in_flight": w.num_in_flight,
                "stalls": w.num_stalls,
                **({"leaving": True} if w.is_leaving else {}),
                **({"error": w.last_error} if w.last_error else {}),
            }
            for w in self.registry.workers()
        ]
        admission = msgspec.to_builtins(self.pipeline.admission.snapshot())
        body = {"status": status, **({"missing": missing} if missing else {})}
        body |= {"workers": workers, "admission": admission}
        return OpenAIJSONResponse(body, status_code=code)


class _SSEResponse(StreamingResponse):
    """Closes its event generator however the response ends (a disconnect cancels mid-send)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def _collect(
    deltas: AsyncIterator[GenerationDelta],
) -> tuple[str, GenerationDelta, list[TokenLogprob], PromptLogprobs | None]:
    texts, logprobs = [], []
    prompt = None
    async for delta in deltas:
        texts.append(delta.text)
        logprobs.extend(delta.logprobs)
        prompt = prompt or _prompt_of(delta)
        if delta.finish_reason is not None:
            return "".join(texts), delta, logprobs, prompt
    raise AssertionError("the pipeline ended without a final delta")


def _prompt_of(delta: GenerationDelta) -> PromptLogprobs | None:
    if not delta.prompt_token_ids:
        return None
    return PromptLogprobs(delta.prompt_token_ids, delta.prompt_logprobs)


async def _sse_events(
    formatter: ResponseFormatter,
    first: GenerationDelta,
    deltas: AsyncIterator[GenerationDelta],
    include_usage: bool,
    tracker: RequestTracker,
    echo: str,
) -> AsyncIterator[str]:
    outcome = "cancelled"  # unless the stream reaches its end
    try:
        if formatter.is_chat:
            yield sse(formatter.chunk("", role=True, with_usage_field=include_usage))
        if echo:
            prompt = _prompt_of(first)
            body = None if prompt is None else formatter.echo_body(prompt)
            yield sse(formatter.chunk(echo, with_usage_field=include_usage, logprobs=body))
        delta = first
        while True:
            if formatter.has_logprobs and delta.logprobs:
                body = formatter.logprobs_body(delta.logprobs)
                yield sse(
                    formatter.chunk(delta.text, with_usage_field=include_usage, logprobs=body)
                )
            elif delta.text:
                yield formatter.text_event(delta.text, include_usage)
            if delta.finish_reason is not None:
                break
            delta = await anext(deltas)
        yield sse(
            formatter.chunk(
                None if formatter.is_chat else "",
                delta.finish_reason,
                with_usage_field=include_usage,
            )
        )
        if include_usage and delta.usage is not None:
            yield sse(formatter.usage_chunk(delta.usage))
        outcome = "ok"
        tracker.finish(outcome, delta.usage)
    except StageServeError as exc:
        outcome = exc.openai_type
        yield sse(error_body_of(exc))
    finally:
        tracker.finish(outcome)
        await deltas.aclose()  # type: ignore[attr-defined]
    yield sse("[DONE]")


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise ``AbortedError``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise AbortedError("the client disconnected")
    finally:
        watcher.cancel()
        task.cancel()


# FastAPI (0.145 on) traces, meters and logs every request itself once an OpenTelemetry provider
# is set, as the router's is: spans beside the router's own and host work on every request and
# message sent. The router's spans (router.request under the caller's traceparent) and its
# Prometheus metrics already cover HTTP, so FastAPI's are off where it has them.
_FASTAPI_TELEMETRY_OFF = {
    "tracing": False,
    "metrics": False,
    "logs": False,
    "operation_spans": False,
}


def _fastapi_options() -> dict[str, Any]:
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters:
        return {"telemetry": _FASTAPI_TELEMETRY_OFF}
    return {}


def create_app(api: OpenAIApi) -> FastAPI:
    app = FastAPI(
        title="stageserve",
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        default_response_class=OpenAIJSONResponse,
        **_fastapi_options(),
    )
    app.router.route_class = FastJSONRoute  # every route added below parses JSON with msgspec
    app.openapi = openapi_without_422(app)  # type: ignore[method-assign]
    install_error_handlers(app, api.metrics)
    app.add_middleware(BodyLimitMiddleware, max_request_bytes=api.limits.max_request_bytes)
    app.add_middleware(
        TraceContextMiddleware
    )  # outermost: the caller's traceparent, before anything
    app.add_api_route(
        CHAT_PATH,
        api.chat_completions,
        methods=["POST"],
        response_model=None,
        responses=GENERATION_RESPONSES,
    )
    app.add_api_route(
        COMPLETIONS_PATH,
        api.completions,
        methods=["POST"],
        response_model=None,
        responses=GENERATION_RESPONSES,
    )
    app.add_api_route("/v1/models", api.models, methods=["GET"])
    app.add_api_route(
        "/tokenize", api.tokens.tokenize, methods=["POST"], responses=TOKENIZE_RESPONSES
    )
    app.add_api_route(
        "/detokenize", api.tokens.detokenize, methods=["POST"], responses=TOKENIZE_RESPONSES
    )
    app.add_api_route("/version", api.version, methods=["GET"])
    app.add_api_route("/health", api.health, methods=["GET"], response_model=None)
    return app
