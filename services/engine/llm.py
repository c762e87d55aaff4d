"""Offline engine: the whole model in one process (``stageserve generate``).

Request lifecycle:
  admitted  -> pages reserved for the prompt, image embeddings computed (one ViT call
               for every image of the batch) and merged in request-global order
  prefill   -> one EXTEND step over all admitted prompts (ragged), first token sampled
  running   -> DECODE steps; each step reserves one more slot per request, feeds the
               last sampled token and samples the next
  finished  -> EOS / stop token, max_new_tokens, or the context limit; pages released
Pages are released in ``finally``: an error leaves no page held.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.common.errors import CapacityError, InvalidRequestError
from services.common.types import FinishReason, SamplingParams, TokenLogprob, finish_reason
from services.engine.attention import ForwardMode
from services.engine.loader import load_model
from services.engine.model.rope import ImageSpan, mrope_positions
from services.engine.model_runner import KVCacheConfig, ModelRunner
from services.engine.parallel import SINGLE, TensorParallel
from services.engine.quantization import AUTO_KV_CACHE_DTYPE, NO_QUANTIZATION
from services.engine.sampler import Sampler, make_generator
from services.engine.step_inputs import StepInput


@dataclass
class EngineRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    spans: list[ImageSpan] = field(default_factory=list)  # one per image, in prompt order
    pixel_values: list[torch.Tensor] = field(default_factory=list)  # per image [patches, C*T*P*P]


@dataclass
class EngineOutput:
    request_id: str
    token_ids: list[int]
    finish_reason: FinishReason
    num_prompt_tokens: int
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when asked


@dataclass
class _Running:
    request: EngineRequest
    rope_delta: int
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None

    @property
    def seq_len(self) -> int:  # tokens whose KV is (or is being) written
        return len(self.request.prompt_ids) + len(self.output_ids) - 1


class LLMEngine:
    def __init__(self, runner: ModelRunner, max_context_len: int | None = None) -> None:
        self.runner = runner
        self.config = runner.model.config
        self.max_context_len = max_context_len or self.config.text.max_position_embeddings
        self.eos_token_ids = set(self.config.eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids)

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        device: str = "cpu",
        dtype: str | None = None,
        page_size: int = 16,
        num_pages: int = 1024,
        attention_backend: str = "torch",
        tp: TensorParallel = SINGLE,
        quantization: str = NO_QUANTIZATION,
        kv_cache_dtype: str = AUTO_KV_CACHE_DTYPE,
    ) -> LLMEngine:
        model = load_model(model_dir, device=device, dtype=dtype, tp=tp, quantization=quantization)
        kv = KVCacheConfig(num_pages, page_size, dtype=kv_cache_dtype)
        return cls(ModelRunner(model, kv, attention_backend))

    def prompt_logits(self, requests: list[EngineRequest]) -> list[torch.Tensor]:
        """Logits of every prompt position of each request, [prompt_len, vocab] fp32, from one prefill step."""
        with self._reserved(requests):
            embeds = self.image_embeddings(requests)
            steps = [self.prefill_input(r, e)[0] for r, e in zip(requests, embeds, strict=True)]
            logits = self.runner.forward(ForwardMode.EXTEND, steps, all_logits=True)
            return list(logits.split([len(r.prompt_ids) for r in requests]))

    def generate(self, requests: list[EngineRequest]) -> list[EngineOutput]:
        with self._reserved(requests):
            running = self._prefill(requests)
            active = [s for s in running if s.finish_reason is None]
            while active:
                self._decode_step(active)
                active = [s for s in active if s.finish_reason is None]
            return [self._output(s) for s in running]

    @contextlib.contextmanager
    def _reserved(self, requests: list[EngineRequest]) -> Iterator[None]:
        """Validate, reserve the prompts' pages (all or none), and release every page on exit."""
        for r in requests:
            self.validate(r)
        if len({r.request_id for r in requests}) != len(requests):
            raise InvalidRequestError(
                "request ids in one call must be distinct", param="request_id"
            )
        table, manager = self.runner.page_table, self.runner.page_manager
        needed = sum(table.num_pages_needed(r.request_id, len(r.prompt_ids)) for r in requests)
        if not manager.can_allocate(needed):
            raise CapacityError(f"{needed} KV pages needed, {manager.num_free_pages} free")
        try:
            for r in requests:
                table.reserve(r.request_id, len(r.prompt_ids))
            yield
        finally:
            for r in requests:
                if r.request_id in table:
                    table.release(r.request_id)

    def validate(self, request: EngineRequest) -> None:
        request.params.validate()
        if not request.prompt_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if len(request.prompt_ids) >= self.max_context_len:
            raise InvalidRequestError(
                f"the prompt has {len(request.prompt_ids)} tokens; the context limit is {self.max_context_len}",
                param="messages",
            )
        if len(request.spans) != len(request.pixel_values):
            raise InvalidRequestError("each image span needs its pixel values", param="images")
        vocab = self.config.text.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_ids):
            raise InvalidRequestError(f"token ids must be in [0, {vocab})", param="prompt")

    def image_embeddings(self, requests: list[EngineRequest]) -> list[torch.Tensor | None]:
        grids = [span.grid_thw for r in requests for span in r.spans]
        if not grids:
            return [None] * len(requests)
        pixels = torch.cat([p for r in requests for p in r.pixel_values])
        embeds = self.runner.encode_images(pixels, grids)  # [sum image tokens, hidden]
        sizes = [sum(span.length for span in r.spans) for r in requests]
        return list(embeds.split(sizes))

    def prefill_input(
        self, request: EngineRequest, image_embeds: torch.Tensor | None
    ) -> tuple[StepInput, int]:
        merge = self.config.vision.spatial_merge_size
        positions, delta = mrope_positions(len(request.prompt_ids), request.spans, merge)
        rows = [span.offset + i for span in request.spans for i in range(span.length)]
        for row in rows:
            if request.prompt_ids[row] != self.config.image_token_id:
                raise InvalidRequestError(
                    f"image span covers non-image token at {row}", param="images"
                )
        step = StepInput(
            request.request_id, request.prompt_ids, positions, 0, image_embeds, rows or None
        )
        return step, delta

    def _prefill(self, requests: list[EngineRequest]) -> list[_Running]:
        steps, running = [], []
        for request, embeds in zip(requests, self.image_embeddings(requests), strict=True):
            step, delta = self.prefill_input(request, embeds)
            steps.append(step)
            generator = make_generator(request.params.seed, self.runner.device)
            running.append(_Running(request, delta, generator))
        logits = self.runner.forward(ForwardMode.EXTEND, steps)
        self._sample(running, logits)
        return running

    def _decode_step(self, active: list[_Running]) -> None:
        steps = []
        for s in active:
            self.runner.page_table.reserve(s.request.request_id, s.seq_len + 1)
            position = torch.full((3, 1), s.seq_len + s.rope_delta, dtype=torch.long)
            steps.append(StepInput(s.request.request_id, [s.output_ids[-1]], position, s.seq_len))
        self._sample(active, self.runner.forward(ForwardMode.DECODE, steps))

    def _sample(self, running: list[_Running], logits: torch.Tensor) -> None:
        sampled = self.sampler.sample(
            logits,
            [s.request.params for s in running],
            [s.request.prompt_ids for s in running],
            [s.output_ids for s in running],
            [s.generator for s in running],
        )
        asks = [
            (row, s.request.params.num_top_logprobs)
            for row, s in enumerate(running)
            if s.request.params.return_logprobs
        ]
        rows = self.sampler.logprobs(logits, sampled, asks)
        if rows is not None:
            for row, logprob in zip(rows.rows, rows.to_list(), strict=True):
                running[row].logprobs.append(logprob)
        for s, token in zip(running, sampled.tolist(), strict=True):
            s.output_ids.append(token)
            s.finish_reason = finish_reason(
                s.request.params,
                token,
                len(s.request.prompt_ids),
                len(s.output_ids),
                self.eos_token_ids,
                self.max_context_len,
            )

    @staticmethod
    def _output(s: _Running) -> EngineOutput:
        assert s.finish_reason is not None
        return EngineOutput(
            s.request.request_id,
            s.output_ids,
            s.finish_reason,
            len(s.request.prompt_ids),
            s.logprobs,
        )
