"""A response's ``n`` choices (OpenAI's ``n``): one generation each through the pipeline; the
first choice that fails ends the others (cancelled, so aborted on decode) and fails the
response.

One prefill per prompt (``open_choices``): a prompt's first choice starts at once, the others
once its first delta came (prefill's first token: its prompt's KV is then in the prefill
worker's prefix cache, where cache-aware routing sends them), so each computes only the tail
the cache does not hold (the last prompt token's page) and samples its own first token.
Decode gets its own copy of the prompt's KV per choice (``docs/design.md``, "`n` > 1").
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

import msgspec

from services.common.types import Usage
from services.router.types import GenerationDelta, GenerationRequest

T = TypeVar("T")
Deltas = AsyncIterator[GenerationDelta]


def choice_requests(generation: GenerationRequest, num_choices: int) -> list[GenerationRequest]:
    """``generation`` once per choice: choice ``i``'s id is ``<id>-<i>`` (one choice: the id
    itself) and, with a seed, its seed ``seed + i`` (mod 2**64): choices differ, yet repeat."""
    if num_choices == 1:
        return [generation]
    params, seed = generation.params, generation.params.seed
    return [
        msgspec.structs.replace(
            generation,
            request_id=f"{generation.request_id}-{i}",
            params=params
            if seed is None
            else msgspec.structs.replace(params, seed=(seed + i) % 2**64),
        )
        for i in range(num_choices)
    ]


def reads_cache(generation: GenerationRequest) -> bool:
    """Whether prefill may read ``generation``'s prompt from its prefix cache: not with prompt
    logprobs (every position is computed) nor prompt embeddings (not cached)."""
    return generation.prompt_embeds is None and generation.params.num_prompt_logprobs < 0


def open_choices(
    requests: Sequence[GenerationRequest],
    num_per_prompt: int,
    stream: Callable[[GenerationRequest, asyncio.Event | None], Deltas],
    *,
    one_prefill: bool,
) -> list[Deltas]:
    """Each choice's stream (``stream(request, after)``: ``GenerationPipeline.stream``),
    ``requests`` being each prompt's ``num_per_prompt`` choices in a row (``choice_requests``).
    With ``one_prefill`` (prefill's prefix cache is on) and a prompt the cache can serve
    (``reads_cache``), a prompt's later choices are admitted with the first but start only
    once its first delta came or it ended without one (their deadlines count the wait): read
    them together (``each_choice``). Closing a stream closes the pipeline's under it."""
    if not one_prefill or num_per_prompt == 1:
        return [stream(r, None) for r in requests]
    streams: list[Deltas] = []
    for start in range(0, len(requests), num_per_prompt):
        group = requests[start : start + num_per_prompt]
        if not reads_cache(group[0]):
            streams.extend(stream(r, None) for r in group)
            continue
        prefilled = asyncio.Event()
        streams.append(_first_choice(stream(group[0], None), prefilled))
        streams.extend(stream(r, prefilled) for r in group[1:])
    return streams


async def _first_choice(deltas: Deltas, prefilled: asyncio.Event) -> Deltas:
    """``deltas``, setting ``prefilled`` at the first delta or at the end, whatever it is."""
    try:
        async for delta in deltas:
            prefilled.set()
            yield delta
    finally:
        prefilled.set()
        await deltas.aclose()  # type: ignore[attr-defined]


async def each_choice(streams: Sequence[Deltas], work: Callable[[Deltas], Awaitable[T]]) -> list[T]:
    """``work(stream)`` for every choice at once, the results in choice order; the first error
    (by choice index among those failed) cancels the rest and is raised."""
    tasks = [asyncio.ensure_future(work(stream)) for stream in streams]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            error = task.exception() if task.done() and not task.cancelled() else None
            if error is not None:
                raise error
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def merged(
    streams: Sequence[Deltas], firsts: Sequence[GenerationDelta]
) -> AsyncIterator[tuple[int, GenerationDelta]]:
    """Every choice's deltas with its index: ``firsts`` (each stream's first delta, already
    taken) in order, then the rest as they come. A choice's error is raised at once; closing
    this iterator cancels the choices' pending reads (their streams then close)."""
    for index, first in enumerate(firsts):
        yield index, first
    if len(streams) == 1:  # one choice: no task per delta
        if firsts[0].finish_reason is None:
            async for delta in streams[0]:
                yield 0, delta
        return
    reads = {
        asyncio.ensure_future(anext(streams[i])): i
        for i, first in enumerate(firsts)
        if first.finish_reason is None
    }
    try:
        while reads:
            done, _ = await asyncio.wait(reads, return_when=asyncio.FIRST_COMPLETED)
            for read in sorted(done, key=reads.__getitem__):
                delta = read.result()
                index = reads.pop(read)
                yield index, delta
                if delta.finish_reason is None:
                    reads[asyncio.ensure_future(anext(streams[index]))] = index
    finally:
        for read in reads:
            read.cancel()
        await asyncio.gather(*reads, return_exceptions=True)


def total_usage(usages: Sequence[Usage], num_per_prompt: int = 1) -> Usage:
    """The response's usage from its choices' (in order, each prompt's ``num_per_prompt`` in a
    row): each prompt's counts once (its choices share it; a batch's prompts add up, as in
    vLLM), the completion tokens summed over every choice."""
    firsts = usages[::num_per_prompt]
    return Usage(
        sum(u.num_prompt_tokens for u in firsts),
        sum(u.num_completion_tokens for u in usages),
        sum(u.num_cached_image_tokens for u in firsts),
        sum(u.num_prefix_cached_tokens for u in firsts),
        sum(u.num_prefix_cached_image_tokens for u in firsts),
    )
