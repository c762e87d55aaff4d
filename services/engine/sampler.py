"""The batched sampler.

Logits pass through, in order: repetition penalty (prompt + output tokens,
HF-style), frequency and presence penalties (output tokens, OpenAI-style), logit bias,
the min_tokens mask (EOS and stop tokens out until min_tokens were generated),
temperature, top-k, top-p, min-p. Greedy rows (temperature 0) take the argmax of the
penalized logits. Random rows draw their noise only from their own generator, so a
seeded request gets the same tokens whatever else is in the batch.

Logprobs (``logprobs``) are raw: the log-softmax of the logits the sampler got, before
any of the above (vLLM's default ``raw_logprobs``), computed only for the rows that ask.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from services.common.types import TokenLogprob

if TYPE_CHECKING:
    from services.common.types import SamplingParams


@dataclass(frozen=True)
class LogprobRows:
    """The logprobs of the batch rows whose request asked for them, on one device."""

    rows: tuple[int, ...]  # batch rows, ascending
    num_top: tuple[int, ...]  # each row's num_top_logprobs
    token_ids: torch.Tensor  # [R] int64: the sampled tokens
    logprobs: torch.Tensor  # [R] float32: their logprobs
    top_ids: torch.Tensor  # [R, K] int64, K = max(num_top)
    top_logprobs: torch.Tensor  # [R, K] float32, descending per row

    def to_host(self) -> LogprobRows:
        """A copy on the CPU, queued without waiting (pinned memory from CUDA): read it once the
        stream's work up to here has finished."""
        tensors = (self.token_ids, self.logprobs, self.top_ids, self.top_logprobs)
        host = [t.to("cpu", non_blocking=True) for t in tensors]
        return LogprobRows(self.rows, self.num_top, *host)

    def to_list(self) -> list[TokenLogprob]:
        """One ``TokenLogprob`` per row of ``rows``, each with its own number of top tokens."""
        token_ids, logprobs = self.token_ids.tolist(), self.logprobs.tolist()
        top_ids, top_logprobs = self.top_ids.tolist(), self.top_logprobs.tolist()
        return [
            TokenLogprob(
                token_ids[j], logprobs[j], tuple(top_ids[j][:k]), tuple(top_logprobs[j][:k])
            )
            for j, k in enumerate(self.num_top)
        ]


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A generator on ``device`` seeded with ``seed``, or from ``os.urandom`` when ``seed`` is None."""
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little")
    generator = torch.Generator(device=torch.device(device))
    generator.manual_seed(seed)
    return generator


def _row_token_mask(
    token_ids: list[list[int]], vocab_size: int, device: torch.device, *, counts: bool
) -> torch.Tensor:  # [B, V] float32: occurrence counts, or 1.0 where present
    rows = [r for r, ids in enumerate(token_ids) for _ in ids]
    cols = [t for ids in token_ids for t in ids]
    out = torch.zeros(len(token_ids), vocab_size, dtype=torch.float32, device=device)
    if not cols:
        return out
    assert 0 <= min(cols) and max(cols) < vocab_size, f"token id outside vocab of {vocab_size}"
    index = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))
    ones = torch.ones(len(cols), dtype=torch.float32, device=device)
    if counts:
        return out.index_put_(index, ones, accumulate=True)
    return out.index_put_(index, ones)


def _column(values: list[float], logits: torch.Tensor) -> torch.Tensor:  # [B, 1] float32
    return torch.tensor(values, dtype=torch.float32, device=logits.device).unsqueeze(1)


class Sampler:
    """Turns one step's logits into one token per row.

    ``eos_token_ids``: the model's EOS ids, masked (with each request's stop tokens) until the
    request has generated ``min_tokens`` tokens.
    """

    def __init__(self, eos_token_ids: Collection[int] = ()) -> None:
        self.eos_token_ids = tuple(sorted(eos_token_ids))

    def apply_penalties(
        self,
        logits: torch.Tensor,  # [B, V]
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[
            list[int]
        ],  # each request's output so far (its length counts for min_tokens)
    ) -> torch.Tensor:  # [B, V] float32, a new tensor
        vocab_size = logits.shape[1]
        is_prompt = counts = None
        if any(p.repetition_penalty != 1.0 for p in params):
            is_prompt = _row_token_mask(prompt_ids, vocab_size, logits.device, counts=False) > 0
        if is_prompt is not None or any(
            p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params
        ):
            counts = _row_token_mask(output_ids, vocab_size, logits.device, counts=True)
        return self.apply_penalty_tensors(
            logits, params, is_prompt, counts, [len(ids) for ids in output_ids]
        )

    def apply_penalty_tensors(
        self,
        logits: torch.Tensor,  # [B, V]
        params: list[SamplingParams],
        is_prompt: torch.Tensor
        | None,  # [B, V] bool: in the prompt; needed when a row has a repetition penalty
        output_counts: torch.Tensor
        | None,  # [B, V] float32: occurrences in the output; needed with any penalty
        num_output_ids: list[int],  # tokens each request has generated so far (for min_tokens)
    ) -> torch.Tensor:  # [B, V] float32, a new tensor
        """``apply_penalties`` from token histories already held as tensors (a decode loop's, on the
        device)."""
        logits = logits.float().clone()
        if any(p.repetition_penalty != 1.0 for p in params):
            assert is_prompt is not None and output_counts is not None
            is_seen = is_prompt | (output_counts > 0)
            penalty = _column([p.repetition_penalty for p in params], logits)
            penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(is_seen, penalized, logits)
        if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
            assert output_counts is not None
            logits -= _column([p.frequency_penalty for p in params], logits) * output_counts
            logits -= (
                _column([p.presence_penalty for p in params], logits) * (output_counts > 0).float()
            )
        for row, p in enumerate(params):
            if p.logit_bias:
                token_ids = torch.tensor([t for t, _ in p.logit_bias], device=logits.device)
                biases = torch.tensor(
                    [b for _, b in p.logit_bias], dtype=torch.float32, device=logits.device
                )
                logits[row].index_add_(0, token_ids, biases)
            if num_output_ids[row] < p.min_tokens:
                banned = [*p.stop_token_ids, *(() if p.ignore_eos else self.eos_token_ids)]
                if banned:
                    logits[row, torch.tensor(banned, device=logits.device)] = float("-inf")
        return logits

    def apply_temperature_and_filters(
        self,
        logits: torch.Tensor,  # [B, V] float32
        params: list[SamplingParams],
    ) -> torch.Tensor:  # [B, V] float32, filtered-out tokens at -inf
        vocab_size = logits.shape[1]
        temperature = _column([p.temperature if p.temperature > 0 else 1.0 for p in params], logits)
        logits = logits / temperature
        needs_top_k = any(p.top_k > 0 for p in params)
        needs_top_p = any(p.top_p < 1.0 for p in params)
        if needs_top_k or needs_top_p:
            sorted_logits, sorted_ids = logits.sort(dim=1, descending=True)  # [B, V]
            rank = torch.arange(vocab_size, device=logits.device).unsqueeze(0)  # [1, V]
            top_k = _column([p.top_k if p.top_k > 0 else vocab_size for p in params], logits)
            is_removed = rank >= top_k  # [B, V] in sorted order
            sorted_logits = sorted_logits.masked_fill(is_removed, float("-inf"))
            if needs_top_p:
                sorted_probs = sorted_logits.softmax(dim=1)
                mass_before = (
                    sorted_probs.cumsum(dim=1) - sorted_probs
                )  # mass of higher-ranked tokens
                top_p = _column([p.top_p for p in params], logits)
                is_removed |= (mass_before > top_p) & (top_p < 1.0)
            is_removed_orig = torch.zeros_like(is_removed).scatter_(1, sorted_ids, is_removed)
            logits = logits.masked_fill(is_removed_orig, float("-inf"))
        if any(p.min_p > 0.0 for p in params):
            probs = logits.softmax(dim=1)
            min_p = _column([p.min_p for p in params], logits)
            threshold = min_p * probs.max(dim=1, keepdim=True).values  # [B, 1]
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        return logits

    def process_logits(
        self,
        logits: torch.Tensor,  # [B, V]
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
    ) -> torch.Tensor:  # [B, V] float32
        """The logits the random rows sample from: penalties, temperature and filters applied."""
        penalized = self.apply_penalties(logits, params, prompt_ids, output_ids)
        return self.apply_temperature_and_filters(penalized, params)

    def sample(
        self,
        logits: torch.Tensor,  # [B, V] float
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:  # [B] int64
        """One token per row; row ``i`` draws randomness only from ``generators[i]`` (None: global RNG)."""
        assert logits.dim() == 2 and len(params) == logits.shape[0] == len(generators)
        penalized = self.apply_penalties(logits, params, prompt_ids, output_ids)
        return self.sample_penalized(penalized, params, generators)

    def sample_penalized(
        self,
        penalized: torch.Tensor,  # [B, V] float32, penalties applied
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
    ) -> torch.Tensor:  # [B] int64, on the logits' device
        """The tokens of ``sample`` once penalties are applied: argmax for greedy rows, else a draw.

        Rows with a generator draw their noise from it alone; the rows without one share one
        draw from the device's global generator.
        """
        token_ids = penalized.argmax(dim=1)  # [B], final for greedy rows
        random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
        if not random_rows:
            return token_ids
        row_index = torch.tensor(random_rows, device=penalized.device)
        filtered = self.apply_temperature_and_filters(
            penalized[row_index], [params[i] for i in random_rows]
        )
        probs = filtered.softmax(dim=1)  # [R, V]
        noise = torch.empty_like(probs)
        shared = [j for j, i in enumerate(random_rows) if generators[i] is None]
        if shared:
            noise[shared] = self._exponential_noise(probs[shared], None)
        for j, i in enumerate(random_rows):
            if generators[i] is not None:
                noise[j] = self._exponential_noise(probs[j], generators[i])
        token_ids[row_index] = (probs / noise).argmax(dim=1)
        return token_ids

    def logprobs(
        self,
        logits: torch.Tensor,  # [B, V]: the logits the rows were sampled from
        token_ids: torch.Tensor,  # [B] int64: the sampled tokens
        asks: Sequence[tuple[int, int]],  # (row, num_top_logprobs) of each row that asks
    ) -> LogprobRows | None:
        """The raw logprobs of the asking rows (None when none asks): nothing is computed for
        the other rows."""
        if not asks:
            return None
        rows = tuple(row for row, _ in asks)
        num_top = tuple(k for _, k in asks)
        index = torch.tensor(rows, device=logits.device)
        logprobs = logits[index].float().log_softmax(dim=1)  # [R, V]
        chosen = token_ids[index]
        top_logprobs, top_ids = logprobs.topk(max(num_top), dim=1)  # [R, K], sorted
        token_logprobs = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)  # [R]
        return LogprobRows(rows, num_top, chosen, token_logprobs, top_ids, top_logprobs)

    def skip(self, generator: torch.Generator, vocab_size: int) -> None:
        """Advance ``generator`` past the draw ``sample`` makes for one random row of ``vocab_size`` logits.

        A service that continues a request sampled elsewhere (decode after prefill's first
        token) skips that draw so a seeded request matches the single-process engine.
        """
        like = torch.empty(vocab_size, dtype=torch.float32, device=generator.device)
        self._exponential_noise(like, generator)

    @staticmethod
    def _exponential_noise(like: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        noise = torch.empty_like(like).exponential_(1.0, generator=generator)  # [V] float32
        return noise.clamp_min_(
            torch.finfo(noise.dtype).tiny
        )  # 0 noise would make 0/0 = nan win argmax
