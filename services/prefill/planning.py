"""The leader's part of a plan the ranks run: passes, CP on or off, and the merge of results.

Functions of the leader's state: ``rank_plan`` turns the scheduler's batch into the
``RankPlan`` every rank gets (what each request reads from the prefix cache and keeps in
it, recorded in the leader's ``PrefixIndex``; a batch that computes over
``max_batch_tokens`` is one long prompt, run as chunks of at most ``max_batch_tokens``:
one pass each); ``merge_results`` turns the ranks' replies into one outcome per request
(the first token from the rank that holds the last token, the KV write failed if any
rank's part failed).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from services.common.errors import StageServeError
from services.common.ranks.outcome import agreed_error
from services.common.types import TokenLogprob, finish_reason
from services.engine.config import ModelConfig
from services.prefill.messages import (
    SHARDED,
    PassSegment,
    RankOutcome,
    RankPlan,
    RankRequest,
    RankResult,
)
from services.prefill.prefix_cache import CacheAsk, CacheUse, PrefixIndex
from services.prefill.request import PrefillInput, PrefillOutput, PrefillPlan, RequestOutcome


@dataclass(frozen=True)
class CpPolicy:
    """How the leader uses its C ranks: ``--cp-block-tokens`` and ``--cp-min-tokens``."""

    block_tokens: int = 64  # block b of a pass's tokens goes to rank b % C
    min_tokens: int = 2048  # a plan that computes fewer prompt tokens runs on one rank
    max_batch_tokens: int = 8192  # tokens computed per pass: a longer prompt runs as chunks

    def solo_rank(
        self, plan_id: int, new_tokens: Callable[[Sequence[int]], int], num_ranks: int
    ) -> int:
        """SHARDED, or the rank that runs a small plan alone: the one whose cache leaves it
        the fewest tokens to compute (``new_tokens(ranks)``), rotating among equals so every
        rank serves."""
        every = range(num_ranks)
        if num_ranks > 1 and new_tokens(every) >= self.min_tokens:
            return SHARDED
        order = [(plan_id + i) % num_ranks for i in every]
        return min(order, key=lambda rank: new_tokens([rank]))


def plan_passes(
    spans: Sequence[tuple[int, int]], max_batch_tokens: int
) -> tuple[tuple[PassSegment, ...], ...]:
    """The passes that compute tokens ``[start, end)`` of each request (``spans``)."""
    if sum(end - start for start, end in spans) <= max_batch_tokens:
        return (tuple(PassSegment(i, start, end) for i, (start, end) in enumerate(spans)),)
    assert len(spans) == 1, "only a batch of one prompt passes max_batch_tokens"
    first, n = spans[0]
    return tuple(
        (PassSegment(0, s, min(s + max_batch_tokens, n)),)
        for s in range(first, n, max_batch_tokens)
    )


def rank_plan(
    plan: PrefillPlan,
    policy: CpPolicy,
    num_ranks: int,
    now_mono: float,
    cache: PrefixIndex | None = None,
) -> RankPlan:
    """The ranks' plan; deadlines go to the wall clock (ranks may live on other hosts).

    With ``cache`` each request reads its longest cached prefix that the plan's ranks hold,
    computes the rest, and the ranks keep its computed full pages (``PrefixIndex.plan``)."""
    to_unix = time.time() - now_mono
    asks = [CacheAsk.of(p.request, p.in_store) for p in plan.requests]

    def new_tokens(ranks: Sequence[int]) -> int:
        if cache is None:
            return plan.num_tokens
        return plan.num_tokens - cache.page_size * sum(cache.reusable(a, ranks) for a in asks)

    solo = policy.solo_rank(plan.plan_id, new_tokens, num_ranks)
    ranks = range(num_ranks) if solo == SHARDED else range(solo, solo + 1)
    uses, moves = cache.plan(asks, ranks) if cache is not None else ([CacheUse()] * len(asks), ())
    requests = tuple(
        RankRequest(
            r.request_id,
            r.token_ids,
            r.spans,
            r.params,
            r.kv_dst,
            r.deadline_mono + to_unix,
            p.row_start,
            r.trace_carrier,
            r.prompt_embeds,
            r.embeds_dtype,
            use.prefix_keys,
            use.store_keys,
            r.kv_tp_dsts,
        )
        for p, use in zip(plan.requests, uses, strict=True)
        for r in (p.request,)
    )
    page_size = cache.page_size if cache is not None else 1
    spans = [(len(r.prefix_keys) * page_size, r.num_tokens) for r in requests]
    passes = plan_passes(spans, policy.max_batch_tokens)
    return RankPlan(plan.plan_id, requests, passes, solo, policy.block_tokens, moves)


def _prompt_logprobs(
    request: PrefillInput, parts: Sequence[RankOutcome]
) -> tuple[TokenLogprob, ...]:
    """The ranks' prompt logprobs in prompt order: every token's but the first, once."""
    if request.params.num_prompt_logprobs < 0:
        return ()
    merged = sorted((p for o in parts for p in o.prompt_logprobs), key=lambda p: p[0])
    positions = [position for position, _ in merged]
    assert positions == list(range(1, request.num_tokens)), (
        f"{request.request_id}: the ranks' prompt logprobs cover positions {positions}"
    )
    return tuple(logprob for _, logprob in merged)


def merge_results(
    plan: PrefillPlan, payload: RankPlan, results: Sequence[RankResult], config: ModelConfig
) -> PrefillOutput:
    """One outcome per request (plan order); raises if the ranks ran a different plan."""
    digest = payload.digest()
    if any(d != digest for r in results for d in r.digests) or any(r.peer_failed for r in results):
        raise StageServeError(f"the prefill ranks did not all run plan {payload.plan_id}")
    parts = [{o.request_id: o for o in r.outcomes} for r in results]
    computed_from: dict[int, int] = {}  # request index -> its first computed position
    for segments in payload.passes:
        for seg in segments:
            computed_from.setdefault(seg.request, seg.start)
    outcomes = []
    for index, planned in enumerate(plan.requests):
        request = planned.request
        mine = [
            (rank, p[request.request_id]) for rank, p in enumerate(parts) if request.request_id in p
        ]
        sampled = [o for _, o in mine if o.first_token_id >= 0]
        assert len(sampled) == 1, (
            f"{request.request_id}: {len(sampled)} ranks sampled its first token"
        )
        tokens = [sampled[0].first_token_id]
        failed = [(rank, o) for rank, o in mine if o.error]
        finish = finish_reason(
            request.params,
            tokens[0],
            request.num_tokens,
            1,
            config.eos_token_ids,
            config.text.max_position_embeddings,
        )
        error = None
        if failed:
            rank, o = failed[0]
            error = agreed_error(o.error_type, f"rank {rank}: {o.error}")
        outcomes.append(
            RequestOutcome(
                request.request_id,
                tokens[0],
                finish,
                sum(o.num_kv_bytes for _, o in mine),
                max(o.kv_transfer_s for _, o in mine),
                error=error,
                first_logprob=sampled[0].first_logprob,
                prompt_logprobs=_prompt_logprobs(request, [o for _, o in mine]),
                num_prefix_cached_tokens=computed_from[index],
                num_prefix_cached_image_tokens=sum(
                    max(0, min(s.offset + s.length, computed_from[index]) - s.offset)
                    for s in request.spans
                ),
            )
        )
    return PrefillOutput(plan.plan_id, tuple(outcomes), max(r.forward_s for r in results))
