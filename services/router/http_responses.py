"""A generation's deltas as an OpenAI HTTP response: one JSON body, or server-sent events.

Streams end in ``data: [DONE]``. Errors before the first token (bad input, no worker,
deadline) are plain HTTP errors with an OpenAI error body; an error after the stream has
started is sent as a ``data: {"error": ...}`` event. A client that goes away, while waiting
or while streaming, cancels its request (the pipeline then aborts it on decode).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from services.common.errors import AbortedError, StageServeError
from services.common.types import TokenLogprob, Usage
from services.router.choices import Deltas, each_choice, merged, total_usage
from services.router.metrics import RequestTracker
from services.router.openai_format import (
    OpenAIJSONResponse,
    PromptLogprobs,
    ResponseFormatter,
    error_body_of,
    sse,
)
from services.router.tool_stream import ToolCallStream
from services.router.tools import ToolPlan
from services.router.types import GenerationDelta

T = TypeVar("T")


@dataclass(frozen=True)
class Choices:
    """A response's choices in index order, each prompt's ``num_per_prompt`` in a row (a
    completion's batch of prompts; one prompt otherwise)."""

    formatters: Sequence[ResponseFormatter]
    streams: Sequence[Deltas]
    echoes: Sequence[str]  # per choice, the text its output starts with (completions' echo)
    num_per_prompt: int  # n

    def usage(self, usages: Sequence[Usage]) -> Usage:
        return total_usage(usages, self.num_per_prompt)


async def full_response(
    choices: Choices, request: Request, tracker: RequestTracker, tools: ToolPlan | None
) -> OpenAIJSONResponse:
    """The whole response, once every choice's last delta came (``tools``: ``_respond``'s)."""
    collected = await until_disconnect(request, each_choice(choices.streams, _collect))
    bodies, usages = [], []
    for formatter, echo, (text, last, token_logprobs, prompt) in zip(
        choices.formatters, choices.echoes, collected, strict=True
    ):
        assert last.finish_reason is not None and last.usage is not None
        parsed = None if tools is None else tools.parse(text)
        bodies.append(
            formatter.choice(echo + text, last.finish_reason, token_logprobs, parsed, prompt)
        )
        usages.append(last.usage)
    usage = choices.usage(usages)
    tracker.finish("ok", usage)
    return OpenAIJSONResponse(choices.formatters[0].full(bodies, usage))


async def stream_response(
    choices: Choices,
    request: Request,
    tracker: RequestTracker,
    stream_options: Any,
    tools: ToolPlan | None = None,
) -> StreamingResponse:
    """The response as server-sent events, once every choice's first delta came; ``tools``:
    the chat's tool plan (each choice's output streamed as content and tool-call deltas)."""
    firsts = await until_disconnect(request, each_choice(choices.streams, anext))
    include_usage = bool(stream_options and stream_options.include_usage)
    calls = [None if tools is None else tools.stream(f, include_usage) for f in choices.formatters]
    events = _sse_events(choices, firsts, include_usage, tracker, calls)
    return _SSEResponse(
        events, media_type="text/event-stream", headers={"cache-control": "no-cache"}
    )


class _SSEResponse(StreamingResponse):
    """Closes its event generator however the response ends (a disconnect cancels mid-send)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def _collect(
    deltas: Deltas,
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
    choices: Choices,
    firsts: Sequence[GenerationDelta],
    include_usage: bool,
    tracker: RequestTracker,
    calls: Sequence[ToolCallStream | None],
) -> AsyncIterator[str]:
    outcome = "cancelled"  # unless the stream reaches its end
    formatters, streams = choices.formatters, choices.streams
    deltas = merged(streams, firsts)
    try:
        for formatter, echo, first in zip(formatters, choices.echoes, firsts, strict=True):
            if formatter.is_chat:
                yield sse(formatter.chunk("", role=True, with_usage_field=include_usage))
            if echo:
                prompt = _prompt_of(first)
                body = None if prompt is None else formatter.echo_body(prompt)
                yield sse(formatter.chunk(echo, with_usage_field=include_usage, logprobs=body))
        usages: dict[int, Usage] = {}
        async for index, delta in deltas:
            for event in _delta_events(formatters[index], delta, include_usage, calls[index]):
                yield event
            if delta.usage is not None:
                usages[index] = delta.usage
        usage = choices.usage([usages[i] for i in range(len(formatters))])
        if include_usage:
            yield sse(formatters[0].usage_chunk(usage))
        outcome = "ok"
        tracker.finish(outcome, usage)
    except StageServeError as exc:
        outcome = exc.openai_type
        yield sse(error_body_of(exc))
    finally:
        tracker.finish(outcome)
        await deltas.aclose()  # type: ignore[attr-defined]
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]
    yield sse("[DONE]")


def _delta_events(
    formatter: ResponseFormatter,
    delta: GenerationDelta,
    include_usage: bool,
    calls: ToolCallStream | None,
) -> Iterator[str]:
    if calls is not None:  # a chat with tools: content and tool-call deltas
        if (body := calls.chunk(delta)) is not None:
            yield sse(body)
        if delta.finish_reason is not None:
            yield sse(calls.last_chunk(delta.finish_reason))
        return
    if formatter.has_logprobs and delta.logprobs:
        body = formatter.logprobs_body(delta.logprobs)
        yield sse(formatter.chunk(delta.text, with_usage_field=include_usage, logprobs=body))
    elif delta.text:
        yield formatter.text_event(delta.text, include_usage)
    if delta.finish_reason is not None:
        text = None if formatter.is_chat else ""
        yield sse(formatter.chunk(text, delta.finish_reason, with_usage_field=include_usage))


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
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
