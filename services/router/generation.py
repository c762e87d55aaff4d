"""The request pipeline both APIs share.

Request lifecycle in the router:
  tokenize   -> a tokenizer worker turns the prompt or chat (images as hash and size, or
                bytes) into ids; when a slot is free, the images go to the encoder's cache
                meanwhile (prefetch.py)
  admit      -> the request takes one of the admission slots, or waits in the FIFO
                admission queue, or gets 429 (admission.py); the images not prefetched yet
                go to the encoder at once, into its cache, while the steps below run
  reserve    -> a decode worker reserves KV pages for prompt + max_new_tokens; when every
                decode worker is out of pages the request waits in the queue again
  prefill    -> prefill writes the prompt's KV into those pages, returns the first token
                (placement.py: which workers, and the one retry on another worker)
  generate   -> decode streams the remaining tokens; each batch is detokenized, checked
                for stop strings and handed to the API layer as a GenerationDelta; a request
                of max_tokens 0 (``is_prompt_only``) asks for one token and ends at prefill,
                its token dropped: its one delta holds the prompt alone, finished LENGTH
  finished   -> EOS / stop token / length reported by decode, or a stop string matched
Each request runs in its own task (the producer) and hands deltas to the API layer
through a queue, so the API side can be cancelled (client disconnect) at any point
without interrupting clean-up. The producer runs under the request's deadline, and each
hop (tokenize, Reserve, prefill, each gap between decode messages) under the stall bound
(progress.py): a frozen worker ends the request with UNAVAILABLE naming the hop. When
anything ends it early (error, stall, deadline, disconnect, stop string, prefill
finishing the request), decode's Abort is sent in the background (idempotent, frees the
pages). The Abort says ``is_kv_written`` exactly when prefill returned successfully: its
KV write has landed, so decode frees the pages at once instead of quarantining them
against a late write. Every task a request starts runs through ``RequestTasks``
(drain.py), which also owns the router's drain on shutdown.

The producer's ``router.request`` span (a child of the caller's trace context) is the
parent of every worker's span; it ends with status ERROR when the request fails.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec

from services.common import telemetry
from services.common.clients.tokenizer import image_headers
from services.common.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    StageServeError,
    UnavailableError,
)
from services.common.server import current_request_id
from services.common.types import (
    FinishReason,
    ImageHeader,
    ImagePart,
    SamplingParams,
    TokenizedPrompt,
)
from services.engine.processing import ImageProcessor
from services.router.admission import AdmissionManager
from services.router.config import FlowConfig
from services.router.drain import RequestTasks
from services.router.emit import Emit, TerminalEmit, TimedEmit
from services.router.grammars import GrammarChecker
from services.router.metrics import RequestStats, RouterMetrics
from services.router.output import DetokenizerFactory, OutputAssembler, with_prompt
from services.router.peers import DecodePeer, TokenizerPeer
from services.router.placement import KvJob, Placer, Reservation
from services.router.prefetch import ImagePrefetcher
from services.router.progress import StallBound
from services.router.registry import WorkerRegistry
from services.router.tracing import request_attributes
from services.router.types import GenerationDelta, GenerationRequest
from services.router.workers import Hop, Worker, WorkerKind

_tracer = telemetry.tracer("router")


class GenerationPipeline:
    def __init__(
        self,
        registry: WorkerRegistry,
        detokenizer_factory: DetokenizerFactory,
        max_context_len: int,
        metrics: RouterMetrics,
        default_max_tokens: int = 0,
        flow: FlowConfig = FlowConfig(),
        *,
        model_name: str,
        prefetch_images: bool = True,
        image_processor: ImageProcessor | None = None,
        grammars: GrammarChecker | None = None,
    ) -> None:
        """``grammars``: compiles requests' grammars before admission (None: a grammar is a
        400)."""
        self.grammars = grammars
        self._registry = registry
        self._model_name = model_name  # the served name, on the request's span
        self._detokenizer_factory = detokenizer_factory
        self._max_context_len = max_context_len
        self._default_max_tokens = default_max_tokens
        self._metrics = metrics
        self.tasks = RequestTasks()
        self.admission = AdmissionManager(
            flow.max_concurrent_requests, flow.max_queued_requests, flow.queue_timeout_s, metrics
        )
        self._bound = StallBound(registry, flow.stall_timeout_s)
        self._placer = Placer(registry, self.admission, self._bound, metrics, self.tasks.spawn)
        self._prefetch = ImagePrefetcher(
            registry, self.tasks.spawn, is_enabled=prefetch_images, processor=image_processor
        )

    async def stream(
        self, request: GenerationRequest, after: asyncio.Event | None = None
    ) -> AsyncIterator[GenerationDelta]:
        """The request's deltas, the last with finish_reason and usage; ``after``: admitted at
        once, the request starts once it is set (its deadline counts the wait: a later choice
        of ``n``, ``choices.open_choices``).

        Raises the ``StageServeError`` that ended it (``UnavailableError`` at once while
        draining). Closing the iterator early (or cancelling its consumer) cancels the
        request and aborts it on decode.
        """
        queue: asyncio.Queue[GenerationDelta | StageServeError] = asyncio.Queue()
        producer = self.tasks.admit(
            self._produce(request, queue.put_nowait, after), f"request-{request.request_id}"
        )
        is_over = False  # the producer has delivered its terminal item and winds down by itself
        try:
            while True:
                item = await queue.get()
                is_over = isinstance(item, StageServeError) or item.finish_reason is not None
                if isinstance(item, StageServeError):
                    raise item
                yield item
                if is_over:
                    return
        finally:
            if not is_over:
                producer.cancel()

    async def _produce(
        self, request: GenerationRequest, emit: Emit, after: asyncio.Event | None = None
    ) -> None:
        """Run the request under its deadline (once ``after`` is set); always emits exactly
        one terminal item."""
        current_request_id.set(request.request_id)
        state = TerminalEmit(emit)
        with _tracer.start_as_current_span(
            "router.request",
            attributes=request_attributes(request, self._model_name),
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            stats = RequestStats(self._metrics, span, time.perf_counter())
            timed = TimedEmit(state.emit, stats, request.max_tokens)
            error: BaseException | None = None
            try:
                async with asyncio.timeout(request.timeout_s):
                    deadline_unix_s = time.time() + request.timeout_s
                    if after is not None:
                        await after.wait()
                    await self._run(request, deadline_unix_s, timed)
            except TimeoutError:
                error = DeadlineExceededError(
                    f"request {request.request_id} passed its deadline of {request.timeout_s:g} s"
                )
                state.emit(error)
            except StageServeError as exc:
                error = exc
                state.emit(exc)
            except BaseException as exc:  # recorded on the span; re-raised (logged by _task_done)
                error = exc
                raise
            finally:
                if not state.is_done:  # an unexpected exception or cancellation (end_all)
                    state.emit(
                        self.tasks.cut_off
                        or StageServeError(f"request {request.request_id} failed inside the router")
                    )
                if error is not None:
                    telemetry.mark_error(span, error)

    async def _run(
        self, request: GenerationRequest, deadline_unix_s: float, emit: TimedEmit
    ) -> None:
        headers = None
        sent: frozenset[str] = frozenset()  # images prefetched before tokenization
        if request.messages is not None:
            headers = await image_headers(request.messages)
            if headers and self.admission.can_admit_now():
                images = [
                    p.data for m in request.messages for p in m.content if isinstance(p, ImagePart)
                ]
                sent = self._prefetch.start_from_headers(
                    request.request_id, images, headers, _remaining(deadline_unix_s)
                )
        prompt = await self._tokenize(request, deadline_unix_s, headers=headers)
        params = self._bounded_params(request, prompt)
        detokenizer = self._detokenizer_factory(skip_special_tokens=request.skip_special_tokens)
        output = OutputAssembler(detokenizer, request.stop, len(prompt.token_ids))
        job = KvJob(request.request_id, prompt, params, deadline_unix_s)
        flow = _Flow(job, output, emit, request.is_prompt_only)
        with self.admission.ticket(request.request_id) as ticket:
            self._prefetch.start(request.request_id, prompt, _remaining(deadline_unix_s), sent)
            place_started = time.perf_counter()
            reservation, result = await self._placer.place(job, ticket)
            emit.stats.placed(ticket.waited_s, time.perf_counter() - place_started)
            is_decode_done = False
            try:
                is_decode_done = await self._generate(flow, reservation, result)
            finally:
                self._placer.end(reservation, is_decode_done=is_decode_done)

    async def check_grammar(self, params: SamplingParams, param: str) -> None:
        """``InvalidRequestError`` naming ``param`` when ``params.grammar`` does not compile."""
        if params.grammar is None:
            return
        if self.grammars is None:
            raise InvalidRequestError(f"{param}: this router compiles no grammars", param=param)
        await self.grammars.check(params.grammar, param)

    async def tokenize(self, request: GenerationRequest) -> TokenizedPrompt:
        """The request's prompt as generation would tokenize it, under its timeout
        (``/tokenize``)."""
        try:
            async with asyncio.timeout(request.timeout_s):
                return await self._tokenize(request, time.time() + request.timeout_s)
        except TimeoutError:
            raise DeadlineExceededError(
                f"request {request.request_id} passed its deadline of {request.timeout_s:g} s"
            ) from None

    async def _tokenize(
        self,
        request: GenerationRequest,
        deadline_unix_s: float,
        headers: list[ImageHeader | None] | None = None,
    ) -> TokenizedPrompt:
        embeds = request.prompt_embeds
        if embeds is not None:  # no tokens: placeholder ids (0) carry the length, rows the content
            return TokenizedPrompt(
                (0,) * embeds.num_tokens,
                prompt_embeds=embeds.data,
                prompt_embeds_dtype=embeds.dtype,
            )
        if request.prompt_token_ids is not None:  # checked against the vocabulary by the API
            return TokenizedPrompt(request.prompt_token_ids)
        with self._registry.lease(WorkerKind.TOKENIZER) as worker:
            tokenizer: TokenizerPeer = worker.client
            timeout_s = _remaining(deadline_unix_s)
            if request.messages is not None:
                template = request.template
                call = tokenizer.tokenize_chat(
                    request.request_id,
                    request.messages,
                    template.add_generation_prompt,
                    timeout_s=timeout_s,
                    headers=headers,
                    continue_final_message=template.continue_final_message,
                    chat_template_kwargs=template.kwargs,
                )
            else:
                assert request.prompt is not None
                call = tokenizer.tokenize_prompt(
                    request.request_id, request.prompt, timeout_s=timeout_s
                )
            return await self._bound.call(Hop.TOKENIZE, worker, request.request_id, call)

    def _bounded_params(
        self, request: GenerationRequest, prompt: TokenizedPrompt
    ) -> SamplingParams:
        """The request's sampling parameters with max_new_tokens set: the client's max_tokens when
        the context has room for it (else a 400, as vLLM answers), a default fitted to the room,
        1 for a prompt-only request."""
        prompt_len = len(prompt.token_ids)
        room = self._max_context_len - prompt_len
        if room <= 0:
            raise InvalidRequestError(
                f"the prompt has {prompt_len} tokens; this model's context is {self._max_context_len} tokens",
                param=request.prompt_param,
            )
        param = request.max_tokens_param
        if request.max_tokens is not None and param is not None and request.max_tokens > room:
            raise InvalidRequestError(
                f"{param} is {request.max_tokens}, but the prompt has {prompt_len} tokens and this "
                f"model's context is {self._max_context_len} tokens: at most {room} can be "
                "generated",
                param=param,
            )
        wanted = request.max_tokens or self._default_max_tokens or room
        if request.is_prompt_only:
            wanted = 1  # prefill runs for one token, which _generate drops
        params = msgspec.structs.replace(request.params, max_new_tokens=min(wanted, room))
        params.validate()  # min_tokens against the budget it got
        return params

    async def _generate(self, flow: _Flow, reservation: Reservation, result: Any) -> bool:
        """Emit prefill's first token, then decode's; True when decode finished the request
        itself."""
        output, job = flow.output, flow.job
        output.num_cached_image_tokens = result.num_cached_image_tokens
        output.num_prefix_cached_tokens = result.num_prefix_cached_tokens
        output.num_prefix_cached_image_tokens = result.num_prefix_cached_image_tokens
        first_logprobs = () if result.first_logprob is None else (result.first_logprob,)
        if flow.is_prompt_only:  # the token was asked for prefill's sake: none is generated
            delta = output.finish(FinishReason.LENGTH)
        elif result.finish_reason is not None:
            delta = output.finish(result.finish_reason, [result.first_token_id], first_logprobs)
        else:
            delta = output.add_tokens([result.first_token_id], first_logprobs)
        if job.params.num_prompt_logprobs >= 0:
            delta = with_prompt(delta, job.prompt.token_ids, result.prompt_logprobs)
        flow.emit(delta)
        if output.is_finished:  # prefill finished the request, or a stop string matched
            return False
        return await self._stream_decode(
            flow, reservation.worker, result.first_token_id, result.kv_written_proof
        )

    async def _stream_decode(
        self, flow: _Flow, decode: Worker, first_token_id: int, kv_written_proof: bytes
    ) -> bool:
        """Relay decode's tokens until the request finishes; True when decode finished it itself."""
        request_id = flow.job.request_id
        client: DecodePeer = decode.client
        stream = client.generate(
            request_id,
            first_token_id,
            _remaining(flow.job.deadline_unix_s),
            kv_written_proof=kv_written_proof,
        )
        bound = self._bound.stream(Hop.GENERATE, decode, request_id)
        try:
            while True:
                try:  # each gap between two messages is bounded, the first one included
                    chunk = await bound.next(stream)
                except StopAsyncIteration:
                    break
                if not chunk.token_ids and chunk.finish_reason is None:
                    continue  # it waits on decode for a place in a batch: not a stall
                if chunk.finish_reason is not None:
                    self._registry.record_completed(decode)
                    output = flow.output.finish(
                        chunk.finish_reason, chunk.token_ids, chunk.logprobs
                    )
                    flow.emit(output)
                    return True
                flow.emit(flow.output.add_tokens(chunk.token_ids, chunk.logprobs))
                if flow.output.is_finished:  # a stop string matched
                    return False
        finally:
            bound.close()
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
        raise UnavailableError(f"decode ended the stream of {request_id} without a finish reason")


@dataclass
class _Flow:
    """One placed request on its way through decode."""

    job: KvJob
    output: OutputAssembler
    emit: TimedEmit
    is_prompt_only: bool  # GenerationRequest.is_prompt_only


def _remaining(deadline_unix_s: float) -> float:
    remaining = deadline_unix_s - time.time()
    if remaining <= 0:
        raise DeadlineExceededError("the request's deadline has passed")
    return remaining
