"""The OpenAI-compatible HTTP API (FastAPI): chat and text completions, responses, models,
health. ``http_responses.py`` turns a generation into its response; ``responses_api.py`` serves
``/v1/responses``."""

from __future__ import annotations

import asyncio
import importlib.metadata
import inspect
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel

from services.common.errors import InvalidRequestError, StageServeError
from services.engine.processing import TextProcessor
from services.router.auth import is_authorized
from services.router.body_limit import BodyLimitMiddleware
from services.router.chat_plan import ChatPlanner, generation_request
from services.router.choices import choice_requests, open_choices
from services.router.fast_json import FastJSONRoute
from services.router.generation import GenerationPipeline
from services.router.http_errors import (
    GENERATION_RESPONSES,
    TOKENIZE_RESPONSES,
    install_error_handlers,
    openapi_without_422,
)
from services.router.http_responses import Choices, full_response, stream_response
from services.router.images import ImageLoader
from services.router.metrics import RequestTracker, RouterMetrics
from services.router.openai_format import LogprobFormatter, OpenAIJSONResponse, ResponseFormatter
from services.router.openai_params import GenerationOptions, generation_options
from services.router.openai_prompt import PromptInput, completion_input
from services.router.openai_schema import ChatCompletionBody, CompletionBody, check_model
from services.router.prompt_embeds import PromptEmbeds
from services.router.registry import WorkerRegistry
from services.router.responses_api import RESPONSES_PATH, ResponsesApi
from services.router.tokenize_api import TokenizeApi
from services.router.tool_parsers import ToolFormat
from services.router.tools import ToolPlan
from services.router.tracing import TraceContextMiddleware
from services.router.types import GenerationRequest

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"


@dataclass(frozen=True)
class ApiLimits:
    request_timeout_s: float
    max_stop_strings: int
    max_request_bytes: int  # larger HTTP bodies get 413 (BodyLimitMiddleware)
    max_n: int  # the most choices a request may ask for
    one_prefill: bool = True  # a prompt's choices share its prefill (``open_choices``)


class VersionResponse(BaseModel):
    version: str


class OpenAIApi:
    """The handlers; ``create_app`` wires them into a FastAPI app. ``text``: the router's copy
    of the model's tokenizer (``/detokenize``, logprobs' token texts); ``tool_format``: the
    model's tool-call format (tools and tool turns in prompts, calls in outputs)."""

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
        tool_format: ToolFormat,
    ) -> None:
        self.pipeline = pipeline
        self.registry = registry
        self.images = images
        self.metrics = metrics
        self.served_model_name = served_model_name
        self.max_context_len = max_context_len
        self.limits = limits
        self.created = int(time.time())
        self.tool_format = tool_format
        self._text = text
        self._token_bytes = text.token_bytes
        self.chats = ChatPlanner(
            pipeline,
            images,
            tool_format,
            limits.max_stop_strings,
            limits.max_n,
            limits.request_timeout_s,
        )
        self.responses = ResponsesApi(self.chats, metrics, served_model_name, text.token_bytes)
        self.tokens = TokenizeApi(
            pipeline,
            images,
            text,
            served_model_name,
            max_context_len,
            limits.request_timeout_s,
            tool_format,
        )

    async def chat_completions(self, body: ChatCompletionBody, request: Request) -> Response:
        tracker = RequestTracker(self.metrics, CHAT_PATH)
        try:
            check_model(body.model, self.served_model_name)
            plan = await self.chats.plan(body, request, f"chatcmpl-{uuid.uuid4().hex}")
            return await self._respond(
                plan.generation.request_id,
                [plan.generation],
                plan.num_choices,
                body.stream,
                body.stream_options,
                request,
                tracker,
                is_chat=True,
                tools=plan.tools,
            )
        except StageServeError as exc:
            tracker.finish(exc.openai_type)
            raise

    async def completions(self, body: CompletionBody, request: Request) -> Response:
        tracker = RequestTracker(self.metrics, COMPLETIONS_PATH)
        try:
            check_model(body.model, self.served_model_name)
            options = generation_options(body, self.limits.max_stop_strings, self.limits.max_n)
            await self.pipeline.check_grammar(options.params, options.grammar_param)
            response_id = f"cmpl-{uuid.uuid4().hex}"
            generations = self._completion_generations(body, options, response_id)
            echoes = [await self._echo(g) for g in generations] if body.echo else None
            return await self._respond(
                response_id,
                generations,
                options.num_choices,
                body.stream,
                body.stream_options,
                request,
                tracker,
                is_chat=False,
                echoes=echoes,
                prompt_tops=(body.logprobs if body.echo else None, body.prompt_logprobs),
            )
        except StageServeError as exc:
            tracker.finish(exc.openai_type)
            raise

    def _completion_generations(
        self, body: CompletionBody, options: GenerationOptions, response_id: str
    ) -> list[GenerationRequest]:
        """One generation per prompt (ids ``<response_id>-<i>`` for a batch); a batch's
        choices, n per prompt, count against ``--max-n``."""
        given = completion_input(body, self.max_context_len, self._text)
        if isinstance(given, PromptEmbeds):
            _check_embeds_options(body)
            return [self._generation(response_id, options, prompt_embeds=given)]
        num_choices = len(given) * options.num_choices
        if num_choices > self.limits.max_n:
            raise InvalidRequestError(
                f"prompt holds {len(given)} prompts of n={options.num_choices} choices each: "
                f"{num_choices} choices; at most {self.limits.max_n} (this server's --max-n)",
                param="prompt",
            )
        ids = [f"{response_id}-{i}" for i in range(len(given))] if len(given) > 1 else [response_id]
        return [
            self._generation(request_id, options, **_prompt_field(prompt))
            for request_id, prompt in zip(ids, given, strict=True)
        ]

    async def _echo(self, generation: GenerationRequest) -> str:
        """The prompt's text, which echo puts first: a token-id prompt decoded (special tokens
        kept, as vLLM), on a thread."""
        if generation.prompt_token_ids is None:
            assert generation.prompt is not None
            return generation.prompt
        return await asyncio.to_thread(self._text.decode, generation.prompt_token_ids)

    def _generation(
        self, request_id: str, options: GenerationOptions, **prompt: Any
    ) -> GenerationRequest:
        return generation_request(request_id, options, self.limits.request_timeout_s, **prompt)

    async def _respond(
        self,
        response_id: str,
        generations: Sequence[GenerationRequest],
        num_choices: int,
        stream: bool,
        stream_options: Any,
        request: Request,
        tracker: RequestTracker,
        *,
        is_chat: bool,
        echoes: Sequence[str] | None = None,
        tools: ToolPlan | None = None,
        prompt_tops: tuple[int | None, int | None] = (None, None),
    ) -> Response:
        """``num_choices`` choices per generation (``choice_requests``), the generations' in
        order (a batch's choice ``i`` of prompt ``p`` has index ``p * n + i``, as in vLLM);
        ``echoes``: per generation, the text its outputs start with (completions' echo: the
        prompt); ``tools``: the chat's tool plan (its output parsed for calls);
        ``prompt_tops``: ``ResponseFormatter``'s ``echo_top`` and ``prompt_top``."""
        created = int(time.time())
        requests = [c for g in generations for c in choice_requests(g, num_choices)]
        formatters = [
            self._formatter(response_id, r, created, index, is_chat, prompt_tops)
            for index, r in enumerate(requests)
        ]
        texts = echoes or [""] * len(generations)
        choices = Choices(
            formatters,
            open_choices(
                requests, num_choices, self.pipeline.stream, one_prefill=self.limits.one_prefill
            ),
            [text for text in texts for _ in range(num_choices)],
            num_choices,
        )
        if not stream:
            return await full_response(choices, request, tracker, tools)
        return await stream_response(choices, request, tracker, stream_options, tools)

    def _formatter(
        self,
        response_id: str,
        generation: GenerationRequest,
        created: int,
        index: int,
        is_chat: bool,
        prompt_tops: tuple[int | None, int | None],
    ) -> ResponseFormatter:
        logprobs = None
        if generation.params.return_logprobs:
            logprobs = LogprobFormatter(self._token_bytes)
        return ResponseFormatter(
            response_id,
            self.served_model_name,
            created,
            is_chat=is_chat,
            logprobs=logprobs,
            echo_top=prompt_tops[0],
            prompt_top=prompt_tops[1],
            token_bytes=self._token_bytes,
            index=index,
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
    app.add_api_route(
        RESPONSES_PATH,
        api.responses.create,
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


def _prompt_field(prompt: PromptInput) -> dict[str, Any]:
    """``GenerationRequest``'s field for a completion prompt."""
    return {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}


def _check_embeds_options(body: CompletionBody) -> None:
    if body.echo:
        raise InvalidRequestError(
            "echo needs a prompt (text or token ids), not prompt_embeds", param="echo"
        )
    if body.prompt_logprobs is not None:
        raise InvalidRequestError(
            "prompt_logprobs needs a prompt (text or token ids), not prompt_embeds",
            param="prompt_logprobs",
        )
