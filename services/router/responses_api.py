"""``POST /v1/responses``, OpenAI's Responses API, served by the chat path: the request becomes
a chat request (``responses_input.py``), is planned and generated as chat's are (``ChatPlanner``,
the generation pipeline), and its deltas become a response object or its events
(``responses_output.py``).

Nothing is stored. OpenAI stores a response unless ``store`` is false; here a stored response
could never be retrieved or continued, so ``store: true`` is a 400 saying so, ``store`` absent
is taken as false, and every response says ``store: false``; ``previous_response_id``,
``conversation`` and ``background`` (which need stored responses) are 400s too.

A stream is server-sent events, each ``event: <type>`` and ``data: <event>`` with its
``sequence_number``: ``response.created``, ``response.in_progress``, each output item's events,
then ``response.completed`` (``response.incomplete`` when ``max_output_tokens`` cut the output).
As with chat, an error before the first token is a plain HTTP error; after it, one ``error``
event ends the stream. There is no ``data: [DONE]``: a Responses stream ends with its last event.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from services.common.errors import InvalidRequestError, StageServeError
from services.router.chat_plan import ChatPlan, ChatPlanner
from services.router.http_responses import _SSEResponse, until_disconnect
from services.router.metrics import RequestTracker, RouterMetrics
from services.router.openai_format import LogprobFormatter, OpenAIJSONResponse, sse
from services.router.openai_schema import check_model
from services.router.responses_input import ChatForm, chat_form
from services.router.responses_output import (
    Event,
    OutputBuilder,
    ResponseShape,
    error_event,
)
from services.router.responses_schema import ResponsesBody
from services.router.types import GenerationDelta

RESPONSES_PATH = "/v1/responses"
Deltas = AsyncIterator[GenerationDelta]


class ResponsesApi:
    def __init__(
        self,
        chats: ChatPlanner,
        metrics: RouterMetrics,
        served_model_name: str,
        token_bytes: Callable[[int], bytes],
    ) -> None:
        self.chats = chats
        self.metrics = metrics
        self.served_model_name = served_model_name
        self._token_bytes = token_bytes

    async def create(self, body: ResponsesBody, request: Request) -> Response:
        """The response object, or its events when ``stream`` is true."""
        tracker = RequestTracker(self.metrics, RESPONSES_PATH)
        try:
            check_model(body.model, self.served_model_name)
            form = chat_form(body)
            response_id = f"resp_{uuid.uuid4().hex}"
            with form.naming_responses_fields():
                plan = await self.chats.plan(form.body, request, response_id)
                builder = self._builder(plan, form)
                shape = ResponseShape(
                    response_id, int(time.time()), self.served_model_name, _echoed(body, form, plan)
                )
                stream = self.chats.pipeline.stream(plan.generation)
                if not body.stream:
                    last = await until_disconnect(request, _whole(stream, builder))
                    tracker.finish("ok", last.usage)
                    output = builder.output()
                    return OpenAIJSONResponse(shape.body(output, last.finish_reason, last.usage))
                first = await until_disconnect(request, _first(stream))
            events = _events(shape, builder, first, stream, tracker)
            return _SSEResponse(
                events, media_type="text/event-stream", headers={"cache-control": "no-cache"}
            )
        except StageServeError as exc:
            tracker.finish(exc.openai_type)
            raise

    def _builder(self, plan: ChatPlan, form: ChatForm) -> OutputBuilder:
        parser = None if plan.tools is None else plan.tools.parser()
        if not form.body.logprobs:
            return OutputBuilder(parser, None)
        if parser is not None:
            raise InvalidRequestError(
                "output logprobs are not supported with tools unless tool_choice is none",
                param="include",
            )
        return OutputBuilder(None, LogprobFormatter(self._token_bytes))


def _echoed(body: ResponsesBody, form: ChatForm, plan: ChatPlan) -> dict[str, Any]:
    """What the response repeats of its request (the defaults where it set nothing)."""
    params = plan.generation.params
    text_format = {"type": "text"}
    if body.text is not None and body.text.format is not None:
        text_format = body.text.format.model_dump(by_alias=True, exclude_none=True)
    tools = [{"type": "function", **t.function.model_dump()} for t in form.body.tools or ()]
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_logprobs": params.num_top_logprobs,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "tool_choice": "auto" if body.tool_choice is None else body.tool_choice,
        "tools": tools,
        "text": {"format": text_format},
        "truncation": "disabled",
        "store": False,
        "background": False,
        "previous_response_id": None,
        "reasoning": None,
        "metadata": body.metadata or {},
        "user": body.user,
    }


async def _first(stream: Deltas) -> GenerationDelta:
    return await anext(stream)


async def _whole(stream: Deltas, builder: OutputBuilder) -> GenerationDelta:
    """The last delta, once ``builder`` has every one."""
    async for delta in stream:
        builder.feed(delta)
        if delta.finish_reason is not None:
            return delta
    raise AssertionError("the pipeline ended without a final delta")


class _Numbered:
    """Gives each event its ``sequence_number`` and writes it as a server-sent event."""

    def __init__(self) -> None:
        self._next = 0

    def sse(self, event: Event) -> str:
        numbered = {**event, "sequence_number": self._next}
        self._next += 1
        return f"event: {event['type']}\n" + sse(numbered)


async def _events(
    shape: ResponseShape,
    builder: OutputBuilder,
    first: GenerationDelta,
    stream: Deltas,
    tracker: RequestTracker,
) -> AsyncIterator[str]:
    numbered = _Numbered()
    outcome = "cancelled"  # unless the stream reaches its end
    try:
        for kind in ("response.created", "response.in_progress"):
            yield numbered.sse({"type": kind, "response": shape.body([])})
        delta = first
        while True:
            for event in builder.feed(delta):
                yield numbered.sse(event)
            if delta.finish_reason is not None:
                break
            delta = await anext(stream)
        body = shape.body(builder.output(), delta.finish_reason, delta.usage)
        yield numbered.sse({"type": f"response.{body['status']}", "response": body})
        outcome = "ok"
        tracker.finish(outcome, delta.usage)
    except StageServeError as exc:
        outcome = exc.openai_type
        yield numbered.sse(error_event(exc))
    finally:
        tracker.finish(outcome)
        await stream.aclose()  # type: ignore[attr-defined]
