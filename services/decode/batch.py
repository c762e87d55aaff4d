"""The decode loop's device side: per-slot state in persistent buffers, steps read one step late.

A running request owns one batch slot while it runs (``DecodePlan.slots``). Per slot the
runner keeps, on the device, the newest token (the next step's input), the sampling
parameters' token histories (output counts and the prompt mask, only once a penalized
request runs) and, on the host, the page table row. A step (``launch``) gathers the rows'
input tokens on the device, runs the forward, samples on the device, scatters the samples
back into the slots and starts one copy of them to pinned host memory; nothing waits for
the device. ``read`` waits for that copy alone. Rows whose request asked for logprobs get
them from the step's logits (the ones the graph returned, outside it) and copied with the
tokens; a step where no row asks computes none. Rows under a grammar (structured outputs) are
masked on the device right after the forward; their matchers accept a step's tokens at the
next launch, once that step's forward is queued, so the host waits for the tokens and fills
the next masks while the device runs the forward instead of stopping the overlap.

``StepLoop`` is the loop both the decode rank and the engine benchmark run: each ``step``
launches a plan, then reads the oldest step not read: overlapped, the previous one (the
host plans step N+1 while the device runs step N; a token a step produced after its
request's stop is read and dropped by the scheduler); synchronous, the one just launched.
Both produce the same tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from services.common.errors import InvalidRequestError
from services.common.types import Grammar, SamplingParams, TokenLogprob
from services.decode.scheduler import DecodePlan, JoinedRow, uses_history
from services.decode.tp_mirror import StepMirror
from services.engine.grammar import GrammarCache, GrammarMasks
from services.engine.model_runner import ModelRunner
from services.engine.sampler import LogprobRows, Sampler, make_generator
from services.engine.step_inputs import DecodeInputs

NUM_HOST_BUFFERS = 2  # one step being copied while the previous one is read


@dataclass(frozen=True)
class _Unaccepted:
    """A launched step's constrained rows, whose matchers have not accepted its tokens yet."""

    matchers: list[tuple[int, Any]]  # (batch row, GrammarMatcher)
    host_tokens: torch.Tensor  # the step's samples once ``copied``
    copied: torch.cuda.Event | None


@dataclass(frozen=True)
class LaunchedStep:
    plan: DecodePlan
    host_tokens: torch.Tensor  # [B] int64 (pinned on CUDA): the step's samples once ``copied``
    copied: torch.cuda.Event | None  # None on CPU: the copy is done when ``launch`` returns
    launch_s: float  # time.monotonic() when it was launched
    logprobs: LogprobRows | None = None  # on the host once ``copied``; None: no row asked


def is_plain(params: SamplingParams) -> bool:
    """Greedy with nothing to apply before the argmax."""
    return (
        params.is_greedy
        and not uses_history(params)
        and not params.logit_bias
        and params.min_tokens == 0
        and params.grammar is None
    )


class DecodeBatchRunner:
    """Runs DECODE steps of a running batch on one model runner; the only owner of the slot
    state."""

    def __init__(
        self,
        runner: ModelRunner,
        sampler: Sampler,
        num_slots: int,
        max_pages_per_slot: int,
        grammars: GrammarCache | None = None,
        mirror: StepMirror | None = None,
    ) -> None:
        """``grammars``: the grammars of constrained requests (None: such a request fails);
        ``mirror``: a tensor-parallel rank's followers, sent every step's inputs first."""
        self.runner = runner
        self.mirror = mirror
        self.grammars = grammars
        self._matchers: dict[int, Any] = {}  # slot -> its request's GrammarMatcher
        self._masks: GrammarMasks | None = None  # once a constrained request runs
        # the last step's constrained rows: their matchers accept its tokens at the next launch
        self._unaccepted: _Unaccepted | None = None
        self.sampler = sampler
        self.device = runner.device
        self.page_size = runner.page_size
        self.vocab_size = runner.model.config.text.vocab_size
        self._last_tokens = torch.zeros(
            num_slots, dtype=torch.long, device=self.device
        )  # [S] int64
        self._page_table = np.zeros((num_slots, max_pages_per_slot), dtype=np.int64)  # [S, P] host
        self._pages: list[list[int]] = [[] for _ in range(num_slots)]
        self._params: list[SamplingParams] = [SamplingParams(temperature=0.0)] * num_slots
        self._is_plain = np.ones(num_slots, dtype=bool)
        self._num_top_logprobs = np.full(num_slots, -1, dtype=np.int64)  # -1: no logprobs
        self._generators: dict[
            int, torch.Generator
        ] = {}  # slot -> a seeded random request's generator
        self._output_counts: torch.Tensor | None = None  # [S, V] float32 on the device, once needed
        self._is_prompt: torch.Tensor | None = None  # [S, V] bool on the device, once needed
        is_cuda = self.device.type == "cuda"
        self._host = [
            torch.zeros(num_slots, dtype=torch.long, pin_memory=is_cuda)
            for _ in range(NUM_HOST_BUFFERS)
        ]
        self._events = [torch.cuda.Event() if is_cuda else None for _ in range(NUM_HOST_BUFFERS)]
        self._next_buffer = 0
        # The step's slot indices go up through pinned memory (a pageable upload may wait for the
        # stream); the staging is rewritten only once the previous upload has left it.
        self._slots_host = torch.zeros(num_slots, dtype=torch.long, pin_memory=is_cuda)
        self._slots = torch.zeros(num_slots, dtype=torch.long, device=self.device)  # [S] int64
        self._slots_staged = torch.cuda.Event() if is_cuda else None

    @torch.inference_mode()
    def launch(
        self, plan: DecodePlan, before_launch: Callable[[], None] | None = None
    ) -> LaunchedStep:
        """Queue ``plan``'s forward, sampling and the copy of its samples to the host.

        ``before_launch``: called once the step's host work is done, right before its forward
        is launched (``ModelRunner.forward_decode``); the step's launch time is taken after it."""
        launch_s = time.monotonic()
        gate = None
        if before_launch is not None:

            def gate() -> None:
                nonlocal launch_s
                before_launch()
                launch_s = time.monotonic()

        if plan.joined:
            self._join(plan.joined)
        slots = self._upload_slots(plan.slots)  # [B] int64 on the device
        inputs = self._inputs(plan, slots)
        if self.mirror is not None:  # the followers run the same forward on their shards
            self.mirror.send(inputs)
        logits = self.runner.forward_decode(inputs, gate)  # [B, V] fp32
        self._accept_unaccepted()  # the previous step's, while the device runs this forward
        tokens, matchers = self._sample(plan, slots, logits)  # [B] int64 on the device
        self._last_tokens.index_copy_(0, slots, tokens)
        if self._output_counts is not None:
            ones = torch.ones(plan.num_rows, dtype=torch.float32, device=self.device)
            self._output_counts.index_put_((slots, tokens), ones, accumulate=True)
        buffer = self._next_buffer
        self._next_buffer = (buffer + 1) % NUM_HOST_BUFFERS
        host = self._host[buffer][: plan.num_rows]
        host.copy_(tokens, non_blocking=True)
        logprobs = self._logprobs(plan, logits, tokens)
        event = self._events[buffer]
        if event is not None:
            event.record()
        if matchers:
            self._unaccepted = _Unaccepted(matchers, host, event)
        return LaunchedStep(plan, host, event, launch_s, logprobs)

    def read(self, launched: LaunchedStep) -> list[int]:
        """The step's sampled tokens, in row order (waits for their copy only)."""
        if launched.copied is not None:
            launched.copied.synchronize()
        return launched.host_tokens.tolist()

    def read_logprobs(self, launched: LaunchedStep) -> dict[str, TokenLogprob]:
        """The logprobs of the step's rows that asked, by request id (after ``read``)."""
        rows = launched.logprobs
        if rows is None:
            return {}
        request_ids = launched.plan.request_ids
        return dict(zip([request_ids[r] for r in rows.rows], rows.to_list(), strict=True))

    def _logprobs(
        self, plan: DecodePlan, logits: torch.Tensor, tokens: torch.Tensor
    ) -> LogprobRows | None:
        num_top = self._num_top_logprobs[plan.slots]  # [B]
        asks = [(int(row), int(num_top[row])) for row in np.flatnonzero(num_top >= 0)]
        rows = self.sampler.logprobs(logits, tokens, asks)
        return None if rows is None else rows.to_host()

    def grammar_matcher(self, grammar: Grammar, first_token_id: int) -> Any:
        """A matcher for ``grammar`` that has accepted prefill's first token (replayed, so its
        state is exact); ``InvalidRequestError`` when the grammar rejects that token."""
        if self.grammars is None:
            raise InvalidRequestError("this decode rank samples no grammars", param="grammar")
        matcher = self.grammars.matcher(grammar)
        if not matcher.accept_token(first_token_id):
            raise InvalidRequestError(
                f"first_token_id {first_token_id} is not allowed by the request's grammar",
                param="first_token_id",
            )
        return matcher

    def synchronize(self) -> None:
        """Wait until the device finished everything queued (before pages of abandoned steps are
        reused); the last step's tokens, abandoned, are accepted by no grammar."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._unaccepted = None

    def _accept_unaccepted(self) -> None:
        """The last launched step's constrained rows accept its tokens (waits for their copy):
        their grammars' next masks depend on them."""
        unaccepted, self._unaccepted = self._unaccepted, None
        if unaccepted is None:
            return
        if unaccepted.copied is not None:
            unaccepted.copied.synchronize()
        assert self._masks is not None
        rows, matchers = zip(*unaccepted.matchers, strict=True)
        self._masks.accept(matchers, unaccepted.host_tokens[list(rows)].tolist())

    def _upload_slots(self, slots: np.ndarray) -> torch.Tensor:
        if self._slots_staged is None:  # CPU: the array itself
            return torch.from_numpy(slots)
        n = len(slots)
        self._slots_staged.synchronize()
        self._slots_host[:n] = torch.from_numpy(slots)
        self._slots[:n].copy_(
            self._slots_host[:n], non_blocking=True
        )  # after the last step's reads of it
        self._slots_staged.record()
        return self._slots[:n]

    def _to_device(self, values: list[int] | tuple[int, ...]) -> torch.Tensor:
        """A small int64 tensor on the device, uploaded from (cached) pinned memory on CUDA."""
        tensor = torch.tensor(values, dtype=torch.long)
        if self.device.type != "cuda":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _join(self, joined: tuple[JoinedRow, ...]) -> None:
        slots = self._to_device([row.slot for row in joined])
        self._last_tokens.index_copy_(
            0, slots, self._to_device([row.first_token_id for row in joined])
        )
        for row in joined:
            slot = row.slot
            assert len(row.pages) <= self._page_table.shape[1], "more pages than a slot holds"
            self._pages[slot] = row.pages
            self._page_table[slot, : len(row.pages)] = row.pages
            self._params[slot] = row.params
            self._is_plain[slot] = is_plain(row.params)
            wants = row.params.return_logprobs
            self._num_top_logprobs[slot] = row.params.num_top_logprobs if wants else -1
            self._generators.pop(slot, None)
            self._matchers.pop(slot, None)
            if row.params.grammar is not None:
                self._matchers[slot] = self.grammar_matcher(row.params.grammar, row.first_token_id)
            if not row.params.is_greedy and row.params.seed is not None:
                self._generators[slot] = self._resumed_generator(row.params.seed)
            if uses_history(row.params):
                self._reset_history(slot, row)

    def _resumed_generator(self, seed: int) -> torch.Generator:
        """The request's generator as the single-process engine holds it after the first token.

        Prefill sampled that token from a fresh ``make_generator(seed)``; skipping one draw
        makes the tokens after it match the offline engine's.
        """
        generator = make_generator(seed, self.device)
        self.sampler.skip(generator, self.vocab_size)
        return generator

    def _reset_history(self, slot: int, row: JoinedRow) -> None:
        if self._output_counts is None:
            shape = (len(self._pages), self.vocab_size)
            self._output_counts = torch.zeros(shape, dtype=torch.float32, device=self.device)
            self._is_prompt = torch.zeros(shape, dtype=torch.bool, device=self.device)
        assert self._is_prompt is not None
        self._output_counts[slot].zero_()
        self._output_counts[slot, row.first_token_id] = 1.0
        self._is_prompt[slot].zero_()
        if row.prompt_ids:
            self._is_prompt[slot, self._to_device(row.prompt_ids)] = True

    def _inputs(self, plan: DecodePlan, slots: torch.Tensor) -> DecodeInputs:
        page_size = self.page_size
        positions = torch.from_numpy(plan.positions).unsqueeze(0).repeat(3, 1)  # [3, B] int64
        pages = self._page_table[
            plan.slots, plan.seq_lens // page_size
        ]  # [B] the new position's page
        out_slots = torch.from_numpy(pages * page_size + plan.seq_lens % page_size)
        page_tables = [self._pages[slot] for slot in plan.slots.tolist()]
        seq_lens = (plan.seq_lens + 1).tolist()
        return DecodeInputs(self._last_tokens[slots], positions, seq_lens, page_tables, out_slots)

    def _sample(
        self, plan: DecodePlan, slots: torch.Tensor, logits: torch.Tensor
    ) -> tuple[torch.Tensor, list[tuple[int, Any]]]:
        """The step's tokens [B] on the device, and its constrained rows (batch row, matcher):
        their matchers accept the tokens at the next launch, once its forward is queued
        (``_accept_unaccepted``): the host fills the next masks while the device runs it."""
        if self._is_plain[plan.slots].all():
            return logits.argmax(dim=1), []
        slot_list = plan.slots.tolist()
        params = [self._params[slot] for slot in slot_list]
        is_prompt = counts = None
        if self._output_counts is not None and any(uses_history(p) for p in params):
            assert self._is_prompt is not None
            is_prompt, counts = self._is_prompt[slots], self._output_counts[slots]
        penalized = self.sampler.apply_penalty_tensors(
            logits, params, is_prompt, counts, plan.num_output_ids.tolist()
        )
        generators = [self._generators.get(slot) for slot in slot_list]
        matchers = [
            (row, self._matchers[slot])
            for row, slot in enumerate(slot_list)
            if params[row].grammar is not None
        ]
        if matchers:
            if self._masks is None:
                self._masks = GrammarMasks(len(self._pages), self.vocab_size, self.device)
            self._masks.apply(penalized, matchers)
        tokens = self.sampler.sample_penalized(penalized, params, generators)
        return tokens, matchers


class StepLoop:
    """Launch a step, read the oldest unread one: the previous (overlapped) or itself
    (synchronous)."""

    def __init__(self, batch: DecodeBatchRunner, is_overlapped: bool = True) -> None:
        self.batch = batch
        self.is_overlapped = is_overlapped
        self._unread: LaunchedStep | None = None
        self.last_launched_step = -1

    @property
    def has_unread(self) -> bool:
        return self._unread is not None

    def step(
        self, plan: DecodePlan | None, before_launch: Callable[[], None] | None = None
    ) -> tuple[LaunchedStep, list[int]] | None:
        """Launch ``plan`` (None: nothing to launch), then read; the step read and its tokens.

        ``before_launch``: see ``DecodeBatchRunner.launch`` (not called without a plan)."""
        launched = None
        if plan is not None:
            launched = self.batch.launch(plan, before_launch)
            self.last_launched_step = plan.step
        if self.is_overlapped:
            to_read, self._unread = self._unread, launched
        else:
            to_read = launched
        if to_read is None:
            return None
        return to_read, self.batch.read(to_read)

    def reset(self) -> None:
        """Forget the unread step (after a failure), once the device has finished it."""
        self.batch.synchronize()
        self._unread = None
