"""Rank worker: executes one ``RankPlan`` on this rank's model and hands its KV pages to decode.

``execute(plan)``: drop the cached pages the leader evicted -> give every request its
cached prefix's pages and reserve local pages for the rest -> run the plan's passes in
order (from the first uncached token; a long prompt's chunks: each pass sees the earlier
chunks' KV as its prefix), each whole or, for a sharded plan, as this rank's CP shard
(``passes.build_pass``, per layer an all-gather of K/V through
``ContextParallelAttention``) -> sample the first token of each request whose last token
is here -> write this rank's share of each request's pages, cached ones included
(``handoff.KvHandoff``) -> keep the pages the leader named for the cache and free the
rest (``finally``). A rank that fails mid-pass poisons the pass's remaining all-gathers;
its peers see the flag when the pass ends and stop without sampling or writing
(``peer_failed``), and keep nothing. With an MoE model's experts split over the CP ranks
(``lockstep.py``) every rank runs every pass, a plan's solo rank's too, and a rank that
fails mid-pass poisons nothing: its peers wait in that layer's collectives until they time
out, and the group re-forms (``PrefillRankStep.on_failed``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from services.common.deadlines import mono_of_unix_s
from services.common.errors import InvalidRequestError
from services.common.gpu_share import GpuShare
from services.common.types import SamplingParams, TokenLogprob
from services.engine import ops
from services.engine.attention.context_parallel import ContextParallelAttention, CpShard, KvExchange
from services.engine.grammar import GrammarCache, apply_grammar_masks
from services.engine.model_runner import ModelRunner
from services.engine.sampler import Sampler, make_generator
from services.prefill.handoff import KvHandoff
from services.prefill.lockstep import expert_lockstep
from services.prefill.messages import SHARDED, RankOutcome, RankPlan, RankRequest
from services.prefill.passes import PassInput, RequestRows, build_pass, request_rows
from services.prefill.prefix_pages import PageStore, PrefixPages
from services.transfer.base import BaseKVSender
from services.transfer.embeddings import EmbeddingBuffer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlanOutcome:
    outcomes: tuple[RankOutcome, ...]  # plan order; () when this rank did not run the plan
    forward_s: float = 0.0
    peer_failed: bool = False


class PrefillRankWorker:
    """Executes plans on one rank's ``ModelRunner``: ``rank`` of ``world_size`` CP ranks, ``group``
    the CP device group (None: C = 1).

    Under tensor parallelism each CP rank is a TP group: its ranks get the same plans, hold the
    same pages and run the same passes on their own heads; the first (``tp_rank`` 0) samples the
    first tokens and reports logprobs, and each writes its heads of the KV to decode unless
    another rank of the group holds the same heads (``writes_kv`` False: replicated KV heads).
    """

    def __init__(
        self,
        runner: ModelRunner,
        kv_sender: BaseKVSender,
        embeddings: EmbeddingBuffer,
        rank: int = 0,
        world_size: int = 1,
        group: object = None,
        exchange_device: str | None = None,
        gpu_share: GpuShare | None = None,
        grammars: GrammarCache | None = None,
        num_host_pages: int = 0,
        store: PageStore | None = None,
        tp_rank: int = 0,
        writes_kv: bool = True,
        share_slot: int | None = None,
    ) -> None:
        """``share_slot``: this process's slot in ``gpu_share`` (default ``rank``);
        ``gpu_share``: where this rank marks its forwards for a decode on the same GPU;
        ``grammars``: the grammars of constrained requests (None: such a request fails);
        ``num_host_pages``: the prefix cache's host tier (0: none); ``store``: the KV store
        shared with other prefill workers (None: none)."""
        self.grammars = grammars
        config = runner.model.config
        self.gpu_share = gpu_share
        self.runner = runner
        self.kv_sender = kv_sender
        self.embeddings = embeddings
        self.rank, self.world_size, self.group = rank, world_size, group
        self.samples, self.writes_kv = tp_rank == 0, writes_kv
        # inside a plan's passes (their collectives): a failure there leaves this rank's
        # tensor- or expert-parallel collectives out of step with its peers'
        self.in_passes = False
        self.share_slot = rank if share_slot is None else share_slot
        self.exchange_device = torch.device(exchange_device) if exchange_device else runner.device
        self.spatial_merge_size = config.vision.spatial_merge_size
        self.sampler = Sampler(config.eos_token_ids)
        self.cp_attention = ContextParallelAttention(runner.attention, runner.kv_pool)
        # K and V of this rank's KV heads, per token
        self._kv_width = 2 * runner.kv_pool.num_kv_heads * config.text.head_dim
        self.prefix = PrefixPages(runner.page_table, runner.kv_pool, num_host_pages, store)
        self.lockstep = expert_lockstep(runner, world_size)  # None: no collective in the MLPs
        kv_sender.register(runner.kv_pool)

    def execute(self, plan: RankPlan, write_kv: bool = True) -> PlanOutcome:
        """Run ``plan`` if it is this rank's; KV write failures become error outcomes, the rest
        raises.

        ``write_kv`` False (warm-up): forward and sample only.
        """
        if plan.moves:
            self.prefix.apply(plan.moves[self.rank])
        if plan.solo_rank not in (SHARDED, self.rank):
            self._idle(plan)
            return PlanOutcome(())
        sharded = plan.solo_rank == SHARDED and self.world_size > 1
        shard = (
            CpShard(self.rank, self.world_size, plan.block_tokens) if sharded else CpShard(0, 1, 1)
        )
        deadlines = {r.request_id: mono_of_unix_s(r.deadline_unix_s) for r in plan.requests}
        handoff = KvHandoff(
            self.runner, self.kv_sender, shard.rank, shard.world_size, deadlines, self.writes_kv
        )
        computed = False  # every pass ran here: the pages hold whole KV
        try:
            for request in plan.requests:
                self.prefix.lend(request.request_id, request.prefix_keys, request.num_tokens)
            if write_kv and self.kv_sender.streams_layers and len(plan.passes) == 1:
                handoff.begin_layerwise(plan.requests)
            start = time.perf_counter()
            with self._marking():
                sampled = self._run(plan, shard, handoff)
            forward_s = time.perf_counter() - start
            if sampled is None:
                return PlanOutcome((), forward_s, peer_failed=True)
            computed = True
            if not write_kv:
                return PlanOutcome((), forward_s)
            token_ids, logprobs, prompt = sampled
            handoff.start(plan.requests)
            outcomes = handoff.wait(plan.requests, token_ids)
            return PlanOutcome(_with_logprobs(outcomes, logprobs, prompt), forward_s)
        finally:
            handoff.close()
            for r in plan.requests:
                self.prefix.settle(r.request_id, r.prefix_keys, r.store_keys, computed)
            if computed and write_kv and plan.moves and plan.moves[self.rank].put:
                self.prefix.write_to_store(plan.moves[self.rank].put)

    def _marking(self) -> contextlib.AbstractContextManager[None]:
        if self.gpu_share is None:
            return contextlib.nullcontext()
        return self.gpu_share.marking(self.share_slot)

    def _idle(self, plan: RankPlan) -> None:
        """This rank's part of a plan another rank runs alone: none, or (experts split over
        the CP ranks) every pass's MLP collectives."""
        if self.lockstep is None:
            return
        self.in_passes = True
        with self._marking():
            self.lockstep.idle(plan)
        self.in_passes = False

    def _run(self, plan: RankPlan, shard: CpShard, handoff: KvHandoff) -> _Sampled | None:
        """Every pass, then the first tokens this rank samples; None when a peer failed."""
        rows: list[RequestRows] = []
        logits, owners = [], []
        prompt: dict[str, list[tuple[int, TokenLogprob]]] = {}
        self.in_passes = True
        for segments in plan.passes:
            exchange = self._exchange(shard, sum(s.end - s.start for s in segments))
            if self.lockstep is not None:
                self.lockstep.begin_pass(plan, segments)
            try:
                rows = rows or [self._rows(r) for r in plan.requests]
                inp = build_pass(self.runner, shard, plan.requests, rows, segments)
                pass_logits = self._forward(inp, exchange, handoff)
                logits.append(pass_logits[: len(inp.logits_rows)])
                if self.samples:
                    self._prompt_logprobs(plan.requests, inp, pass_logits, prompt)
            except BaseException:
                if exchange is not None and self.lockstep is None:
                    exchange.poison_rest()  # the peers wait in this pass's next all-gather
                raise
            if exchange is not None and exchange.peer_failed():
                return None
            owners += inp.logits_requests
        self.in_passes = False
        if not self.samples:  # the group's first TP rank samples
            return {}, {}, prompt
        token_ids, logprobs = self._sample(plan.requests, torch.cat(logits), owners)
        return token_ids, logprobs, prompt

    def _exchange(self, shard: CpShard, num_tokens: int) -> KvExchange | None:
        if shard.world_size == 1:
            return None
        num_layers = self.runner.model.config.text.num_hidden_layers
        return KvExchange(
            self.group,
            shard.rank,
            shard.sizes(num_tokens),
            num_layers,
            self._kv_width,
            self.runner.dtype,
            self.exchange_device,
        )

    def _rows(self, request: RankRequest) -> RequestRows:
        embeds = override = None
        if request.num_image_tokens:
            embeds = self.embeddings.rows(
                request.row_start, request.num_image_tokens
            )  # [n, embedding_row_width]
        if request.prompt_embeds:
            override = override_rows(request, self.runner.model.config.text.hidden_size)
        return request_rows(request, embeds, override, self.spatial_merge_size)

    @torch.inference_mode()
    def _forward(
        self, inp: PassInput, exchange: KvExchange | None, handoff: KvHandoff
    ) -> torch.Tensor:
        """Logits [len(inp.logits_rows) + len(inp.prompt_rows), vocab] fp32 of one pass."""
        runner = self.runner
        with ops.on_device(runner.device):
            wanted = inp.logits_rows + inp.prompt_rows
            rows = torch.tensor(wanted, dtype=torch.long, device=runner.device)
            if exchange is None:  # the whole pass here: the runner's prefill graphs may run it
                return runner.forward_extend(
                    inp.embeds, inp.positions, inp.batch, rows, handoff.layer_done
                )
            self.cp_attention.begin_pass(exchange, inp.gathered_slots)
            self.cp_attention.plan(inp.batch)
            return runner.model(
                inp.embeds,
                inp.positions.to(runner.device),
                self.cp_attention,
                rows,
                handoff.layer_done,
            )

    def _prompt_logprobs(
        self,
        requests: tuple[RankRequest, ...],
        inp: PassInput,
        pass_logits: torch.Tensor,  # [len(logits_rows) + len(prompt_rows), vocab] fp32
        into: dict[str, list[tuple[int, TokenLogprob]]],
    ) -> None:
        """The logprob of the prompt token after each of ``inp.prompt_rows``' positions."""
        if not inp.prompt_owners:
            return
        logits = pass_logits[len(inp.logits_rows) :]
        next_ids = [requests[i].token_ids[p + 1] for i, p in inp.prompt_owners]
        chosen = torch.tensor(next_ids, dtype=torch.long, device=logits.device)
        asks = [
            (j, requests[i].params.num_prompt_logprobs)
            for j, (i, _) in enumerate(inp.prompt_owners)
        ]
        rows = self.sampler.logprobs(logits, chosen, asks)
        assert rows is not None
        for (i, position), logprob in zip(inp.prompt_owners, rows.to_list(), strict=True):
            into.setdefault(requests[i].request_id, []).append((position + 1, logprob))

    def _sample(
        self, requests: tuple[RankRequest, ...], logits: torch.Tensor, owners: list[int]
    ) -> tuple[dict[str, int], dict[str, TokenLogprob]]:
        if not owners:
            return {}, {}
        picked = [requests[i] for i in owners]
        params = [r.params for r in picked]
        generators = [make_generator(p.seed, self.runner.device) for p in params]
        penalized = self.sampler.apply_penalties(
            logits, params, [list(r.token_ids) for r in picked], [[] for _ in picked]
        )
        apply_grammar_masks(penalized, self._matchers(params))
        sampled = self.sampler.sample_penalized(penalized, params, generators)
        asks = [
            (j, r.params.num_top_logprobs) for j, r in enumerate(picked) if r.params.return_logprobs
        ]
        rows = self.sampler.logprobs(logits, sampled, asks)
        logprobs: dict[str, TokenLogprob] = {}
        if rows is not None:
            listed = zip(rows.rows, rows.to_list(), strict=True)
            logprobs = {picked[j].request_id: logprob for j, logprob in listed}
        token_ids = sampled.tolist()
        return {r.request_id: t for r, t in zip(picked, token_ids, strict=True)}, logprobs

    def _matchers(self, params: list[SamplingParams]) -> list[tuple[int, Any]]:
        if all(p.grammar is None for p in params):
            return []
        if self.grammars is None:
            raise InvalidRequestError("this prefill rank samples no grammars", param="grammar")
        return [
            (row, self.grammars.matcher(p.grammar))
            for row, p in enumerate(params)
            if p.grammar is not None
        ]


# A rank's first tokens by request id, the logprobs of those whose request asked, and the
# (prompt position, logprob) of this rank's prompt tokens whose request asked.
_Sampled = tuple[dict[str, int], dict[str, TokenLogprob], dict[str, list[tuple[int, TokenLogprob]]]]


def _with_logprobs(
    outcomes: tuple[RankOutcome, ...],
    logprobs: dict[str, TokenLogprob],
    prompt: dict[str, list[tuple[int, TokenLogprob]]],
) -> tuple[RankOutcome, ...]:
    if not logprobs and not prompt:
        return outcomes
    return tuple(
        msgspec.structs.replace(
            o,
            first_logprob=logprobs.get(o.request_id),
            prompt_logprobs=tuple(prompt.get(o.request_id, ())),
        )
        for o in outcomes
    )


def override_rows(request: RankRequest, hidden_size: int) -> torch.Tensor:
    """The request's ``prompt_embeds`` as [num_tokens, hidden] (the leader checked the shape)."""
    dtype = getattr(torch, request.embeds_dtype)
    flat = torch.frombuffer(bytearray(request.prompt_embeds), dtype=dtype)
    return flat.reshape(request.num_tokens, hidden_size)
