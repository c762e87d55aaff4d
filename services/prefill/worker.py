"""Rank worker: executes one ``PrefillPlan`` on the model and hands each request's KV to decode.

``execute(plan)``: reserve local pages -> build every request's EXTEND input (image rows
from the embedding buffer merged at their request-global token indices) -> one forward
-> sample each first token with the request's own generator -> one batched KV write per
request into decode's pages (with the request's deadline; a backend that ``streams_layers``
writes each layer during the forward instead) -> free the local pages (``finally``). With context parallelism each rank runs the same plan on its shard
(token ``i`` on rank ``i % C``) after the merge; this single-rank worker is rank 0 of 1.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import torch
from opentelemetry import trace

from services.common import telemetry
from services.common.errors import AbortedError, StageServeError
from services.common.types import FinishReason
from services.engine.attention import ForwardMode
from services.engine.model.rope import ImageSpan, mrope_positions
from services.engine.model_runner import ModelRunner, StepInput
from services.engine.sampler import Sampler, SamplingParams, make_generator
from services.prefill.request import PlannedRequest, PrefillInput, PrefillOutput, PrefillPlan, RequestOutcome
from services.transfer.base import BaseKVSender, LayerwiseSend, PendingSend
from services.transfer.embeddings import EmbeddingBuffer

logger = logging.getLogger(__name__)
_tracer = telemetry.tracer("prefill")
Begun = PendingSend | LayerwiseSend | StageServeError  # a request's write once started, or why it did not start


def prefill_step(request: PrefillInput, image_embeds: torch.Tensor | None, spatial_merge_size: int) -> StepInput:
    """The request's whole prompt as one EXTEND input; ``image_embeds`` [num_image_tokens, hidden] in span order."""
    spans = [ImageSpan(s.offset, s.length, s.grid_thw) for s in request.spans]
    positions, _delta = mrope_positions(request.num_tokens, spans, spatial_merge_size)  # [3, T] int64
    rows = [s.offset + i for s in request.spans for i in range(s.length)]
    return StepInput(
        request.request_id, list(request.token_ids), positions, 0,
        image_embeds if rows else None, rows or None,
    )


def first_token_finish_reason(
    token_id: int, params: SamplingParams, num_prompt_tokens: int, eos_token_ids: Iterable[int], max_context_len: int
) -> FinishReason | None:
    """Whether the first token already ends the request (the offline engine's rule after one token)."""
    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids):
        return FinishReason.STOP
    if params.max_new_tokens <= 1 or num_prompt_tokens + 1 >= max_context_len:
        return FinishReason.LENGTH
    return None


class PrefillRankWorker:
    """Executes plans on one rank's ``ModelRunner``; called from one thread at a time."""

    def __init__(self, runner: ModelRunner, kv_sender: BaseKVSender, embeddings: EmbeddingBuffer) -> None:
        config = runner.model.config
        self.runner = runner
        self.kv_sender = kv_sender
        self.embeddings = embeddings
        self.spatial_merge_size = config.vision.spatial_merge_size
        self.eos_token_ids = frozenset(config.eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids)
        self.max_context_len = config.text.max_position_embeddings
        kv_sender.register(runner.kv_pool)

    def execute(
        self,
        plan: PrefillPlan,
        on_forward_done: Callable[[PrefillPlan], None] = lambda plan: None,
        is_aborted: Callable[[str], bool] = lambda request_id: False,
    ) -> PrefillOutput:
        """Run ``plan``; per-request transfer failures become error outcomes, anything else raises.

        ``on_forward_done`` is called once the first tokens are sampled (the embedding rows
        are no longer read), before the KV transfers start. A request whose caller is gone
        by then (``is_aborted``) sends nothing: decode may already have given its pages to
        the quarantine, and no write may start after that. With a layer-streaming backend
        the writes begin with the forward (for requests not aborted then): one aborted during
        the forward still has its layers land within that forward, inside the quarantine.
        """
        table = self.runner.page_table
        early: dict[str, tuple[trace.Span, Begun]] = {}
        try:
            for planned in plan.requests:
                table.reserve(planned.request.request_id, planned.request.num_tokens)
            for p in plan.requests:  # a backend that streams layers begins now (cuda_ipc)
                if self.kv_sender.streams_layers and not is_aborted(p.request.request_id):
                    early[p.request.request_id] = self._start_send(p.request, layerwise=True)
            start = time.perf_counter()
            token_ids = self._forward_and_sample(plan, early)
            forward_s = time.perf_counter() - start
            on_forward_done(plan)
            # every write starts before any is awaited: an asynchronous backend queues them back to back
            started = [self._start_or_finish(p.request, early.pop(p.request.request_id, None), is_aborted)
                       for p in plan.requests]
            outcomes = tuple(
                RequestOutcome(p.request.request_id, error=AbortedError(f"{p.request.request_id} was aborted"))
                if send is None else self._finish_send(p.request, t, *send)
                for p, t, send in zip(plan.requests, token_ids, started, strict=True)
            )
        finally:
            for span, send in early.values():  # the forward failed: the layers already queued still land
                if isinstance(send, LayerwiseSend):
                    send.cancel()
                span.end()
            for request_id in plan.request_ids:
                table.release(request_id)
        return PrefillOutput(plan.plan_id, outcomes, forward_s)

    def _start_or_finish(
        self, request: PrefillInput, early: tuple[trace.Span, Begun] | None,
        is_aborted: Callable[[str], bool],
    ) -> tuple[trace.Span, Begun] | None:
        """After the forward: the request's write started (or why not), or None when it was aborted.

        A write that went out layer by layer is finished (its last layers queued) even when the
        request was aborted meanwhile: its pages already took layers, which decode's quarantine covers.
        """
        if early is None:
            return None if is_aborted(request.request_id) else self._start_send(request)
        span, send = early
        if isinstance(send, LayerwiseSend):
            try:
                send = send.finish()
            except StageServeError as exc:
                send = exc
        if is_aborted(request.request_id):
            span.end()
            return None
        return span, send

    def _forward_and_sample(
        self, plan: PrefillPlan, early: dict[str, tuple[trace.Span, Begun]]
    ) -> list[int]:
        spans = [
            _tracer.start_span(
                "prefill.forward", context=telemetry.extract_context(p.request.trace_carrier.items()),
                attributes={"request_id": p.request.request_id, "prefill.batch_size": len(plan.requests),
                            "prefill.batch_tokens": plan.num_tokens},
            )
            for p in plan.requests
        ]
        try:
            steps = [self._step(p) for p in plan.requests]
            sends = [send for _, send in early.values() if isinstance(send, LayerwiseSend)]

            def layer_done(layer: int) -> None:
                for send in sends:
                    send.layer_done(layer)

            logits = self.runner.forward(  # [num_requests, vocab] fp32
                ForwardMode.EXTEND, steps, on_layer_kv=layer_done if sends else None
            )
            requests = [p.request for p in plan.requests]
            generators = [make_generator(r.params.seed, self.runner.device) for r in requests]
            return self.sampler.sample(
                logits, [r.params for r in requests], [list(r.token_ids) for r in requests],
                [[] for _ in requests], generators,
            ).tolist()
        finally:
            for span in spans:
                span.end()

    def _step(self, planned: PlannedRequest) -> StepInput:
        request = planned.request
        embeds = None
        if request.num_image_tokens:
            embeds = self.embeddings.rows(planned.row_start, request.num_image_tokens)  # [n, hidden]
            embeds = embeds.to(self.runner.device)  # a host-memory buffer (host-only transfer engine)
        return prefill_step(request, embeds, self.spatial_merge_size)

    def _start_send(self, request: PrefillInput, layerwise: bool = False) -> tuple[trace.Span, Begun]:
        """Open the request's ``kv.transfer`` span and start its write (or keep why it could not start).

        ``layerwise`` (a backend that ``streams_layers``, before the forward): ``start_layerwise``.
        """
        pages = self.runner.page_table.pages(request.request_id)
        span = _tracer.start_span(
            "kv.transfer", context=telemetry.extract_context(request.trace_carrier.items()),
            attributes={"request_id": request.request_id, "kv.num_pages": len(pages),
                        "kv.backend": self.kv_sender.backend, "kv.layerwise": layerwise},
        )
        start = self.kv_sender.start_layerwise if layerwise else self.kv_sender.start
        try:
            return span, start(request.request_id, self.runner.kv_pool, pages, request.kv_dst, request.deadline)
        except StageServeError as exc:
            return span, exc
        except BaseException:
            span.end()
            raise

    def _finish_send(
        self, request: PrefillInput, token_id: int, span: trace.Span, send: Begun
    ) -> RequestOutcome:
        finish_reason = first_token_finish_reason(
            token_id, request.params, request.num_tokens, self.eos_token_ids, self.max_context_len
        )
        try:
            if isinstance(send, StageServeError):
                raise send
            result = send.wait()
        except StageServeError as exc:
            telemetry.mark_error(span, exc)
            logger.warning("KV transfer of %s failed: %s", request.request_id, exc.message)
            return RequestOutcome(request.request_id, token_id, finish_reason, error=exc)
        else:
            span.set_attribute("kv.num_bytes", result.num_bytes)
            return RequestOutcome(request.request_id, token_id, finish_reason, result.num_bytes, result.elapsed_s)
        finally:
            span.end()
