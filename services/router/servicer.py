"""gRPC ``stageserve.v1.Router``: proto in, the shared generation pipeline, proto out.

The router names every request itself (``gen-<uuid>``). A client's ``request_id`` is a
label: echoed in its responses and recorded on the request's span, never used inside,
so two calls with one label are two requests and neither can abort the other.

Fields follow the HTTP API's rules, through its code: nothing is ignored. A field this
server's protos do not define (a newer client's) is INVALID_ARGUMENT naming its number; an
explicit ``sampling_params.max_new_tokens`` above what the context leaves is INVALID_ARGUMENT
(unset, it is the documented 16, fitted to the context). An image given by URL
(``ImageInput.url``) is loaded by the HTTP API's ``ImageLoader``, with its guards and limits.
``num_choices`` runs as HTTP's ``n`` (``choices.py``); tools are planned by ``plan_tools`` and
listed by ``tool_prompt`` as on ``/v1/chat/completions``, a chat's tool turns (an assistant's
``tool_calls``, a ``tool`` turn's ``tool_call_id``) are checked and written in by its
``ChatTurns``, and each choice's output is parsed by the same tool parser as HTTP's stream;
``num_prompt_logprobs`` is completions' echo and ``prompt_logprobs``; the chat template fields
(``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs``) are checked by
``chat_template.py`` and ``skip_special_tokens`` picks the detokenizer, as on HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import trace

from services.common import telemetry
from services.common.errors import InvalidRequestError, NotFoundError, StageServeError
from services.common.grpc_errors import handle_errors
from services.common.malloc import MemoryReleaser
from services.common.pb.stageserve.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.common.types import (
    ContentPart,
    ImagePart,
    SamplingParams,
    TextPart,
    Usage,
)
from services.common.wire import (
    finish_reason_to_proto,
    token_logprob_to_proto,
    usage_to_proto,
)
from services.router import prompt_embeds
from services.router.chat_plan import ChatPlan, with_tool_grammar
from services.router.chat_template import check_final_message
from services.router.choices import (
    Deltas,
    choice_requests,
    each_choice,
    merged,
    open_choices,
    total_usage,
)
from services.router.generation import GenerationPipeline
from services.router.grpc_request import (
    check_known_fields,
    function_tool,
    sampling_params,
    template_options_of,
)
from services.router.images import ImageLoader, check_image
from services.router.metrics import RequestTracker, RouterMetrics
from services.router.openai_prompt import ChatTurns, SentCall, check_tool_fields, known_role
from services.router.tool_parsers import ToolFormat
from services.router.tool_stream import delta_fields
from services.router.tools import ToolParams, ToolPlan, plan_tools
from services.router.types import ChatTemplateOptions, GenerationDelta, GenerationRequest

GRPC_ENDPOINT = "grpc:Generate"
MAX_CLIENT_REQUEST_ID_LEN = 256
GRPC_TOOL_PARAMS = ToolParams("tools[{i}]", "tool_choice.mode", "tool_choice.function_name")
_tracer = telemetry.tracer("router")
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServicerLimits:
    timeout_s: float  # a request's deadline unless it sets timeout_ms (--request-timeout-s)
    max_stop_strings: int
    max_image_bytes: int
    max_context_len: int
    max_n: int  # the most choices a request may ask for (--max-n)
    one_prefill: bool = True  # the choices share the prompt's prefill (``open_choices``)


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(
        self,
        pipeline: GenerationPipeline,
        metrics: RouterMetrics,
        served_model_name: str,
        limits: ServicerLimits,
        images: ImageLoader,
        tool_format: ToolFormat,
    ) -> None:
        """``tool_format``: the model's tool-call format (tools in prompts, calls in outputs)."""
        self._pipeline = pipeline
        self._metrics = metrics
        self._served_model_name = served_model_name
        self._limits = limits
        self._images = images
        self._tool_format = tool_format
        self._releaser = MemoryReleaser()

    @handle_errors
    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Tokenize, route, prefill and decode each choice of one request; stream their text
        as it is generated, the choices' messages interleaved."""
        tracker = RequestTracker(self._metrics, GRPC_ENDPOINT)
        outcome = "internal_error"  # unless it ends otherwise
        parent = telemetry.extract_context(context.invocation_metadata())
        span = _tracer.start_span(
            "router.generate_rpc",
            context=parent,
            attributes={"client_request_id": request.request_id},
        )
        streams: list[Deltas] = []
        deltas: AsyncIterator[tuple[int, GenerationDelta]] | None = None
        try:
            plan = await self._plan(request, context)
            span.set_attribute("request_id", plan.generation.request_id)
            label = request.request_id or plan.generation.request_id  # what the client sees
            outputs = [_ChoiceOutput(label, i, plan.tools) for i in range(plan.num_choices)]
            choices = choice_requests(plan.generation, plan.num_choices)
            streams = open_choices(
                choices,
                plan.num_choices,
                self._pipeline.stream,
                one_prefill=self._limits.one_prefill,
            )
            with trace.use_span(span):  # the pipeline's spans start under this one
                firsts = await each_choice(streams, anext)
            deltas = merged(streams, firsts)
            usages: dict[int, Usage] = {}
            async for index, delta in deltas:
                yield outputs[index].response(delta)
                if delta.usage is not None:
                    usages[index] = delta.usage
            outcome = "ok"
            tracker.finish(outcome, total_usage([usages[i] for i in range(len(outputs))]))
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
            for stream in streams:
                await stream.aclose()  # type: ignore[attr-defined]

    async def _plan(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> ChatPlan:
        """The request checked, in the HTTP API's order of checks, as one generation, its
        choices and its tool plan."""
        if request.model not in ("", self._served_model_name):
            raise NotFoundError(
                f"the model {request.model!r} does not exist; this server serves {self._served_model_name!r}",
                param="model",
            )
        check_known_fields(request)
        num_choices = max(request.num_choices, 1)
        if num_choices > self._limits.max_n:
            raise InvalidRequestError(
                f"num_choices must be <= {self._limits.max_n} (this server's --max-n), got "
                f"{num_choices}",
                param="num_choices",
            )
        params, max_tokens = sampling_params(request)
        stop = tuple(request.stop)
        if len(stop) > self._limits.max_stop_strings or not all(stop):
            raise InvalidRequestError(
                f"stop takes up to {self._limits.max_stop_strings} non-empty strings",
                param="stop",
            )
        tools = self._tool_plan(request, params)
        params, grammar_param = with_tool_grammar(params, "sampling_params.grammar", tools)
        await self._pipeline.check_grammar(params, grammar_param)
        if len(request.request_id) > MAX_CLIENT_REQUEST_ID_LEN:
            raise InvalidRequestError(
                f"request_id has {len(request.request_id)} characters; the limit is "
                f"{MAX_CLIENT_REQUEST_ID_LEN}",
                param="request_id",
            )
        request_id = f"gen-{uuid.uuid4().hex}"  # never the client's: see the module docstring
        logger.debug("request %s has the client request_id %r", request_id, request.request_id)
        template = template_options_of(request)
        common = {
            "params": params,
            "max_tokens": max_tokens,
            "stop": stop,
            "timeout_s": self._timeout_s(request, context),
            "max_tokens_param": (
                "max_new_tokens" if request.sampling_params.HasField("max_new_tokens") else None
            ),
            "skip_special_tokens": (
                request.skip_special_tokens if request.HasField("skip_special_tokens") else True
            ),
        }
        generation = await self._generation(request, request_id, common, tools, template)
        return ChatPlan(generation, num_choices, tools)

    def _timeout_s(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> float:
        timeout_s = request.timeout_ms / 1000 if request.timeout_ms else self._limits.timeout_s
        remaining = context.time_remaining()
        return timeout_s if remaining is None else min(timeout_s, remaining)

    async def _generation(
        self,
        request: router_pb2.GenerateRequest,
        request_id: str,
        common: dict[str, Any],
        tools: ToolPlan | None,
        template: ChatTemplateOptions,
    ) -> GenerationRequest:
        kind = request.WhichOneof("input")
        if kind == "prompt":
            return GenerationRequest(request_id, prompt=request.prompt, **common)
        if kind == "chat":
            turns = await self._messages(request.chat)
            messages = turns.messages(() if tools is None else tools.tools)
            check_final_message(template, messages)
            return GenerationRequest(request_id, messages=messages, template=template, **common)
        if kind == "prompt_embeds":
            embeds = prompt_embeds.from_saved(request.prompt_embeds, self._limits.max_context_len)
            return GenerationRequest(request_id, prompt_embeds=embeds, **common)
        raise InvalidRequestError(
            "the request needs a prompt, a chat or prompt_embeds", param="input"
        )

    def _tool_plan(
        self, request: router_pb2.GenerateRequest, params: SamplingParams
    ) -> ToolPlan | None:
        """``plan_tools`` of the request's tools, tool choice and ``parallel_tool_calls``."""
        tools = None
        if request.tools:
            if request.WhichOneof("input") != "chat":
                raise InvalidRequestError(
                    "tools need a chat input (the tools are listed in its system message)",
                    param="tools",
                )
            tools = [function_tool(tool, f"tools[{i}]") for i, tool in enumerate(request.tools)]
        mode = named = None
        if request.HasField("tool_choice"):
            kind = request.tool_choice.WhichOneof("choice")
            if kind is None:
                raise InvalidRequestError(
                    "tool_choice must set mode or function_name", param="tool_choice"
                )
            mode = request.tool_choice.mode if kind == "mode" else None
            named = request.tool_choice.function_name if kind == "function_name" else None
        is_parallel = (
            request.parallel_tool_calls if request.HasField("parallel_tool_calls") else None
        )
        constrained = [] if params.grammar is None else ["sampling_params.grammar"]
        return plan_tools(
            tools, mode, named, is_parallel, constrained, self._tool_format, GRPC_TOOL_PARAMS
        )

    async def _messages(self, chat: common_pb2.ChatMessages) -> ChatTurns:
        """The chat's turns, checked and written in by the HTTP API's ``ChatTurns`` (tool calls
        and results included); errors name ``chat.messages[i]`` fields."""
        if not chat.messages:
            raise InvalidRequestError("chat needs at least one message", param="chat.messages")
        turns = ChatTurns(self._tool_format)
        for i, message in enumerate(chat.messages):
            param = f"chat.messages[{i}]"
            role = known_role(message.role, param)
            tool_call_id = message.tool_call_id or None  # proto3: empty is unset
            check_tool_fields(role, param, bool(message.tool_calls), tool_call_id)
            parts = [
                await self._part(part, f"{param}.content[{j}]")
                for j, part in enumerate(message.content)
            ]
            calls = (
                SentCall(call.id, call.name, call.arguments, f"{param}.tool_calls[{j}].arguments")
                for j, call in enumerate(message.tool_calls)
            )
            turns.add(role, tuple(parts), param, calls, tool_call_id)
        return turns

    async def _part(self, part: common_pb2.ContentPart, param: str) -> ContentPart:
        kind = part.WhichOneof("part")
        if kind == "text":
            return TextPart(part.text)
        if kind != "image":
            raise InvalidRequestError("a content part needs text or an image", param=param)
        if part.image.WhichOneof("source") == "url":
            return ImagePart(await self._images.load(part.image.url, f"{param}.image.url"))
        check_image(part.image.data, self._limits.max_image_bytes, f"{param}.image.data")
        return ImagePart(part.image.data)


class _ChoiceOutput:
    """One choice's deltas as GenerateResponse messages; with tools (not ``none``), its text
    parsed into content and tool-call pieces as the HTTP API's stream parses it."""

    def __init__(self, request_id: str, index: int, tools: ToolPlan | None) -> None:
        self._request_id = request_id
        self._index = index
        self._parser = None if tools is None else tools.parser()

    def response(self, delta: GenerationDelta) -> router_pb2.GenerateResponse:
        text, calls = delta.text, []
        if self._parser is not None:
            events = self._parser.feed(delta.text)
            if delta.finish_reason is not None:
                events += self._parser.finish()
            fields = delta_fields(events)
            text = fields.get("content", "")
            calls = [
                router_pb2.ToolCallDelta(
                    index=call["index"],
                    id=call.get("id", ""),
                    name=call["function"].get("name", ""),
                    arguments=call["function"]["arguments"],
                )
                for call in fields.get("tool_calls", ())
            ]
        response = router_pb2.GenerateResponse(
            request_id=self._request_id,
            text_delta=text,
            token_ids=delta.token_ids,
            finish_reason=finish_reason_to_proto(delta.finish_reason),
            logprobs=[token_logprob_to_proto(logprob) for logprob in delta.logprobs],
            choice_index=self._index,
            prompt_token_ids=delta.prompt_token_ids,
            prompt_logprobs=[token_logprob_to_proto(lp) for lp in delta.prompt_logprobs],
            tool_calls=calls,
        )
        if delta.usage is not None:
            response.usage.CopyFrom(usage_to_proto(delta.usage))
        return response
