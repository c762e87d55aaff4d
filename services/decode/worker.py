"""The decode rank worker: executes a plan on the model and samples one token per request.

One rank in this issue, living in the leader's process; ``execute(plan) -> result`` is
the whole interface, so more DP ranks can run behind it later.
"""

from __future__ import annotations

import msgspec
import torch

from services.decode.scheduler import DecodeItem, DecodePlan
from services.engine.attention import ForwardMode
from services.engine.model_runner import ModelRunner, StepInput
from services.engine.sampler import Sampler, make_generator


def _positions(position: int) -> torch.Tensor:  # [3, 1] int64: the same position on every M-RoPE axis
    return torch.full((3, 1), position, dtype=torch.long)


class StepResult(msgspec.Struct, frozen=True):
    token_ids: tuple[int, ...]  # one per plan item, in plan order


class DecodeWorker:
    """Runs DECODE steps on one model runner; owns each running request's random generator."""

    def __init__(self, runner: ModelRunner, sampler: Sampler | None = None) -> None:
        self.runner = runner
        self.sampler = sampler or Sampler()
        self.vocab_size = runner.model.config.text.vocab_size
        self._generators: dict[str, torch.Generator] = {}

    @property
    def num_generators(self) -> int:
        return len(self._generators)

    def execute(self, plan: DecodePlan) -> StepResult:
        for request_id in plan.released_request_ids:
            self._generators.pop(request_id, None)
        if not plan.items:
            return StepResult(())
        for item in plan.items:
            if item.is_new and not item.params.is_greedy:
                self._generators[item.request_id] = self._resumed_generator(item)
        steps = [
            StepInput(item.request_id, [item.token_id], _positions(item.position), item.seq_len)
            for item in plan.items
        ]
        logits = self.runner.forward(ForwardMode.DECODE, steps)  # [B, vocab] fp32
        token_ids = self.sampler.sample(
            logits,
            [item.params for item in plan.items],
            [list(item.prompt_ids) for item in plan.items],
            [list(item.output_ids) for item in plan.items],
            [self._generators.get(item.request_id) for item in plan.items],
        )
        return StepResult(tuple(token_ids.tolist()))

    def _resumed_generator(self, item: DecodeItem) -> torch.Generator:
        """The request's generator as the single-process engine holds it after the first token.

        Prefill sampled that token from a fresh ``make_generator(seed)``; skipping one
        draw here makes the tokens after it match the offline engine's.
        """
        generator = make_generator(item.params.seed, self.runner.device)
        self.sampler.skip(generator, self.vocab_size)
        return generator
